"""scripts/plot_metrics.py: curves of real runs, one or several, against steps or tokens."""

from __future__ import annotations

import pytest

from fms_fsdp.cli import plot_metrics
from fms_fsdp.errors import ConfigError
from fms_fsdp.metrics.plot import plot_runs, read_metrics

from conftest import train_here

PNG = b"\x89PNG\r\n\x1a\n"


def test_curves_of_two_runs_against_steps_and_tokens(tmp_path, capsys):
    for name, lr in (("a", "3e-3"), ("b", "1e-3")):
        train_here(tmp_path / name, ["--num_steps=4", "--batch_size=2", f"--learning_rate={lr}"])
    runs = [str(tmp_path / "a" / "run" / "metrics.jsonl"), str(tmp_path / "b" / "run")]
    assert [r["step"] for r in read_metrics(tmp_path / "b" / "run")] == [1, 2, 3, 4]
    plot_metrics([*runs, "-o", str(tmp_path / "steps.png")])  # the command line's parsing
    assert "wrote" in capsys.readouterr().out
    by_tokens = plot_runs(runs, str(tmp_path / "tokens.png"), x="tokens")
    for png in (tmp_path / "steps.png", by_tokens):
        assert png.read_bytes()[:8] == PNG and png.stat().st_size > 20_000
    assert not list(tmp_path.glob(".*.tmp*"))
    with pytest.raises(ConfigError, match="no such metrics file"):
        plot_runs([str(tmp_path / "missing")], str(tmp_path / "x.png"))
    with pytest.raises(ConfigError, match="--x: 'time' is not one of step, tokens"):
        plot_runs(runs, str(tmp_path / "x.png"), x="time")
