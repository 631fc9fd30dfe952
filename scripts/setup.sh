#!/usr/bin/env bash
# Sourced by the other scripts: create the project's virtual environment (.venv)
# if needed and install npz2mmap into it, editable, with the extras in $EXTRAS.
# The install is skipped when pyproject.toml is unchanged since the last one that
# succeeded and the extras asked for are among those installed (by name, or because
# another installed extra requires all they require: test covers torch). The stamp
# $VENV/.npz2mmap-setup keeps a hash of pyproject.toml on its first line and the
# installed extras on its second; an install adds the extras asked for to those, so
# switching between scripts/convert.sh and scripts/test.sh never installs twice.
# The code itself needs no reinstall, being installed editable.
#
# torch: when it is missing and the machine has no NVIDIA GPU, install the
# CPU build pinned below (override with TORCH_SPEC, and point pip at a CPU
# wheel index with TORCH_INDEX_URL where the default index serves CUDA builds).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${NPZ2MMAP_VENV:-$ROOT/.venv}
PYTHON=${PYTHON:-python3}
EXTRAS=${EXTRAS:-torch}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
STAMP=$VENV/.npz2mmap-setup

say() { echo "setup: $*" >&2; }
pip_install() { "$VENV/bin/python" -m pip install --quiet "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
setup_hash() {
  { cat "$ROOT/pyproject.toml"; echo "torch=$TORCH_SPEC root=$ROOT"; } |
    "$VENV/bin/python" -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())'
}
# Exit 0 if every extra in $1 (comma-separated) is in $2 or needs only what $2's extras need.
extras_covered() {
  "$VENV/bin/python" - "$ROOT/pyproject.toml" "$1" "$2" <<'PY'
import sys

wanted, installed = (set(filter(None, arg.split(","))) for arg in sys.argv[2:4])
try:
    import tomllib

    with open(sys.argv[1], "rb") as fp:
        extras = tomllib.load(fp)["project"].get("optional-dependencies", {})
except Exception:  # no tomllib (Python 3.10) or no readable table: by name only
    extras = {}
have = {req for name in installed for req in extras.get(name, [])}
sys.exit(0 if all(name in installed or set(extras.get(name, [None])) <= have for name in wanted) else 1)
PY
}

if [ ! -x "$VENV/bin/python" ]; then
  say "creating the virtual environment $VENV"
  "$PYTHON" -m venv "$VENV"
fi
WANTED=$(setup_hash)
INSTALLED=""
if [ -f "$STAMP" ] && [ "$(sed -n 1p "$STAMP")" = "$WANTED" ]; then
  INSTALLED=$(sed -n 2p "$STAMP")
fi
if [ -n "$INSTALLED" ] && extras_covered "$EXTRAS" "$INSTALLED"; then
  say "$VENV is up to date (pyproject.toml unchanged; extras [$INSTALLED] installed)"
else
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null && ! command -v nvidia-smi >/dev/null 2>&1; then
    say "installing $TORCH_SPEC, CPU build (a few hundred MB; a minute or more the first time)..."
    pip_install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"
  fi
  ALL=$(echo "$EXTRAS${INSTALLED:+,$INSTALLED}" | tr ',' '\n' | awk 'NF && !seen[$0]++' | paste -sd, -)
  say "installing npz2mmap[$ALL] into $VENV, editable (numpy, click, tqdm and the extras)..."
  pip_install -e "$ROOT[$ALL]"
  printf '%s\n%s\n' "$WANTED" "$ALL" >"$STAMP"
  say "done; reruns skip this step until pyproject.toml changes or other extras are asked for"
fi
