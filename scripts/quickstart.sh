#!/usr/bin/env bash
# Set up, then pretrain the `tiny` model on CPU with 2 processes (gloo) for 40 steps on synthetic
# token lines, printing metrics every 5 steps. Each run writes its outputs (metrics.jsonl,
# config.yaml, checkpoints/) to a new folder output/quickstart/<time>/. Extra flags are passed on,
# e.g. `bash scripts/quickstart.sh --num_steps=80`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
[ -n "${VIRTUAL_ENV:-}" ] || . .venv/bin/activate
# scripts/train.sh checks the flags before torchrun starts (a typo: one line, status 2)
NPROC_PER_NODE=2 exec bash scripts/train.sh --config=scripts/quickstart.yaml \
    --ckpt_save_path="output/quickstart/$(date +%Y%m%d-%H%M%S)" "$@"
