#!/usr/bin/env bash
# Set up with the test dependencies, then lint (ruff) and run the whole test suite (CPU, gloo, several
# processes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
[ -n "${VIRTUAL_ENV:-}" ] || . .venv/bin/activate
ruff check .
ruff format --check .
exec python -m pytest "$@"
