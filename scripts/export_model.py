"""Export the model of a checkpoint folder to one safetensors file (the logic:
fms_fsdp/checkpoint/export.py, behind fms_fsdp/cli.py; installed as `fms-export-model`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from fms_fsdp.cli import export_model  # noqa: E402

if __name__ == "__main__":
    export_model()
