"""Tokenize raw text into training shards (the logic: fms_fsdp/data/prepare/build.py, behind fms_fsdp/cli.py; installed as `fms-prepare-data`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from fms_fsdp.cli import prepare_data  # noqa: E402

if __name__ == "__main__":
    prepare_data()
