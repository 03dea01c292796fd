"""Compare two runs' losses and gradient norms step by step (the logic: fms_fsdp/metrics/compare.py, behind
fms_fsdp/cli.py; installed as `fms-compare-runs`): python scripts/compare_runs.py run_a run_b --rtol=1e-3"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from fms_fsdp.cli import compare_runs  # noqa: E402

if __name__ == "__main__":
    compare_runs()
