#!/usr/bin/env bash
# The Prometheus operator's ServiceMonitor, PodMonitor and PrometheusRule
# CustomResourceDefinitions, exactly as it publishes them, taken from the
# github.com/prometheus-operator/prometheus-operator Go module (no release download): the test
# plane serves them so the operator's monitors and alert rules are checked against their own
# schemas. Cached per version under $SPLITSERVE_CACHE/prometheus-operator-<version>/; prints
# that directory (a second run returns at once).
set -euo pipefail
PROMETHEUS_OPERATOR_VERSION=${PROMETHEUS_OPERATOR_VERSION:-v0.85.0}
cache=${SPLITSERVE_CACHE:-$HOME/.cache/splitserve}
out="$cache/prometheus-operator-$PROMETHEUS_OPERATOR_VERSION"
kinds="servicemonitors podmonitors prometheusrules"
done_marker="$out/.complete"
if [ -e "$done_marker" ]; then echo "$out"; exit 0; fi
mkdir -p "$out"
work=$(mktemp -d)
trap 'chmod -R u+w "$work" 2>/dev/null; rm -rf "$work"' EXIT
# A private module cache: only this one module's zip is fetched, and nothing else is touched.
dir=$(cd "$work" && GOFLAGS=-mod=mod GOTOOLCHAIN=local GOMODCACHE="$work/mod" \
  go mod download -json "github.com/prometheus-operator/prometheus-operator@$PROMETHEUS_OPERATOR_VERSION" \
  | sed -n 's/.*"Dir": "\(.*\)",/\1/p')
for kind in $kinds; do
  src="$dir/example/prometheus-operator-crd/monitoring.coreos.com_$kind.yaml"
  [ -s "$src" ] || { echo "monitoring-crds.sh: $src not found in the module" >&2; exit 1; }
  install -m 0644 "$src" "$out/$kind.yaml"
done
touch "$done_marker"
echo "$out"
