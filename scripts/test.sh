#!/usr/bin/env bash
# Set up with the test dependencies, then lint (ruff) and run the whole test suite (CPU, gloo, several
# processes; pytest-xdist's 2 workers: `-n 0` as an argument runs it in one process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
[ -n "${VIRTUAL_ENV:-}" ] || . .venv/bin/activate
ruff check .
ruff format --check .
# two workers, each taking whole test files (a file's runs share fixtures), the slowest first
exec python -m pytest -n 2 --dist loadfile "$@"
