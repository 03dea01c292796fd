"""Loss curves from metrics.jsonl: training (and, when recorded, eval) loss, learning rate and
tokens/s/rank against steps or tokens, for one run or several side by side (`scripts/plot_metrics.py`,
`fms-plot-metrics`; matplotlib is the optional extra `plot`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fms_fsdp.errors import ConfigError
from fms_fsdp.storage import location

# (panel title, metrics.jsonl keys drawn in it)
PANELS = [("loss", ("loss", "eval_loss")), ("learning rate", ("lr",)), ("tokens/s/rank", ("tokens_per_sec_per_gpu",))]


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """A run's records merged per step (training and eval records of a step together; a step logged
    twice, before a kill and after the resume, keeps its last values); unreadable lines are skipped, a
    file without records is an error."""
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{path}: no such metrics file (give a run's metrics.jsonl or its --ckpt_save_path)")
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
            by_step.setdefault(int(record["step"]), {}).update(record)
        except (ValueError, KeyError, TypeError):
            continue
    if not by_step:
        raise ConfigError(f"{path}: no metric records in it")
    return [by_step[s] for s in sorted(by_step)]


def plot_runs(paths: list[str], output: str, x: str = "step") -> Path:
    """One figure with a panel per PANELS entry, a line per run and key; written to `output`."""
    if x not in ("step", "tokens"):
        raise ConfigError(f"--x: {x!r} is not one of step, tokens")
    if not paths:
        raise ConfigError("give one or more metrics.jsonl files (or run folders)")
    runs = {path: read_metrics(location(path, "metrics")) for path in paths}  # object storage too
    try:
        import matplotlib
    except ImportError:
        raise ConfigError(
            "plotting needs matplotlib: pip install matplotlib (or the project's extra: pip install .[plot])"
        ) from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.6))
    for ax, (title, keys) in zip(axes, PANELS):
        for path, records in runs.items():
            name = Path(path).parent.name if Path(path).name == "metrics.jsonl" else Path(path).name
            for key in keys:
                points = [(r["tokens_seen"] if x == "tokens" else r["step"], r[key]) for r in records if key in r]
                if points:
                    ax.plot(*zip(*points), label=f"{name} {key}" if len(keys) > 1 else name)
        ax.set(title=title, xlabel="tokens" if x == "tokens" else "step")
        ax.legend(fontsize=8)
    fig.tight_layout()
    target = Path(output)
    tmp = target.with_name(f".{target.name}.tmp{target.suffix}")
    fig.savefig(tmp, dpi=110)
    tmp.replace(target)
    plt.close(fig)
    return target
