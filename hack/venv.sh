#!/usr/bin/env bash
# Creates (or reuses) the Python virtualenv for development and CI.
# The venv lives outside the clone, keyed by the Python version and the dependency list in
# pyproject.toml, so a rerun with unchanged dependencies takes seconds. Prints the path of this
# clone's venv (.venv/, below), which uses the shared one.
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
# The shared venv holds the dependencies only. This clone gets its own small venv (.venv/,
# ignored by git) that sees them through a .pth file and holds the editable install of this
# clone alone: clones sharing the dependency venv never re-point each other's `splitserve`.
# (Older versions of this script installed the project into the shared venv: this clone's
# install comes first on sys.path, so such a leftover is never imported.)
overlay="$root/.venv"
stamp="$overlay/.splitserve-$key"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$root" ]; then
  rm -rf "$overlay"
  "$py" -m venv --without-pip "$overlay"
  deps=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  own=$("$overlay/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # addsitedir, not a bare path line: the dependencies' own .pth files must run too.
  echo "import site; site.addsitedir('$deps')" > "$own/_splitserve_deps.pth"
  if ! out=$("$venv/bin/pip" --python "$overlay/bin/python" install -q --no-deps \
      --no-build-isolation -e "$root" 2>&1); then
    echo "$out" >&2
    exit 1
  fi
  # The dependencies' commands (pytest, mypy, pip, ...), run by this venv's Python so they
  # import this clone; compiled ones (ruff) are linked.
  for f in "$venv"/bin/*; do
    name=$(basename "$f")
    case "$name" in activate* | Activate.ps1 | python*) continue ;; esac
    [ -e "$overlay/bin/$name" ] && continue
    case "$(head -n1 "$f" | tr -d '\0')" in
      "#!$venv/bin/python"*) script=1 ;;
      *) script=0 ;;
    esac
    if [ "$script" = 1 ]; then
      { echo "#!$overlay/bin/python"; tail -n +2 "$f"; } > "$overlay/bin/$name"
      chmod +x "$overlay/bin/$name"
    else
      ln -s "$f" "$overlay/bin/$name"
    fi
  done
  echo "$root" > "$stamp"
fi
echo "$overlay"
