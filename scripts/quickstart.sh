#!/usr/bin/env bash
# Set up, then pretrain the `tiny` model on CPU with 2 processes (gloo) for 40 steps on synthetic
# token lines, printing metrics every 5 steps. Outputs (metrics.jsonl, config.yaml) go to
# output/quickstart/. Extra flags are passed on, e.g. `bash scripts/quickstart.sh --num_steps=80`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
[ -n "${VIRTUAL_ENV:-}" ] || . .venv/bin/activate
exec torchrun --nproc_per_node=2 main_training.py --config=scripts/quickstart.yaml "$@"
