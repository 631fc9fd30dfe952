#!/usr/bin/env bash
# Set up the environment and run the checks: ruff, mypy, the import layers, the documentation
# site (built with no warnings), then the test suite.
# Extra arguments go to pytest, e.g. scripts/test.sh -k roundtrip -x
set -euo pipefail
EXTRAS=test source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$ROOT"
"$VENV/bin/ruff" check npz2mmap tests scripts
"$VENV/bin/mypy"
"$VENV/bin/lint-imports" --no-cache
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
"$VENV/bin/mkdocs" build --strict --quiet --site-dir "$site"
"$VENV/bin/python" -m pytest "$@"
