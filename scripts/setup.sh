#!/usr/bin/env bash
# Sourced by the other scripts: create the project's virtual environment (.venv)
# if needed and install npz2mmap into it, editable, with the extras in $EXTRAS.
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

pip_install() { "$VENV/bin/python" -m pip install --quiet "$@" 2> >(grep -v "is ignored: it is neither" >&2); }

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV" >&2
  "$PYTHON" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null && ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "setup: installing $TORCH_SPEC (CPU build)" >&2
  pip_install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"
fi
pip_install -e "$ROOT[$EXTRAS]"
