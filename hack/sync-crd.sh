#!/usr/bin/env bash
# Copies the CRDs from their one source of truth (operator/splitserve_operator/crd/) into the
# Helm chart (charts/splitserve/crds/) and the plain manifests (manifests/crd/).
# --check: change nothing; exit 1 and name each copy that is missing, differs or is stale.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
src="$root/operator/splitserve_operator/crd"
targets=("$root/charts/splitserve/crds" "$root/manifests/crd")
check=false
case "${1:-}" in
  --check) check=true ;;
  "") ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

status=0
for dir in "${targets[@]}"; do
  $check || mkdir -p "$dir"
  for file in "$src"/*.yaml; do
    name=$(basename "$file")
    if $check; then
      if ! cmp -s "$file" "$dir/$name"; then
        echo "out of date: ${dir#"$root"/}/$name (run hack/sync-crd.sh)" >&2
        status=1
      fi
    else
      cp "$file" "$dir/$name"
    fi
  done
  # A CRD removed from the source must not linger in a copy.
  for copy in "$dir"/*.yaml; do
    [ -e "$copy" ] || continue
    if [ ! -e "$src/$(basename "$copy")" ]; then
      if $check; then
        echo "stale: ${copy#"$root"/} has no source in operator/splitserve_operator/crd" >&2
        status=1
      else
        rm "$copy"
      fi
    fi
  done
done
$check && [ $status -eq 0 ] && echo "CRD copies match operator/splitserve_operator/crd"
exit $status
