"""Average the weights of several checkpoints of one run into a checkpoint of its own (the logic:
fms_fsdp/checkpoint/average.py, behind fms_fsdp/cli.py; installed as `fms-average-checkpoints`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from fms_fsdp.cli import average_checkpoints  # noqa: E402

if __name__ == "__main__":
    average_checkpoints()
