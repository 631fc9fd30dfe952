#!/usr/bin/env bash
# With no arguments: set up, then run the whole path on a built-in example
# (make NPZ files, convert, inspect, verify, iterate with a 2-worker DataLoader).
# With arguments: set up, then run `npz2mmap convert ARGS...`.
# Either way it ends by saying how to have the npz2mmap command in the shell.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
activation_hint() {
  echo "npz2mmap is installed in $VENV; to have the npz2mmap command in your shell: source $VENV/bin/activate"
}
if [ "$#" -gt 0 ]; then
  "$VENV/bin/npz2mmap" convert "$@"
  activation_hint
  exit 0
fi
cd "$ROOT"
"$VENV/bin/python" scripts/example.py make example/npz
"$VENV/bin/npz2mmap" convert example/npz -o example/dataset --overwrite
"$VENV/bin/npz2mmap" inspect example/dataset
"$VENV/bin/npz2mmap" verify example/dataset --sources
"$VENV/bin/python" scripts/example.py load example/dataset
activation_hint
