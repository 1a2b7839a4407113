#!/usr/bin/env bash
# KEDA's ScaledObject CustomResourceDefinition, exactly as KEDA publishes it, taken from the
# github.com/kedacore/keda/v2 Go module (no release download): the test plane serves it so the
# operator's ScaledObjects are checked against KEDA's own schema. Cached per version under
# $SPLITSERVE_CACHE/keda-<version>/; prints the file's path (a second run returns at once).
set -euo pipefail
KEDA_VERSION=${KEDA_VERSION:-v2.21.0}
cache=${SPLITSERVE_CACHE:-$HOME/.cache/splitserve}
out="$cache/keda-$KEDA_VERSION/keda.sh_scaledobjects.yaml"
if [ -s "$out" ]; then echo "$out"; exit 0; fi
mkdir -p "$(dirname "$out")"
work=$(mktemp -d)
trap 'chmod -R u+w "$work" 2>/dev/null; rm -rf "$work"' EXIT
# A private module cache: only this one module's zip is fetched, and nothing else is touched.
dir=$(cd "$work" && GOFLAGS=-mod=mod GOTOOLCHAIN=local GOMODCACHE="$work/mod" \
  go mod download -json "github.com/kedacore/keda/v2@$KEDA_VERSION" | sed -n 's/.*"Dir": "\(.*\)",/\1/p')
src="$dir/config/crd/bases/keda.sh_scaledobjects.yaml"
[ -s "$src" ] || { echo "keda-crd.sh: $src not found in the module" >&2; exit 1; }
cp "$src" "$out.tmp" && mv "$out.tmp" "$out"
echo "$out"
