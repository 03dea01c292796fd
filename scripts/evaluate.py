"""Evaluate a model (checkpoint folder, safetensors/.pth file or Hugging Face folder) on held-out data,
under torchrun or plain python (the logic: fms_fsdp/evaluation/evaluate.py, behind fms_fsdp/cli.py;
installed as `fms-evaluate`):
python scripts/evaluate.py --ckpt_load_path=... --eval_data_path=... [model and data flags]"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from fms_fsdp.cli import evaluate  # noqa: E402

if __name__ == "__main__":
    evaluate()
