#!/usr/bin/env bash
# Sourced by the other scripts: create the project's virtual environment (.venv)
# if needed and install npz2mmap into it, editable, with the extras in $EXTRAS.
# The install is skipped when pyproject.toml and the extras are unchanged since
# the last one that succeeded (a hash of both is kept in $VENV/.npz2mmap-setup);
# the code itself needs no reinstall, being installed editable.
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
  { cat "$ROOT/pyproject.toml"; echo "extras=$EXTRAS torch=$TORCH_SPEC root=$ROOT"; } |
    "$VENV/bin/python" -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())'
}

if [ ! -x "$VENV/bin/python" ]; then
  say "creating the virtual environment $VENV"
  "$PYTHON" -m venv "$VENV"
fi
WANTED=$(setup_hash)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANTED" ]; then
  say "$VENV is up to date (pyproject.toml and extras [$EXTRAS] unchanged)"
else
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null && ! command -v nvidia-smi >/dev/null 2>&1; then
    say "installing $TORCH_SPEC, CPU build (a few hundred MB; a minute or more the first time)..."
    pip_install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"
  fi
  say "installing npz2mmap[$EXTRAS] into $VENV, editable (numpy, click, tqdm and the extras)..."
  pip_install -e "$ROOT[$EXTRAS]"
  echo "$WANTED" >"$STAMP"
  say "done; reruns skip this step until pyproject.toml or the extras change"
fi
