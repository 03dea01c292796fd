"""Plot loss, learning rate and tokens/s of one or more runs (the logic: fms_fsdp/metrics/plot.py, behind fms_fsdp/cli.py; installed as
`fms-plot-metrics`): python scripts/plot_metrics.py run1/metrics.jsonl run2/metrics.jsonl -o curves.png"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from fms_fsdp.cli import plot_metrics  # noqa: E402

if __name__ == "__main__":
    plot_metrics()
