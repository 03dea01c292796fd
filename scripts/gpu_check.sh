#!/usr/bin/env bash
# One command on a GPU machine: the CUDA test tier, then a short throughput table, each figure beside
# its goal (benchmarks/gpu_check.py, which says so in one line, status 1, where there is no GPU):
#   bash scripts/gpu_check.sh [--out=FOLDER] [--steps=20] [--skip=8] [--tier=False]
# It runs with the torch the machine has (a CUDA build, >= 2.11) and installs nothing when the other
# packages are there; otherwise it installs them from $WHEELS (default wheels/: a machine without
# internet, see docs/performance.md) or else from the package index.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -n "${VIRTUAL_ENV:-}" ] || { [ -x .venv/bin/python ] && python=.venv/bin/python; }
exec "$python" benchmarks/gpu_check.py "$@"
