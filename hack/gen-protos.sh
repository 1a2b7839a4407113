#!/usr/bin/env bash
# Generates the Python gRPC stubs for protos/splitserve/v1/*.proto into
# workers/splitserve_workers/proto/ (imported as `from splitserve_workers.proto import serving_pb2`).
# `--check` regenerates into a temporary directory and fails if the committed stubs differ (CI).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# The Python that has grpc_tools: $PYTHON, else `python` on PATH (`make protos` puts the venv
# first), else the project venv.
py=${PYTHON:-}
if [ -z "$py" ]; then
  if command -v python >/dev/null && python -c 'import grpc_tools' 2>/dev/null; then
    py=python
  else
    py="$(bash "$root/hack/venv.sh")/bin/python"
  fi
fi
dest="$root/workers/splitserve_workers/proto"
check=0
if [ "${1:-}" = "--check" ]; then
  check=1
fi

gen() {  # gen OUTDIR: writes the package's files into OUTDIR
  local out=$1 tmp
  tmp=$(mktemp -d)
  (cd "$root/protos" && "$py" -m grpc_tools.protoc -I . \
    --python_out="$tmp" --pyi_out="$tmp" --grpc_python_out="$tmp" splitserve/v1/*.proto)
  mkdir -p "$out"
  for f in "$tmp"/splitserve/v1/*.py "$tmp"/splitserve/v1/*.pyi; do
    # protoc writes absolute imports rooted at the proto path (`from splitserve.v1 import x`);
    # the stubs live inside splitserve_workers.proto, so make them package-relative.
    sed -E 's/^from splitserve\.v1 import /from . import /' "$f" > "$out/$(basename "$f")"
  done
  # grpc_tools also writes a `<Service>Servicer` base class per service whose every method
  # answers UNIMPLEMENTED. The workers implement their services whole and register them with
  # add_<Service>Servicer_to_server, which looks every method up at registration: without the
  # base classes a missing method fails the worker's start instead of a client's call later.
  "$py" - "$out"/*_pb2_grpc.py <<'PY'
import re
import sys

for path in sys.argv[1:]:
    text = open(path).read()
    # A class block runs to the next top-level statement.
    text = re.sub(r"\nclass \w+Servicer:\n.*?\n(?=\S)", "\n", text, flags=re.S)
    open(path, "w").write(text)
PY
  cat > "$out/__init__.py" <<'PY'
"""Generated gRPC stubs for protos/splitserve/v1 (hack/gen-protos.sh writes them; do not edit)."""
PY
  rm -rf "$tmp"
}

if [ $check -eq 1 ]; then
  tmp_out=$(mktemp -d)
  trap 'rm -rf "$tmp_out"' EXIT
  gen "$tmp_out"
  if ! diff -ru --exclude=__pycache__ "$dest" "$tmp_out"; then
    echo "protobuf stubs are stale: run hack/gen-protos.sh" >&2
    exit 1
  fi
  echo "protobuf stubs are current"
else
  rm -f "$dest"/*_pb2.py "$dest"/*_pb2.pyi "$dest"/*_pb2_grpc.py
  gen "$dest"
  echo "wrote $dest"
fi
