#!/usr/bin/env bash
# The lm-eval-harness tests (tests/test_harness.py, `-m harness`) with the harness extra installed in the test
# environment (.venv, made by scripts/test.sh): the README's test command leaves them out (lm-eval is a
# large install for a 6-minute suite); CI runs this after it.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${VIRTUAL_ENV:-}" ] || . .venv/bin/activate
python -m pip install -q -r requirements-harness.txt -c constraints-test.txt
exec python -m pytest -m harness tests/test_harness.py "$@"
