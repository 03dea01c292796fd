#!/usr/bin/env bash
# The lm-eval-harness tests (tests/test_harness.py) with the harness extra installed in the test
# environment (.venv, made by scripts/test.sh): the README's test command skips them (lm-eval is a
# large install for a 7-minute suite); CI runs this after it.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${VIRTUAL_ENV:-}" ] || . .venv/bin/activate
python -m pip install -q -r requirements-harness.txt
exec python -m pytest tests/test_harness.py "$@"
