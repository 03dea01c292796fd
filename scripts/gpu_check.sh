#!/usr/bin/env bash
# One command on a GPU machine: the CUDA test tier, then a short throughput table, each figure beside
# its goal (benchmarks/gpu_check.py), everything under one folder:
#   bash scripts/gpu_check.sh [--out=FOLDER] [--steps=20] [--skip=8] [--tier=False]
# It runs with the torch the machine has (a CUDA build, >= 2.11) and installs nothing when the other
# packages are there; otherwise it installs them from $WHEELS (default wheels/: a machine without
# internet, see docs/performance.md) or else from the package index. Without a GPU: one line, status 1.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -n "${VIRTUAL_ENV:-}" ] || { [ -x .venv/bin/python ] && python=.venv/bin/python; }
if ! "$python" -c 'import torch' 2>/dev/null; then
  echo "gpu_check: $python has no torch: install torch's CUDA build (>= 2.11) first" >&2
  exit 1
fi
if ! "$python" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
  exec "$python" benchmarks/gpu_check.py "$@"  # says there is no GPU, in one line
fi
needed='import fms, numpy, pyarrow, tqdm, yaml, safetensors, torchao, pytest'
if ! "$python" -c "$needed" 2>/dev/null; then
  wheels=${WHEELS:-wheels}
  if [ -d "$wheels" ]; then
    "$python" -m pip install -q --no-index --find-links "$wheels" ibm-fms numpy pyarrow tqdm pyyaml safetensors torchao pytest
  else
    "$python" -m pip install -q ibm-fms numpy pyarrow tqdm pyyaml safetensors torchao pytest
  fi
fi
exec "$python" benchmarks/gpu_check.py "$@"
