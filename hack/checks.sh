#!/usr/bin/env bash
# Source-of-truth checks CI runs before the tests: generated gRPC stubs are current and the
# CRD copies in the chart and manifests/ match the operator's source.
set -euo pipefail
cd "$(dirname "$0")/.."
bash hack/gen-protos.sh --check
bash hack/sync-crd.sh --check
echo "checks: protos and CRD copies are current"
