#!/usr/bin/env bash
# Checks CI runs before the tests: generated gRPC stubs are current, the CRD copies in the chart
# and manifests/ match the operator's source, and the code is lint-, format- and type-clean.
set -euo pipefail
cd "$(dirname "$0")/.."
bash hack/gen-protos.sh --check
bash hack/sync-crd.sh --check
# What `make lint` runs, so that a lint, format or type regression fails CI too.
V=$(bash hack/venv.sh)
"$V/bin/ruff" check --quiet .
"$V/bin/ruff" format --check --quiet .
"$V/bin/mypy"
echo "checks: protos and CRD copies are current; ruff, ruff format and mypy are clean"
