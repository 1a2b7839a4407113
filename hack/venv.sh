#!/usr/bin/env bash
# Creates (or reuses) the Python virtualenv for development and CI.
# The venv lives outside the clone, keyed by the Python version and the dependency list in
# pyproject.toml, so a rerun with unchanged dependencies takes seconds. Prints the venv path.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${SPLITSERVE_CACHE:-$HOME/.cache/splitserve}
py=${PYTHON:-python3}
reqs=$("$py" - "$root/pyproject.toml" <<'PY'
import sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
print("\n".join(sorted(p["dependencies"] + p["optional-dependencies"]["dev"])))
PY
)
key=$( { "$py" -c 'import sys; print(sys.version)'; echo "$reqs"; } | sha256sum | cut -c1-16)
venv="$cache/venv-$key"
mkdir -p "$cache"
# One creator at a time: concurrent callers wait for it instead of building over each other.
exec 9>"$venv.lock"
flock 9
if [ ! -f "$venv/.complete" ]; then
  echo "creating virtualenv $venv" >&2
  rm -rf "$venv"
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip setuptools wheel >&2
  echo "$reqs" > "$venv/requirements.in"
  "$venv/bin/pip" install -q -r "$venv/requirements.in" >&2
  "$venv/bin/pip" freeze > "$venv/requirements.lock"
  touch "$venv/.complete"
fi
# Point the editable install at this clone (a few seconds; clones may move).
if ! out=$("$venv/bin/pip" install -q --no-deps --no-build-isolation -e "$root" 2>&1); then
  echo "$out" >&2
  exit 1
fi
echo "$venv"
