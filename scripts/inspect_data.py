"""Report what the loader will read from a data folder, and what looks wrong in it (the logic: fms_fsdp/data/inspection.py, behind fms_fsdp/cli.py; installed as `fms-inspect-data`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from fms_fsdp.cli import inspect_data  # noqa: E402

if __name__ == "__main__":
    inspect_data()
