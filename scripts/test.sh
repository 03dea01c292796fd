#!/usr/bin/env bash
# Set up with the test dependencies, then run the whole test suite (CPU, gloo, several processes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
[ -n "${VIRTUAL_ENV:-}" ] || . .venv/bin/activate
exec python -m pytest "$@"
