"""Tokenize raw text into training shards (the logic: fms_fsdp/data/prepare.py; installed as `fms-prepare-data`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from fms_fsdp.data.prepare import cli  # noqa: E402

if __name__ == "__main__":
    cli()
