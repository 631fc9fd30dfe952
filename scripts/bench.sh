#!/usr/bin/env bash
# Set up .venv with the benchmark's extras, then run scripts/bench.py ARGS...
# e.g. scripts/bench.sh --quick, or scripts/bench.sh --scale --workdir /data/bench
set -euo pipefail
EXTRAS=bench source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
exec "$VENV/bin/python" "$ROOT/scripts/bench.py" "$@"
