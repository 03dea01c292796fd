"""fms-compare-runs: two runs' loss and gradient norm step by step, the largest gap, and an exit status
that follows the tolerance (0 within, 1 beyond, 2 on bad input)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

BIN = Path(sys.executable).parent


def write_run(folder: Path, losses: dict[int, float], norms: dict[int, float]) -> Path:
    folder.mkdir(parents=True)
    lines = [json.dumps({"step": s, "loss": losses[s], "grad_norm": norms[s], "lr": 1e-3}) for s in losses]
    lines.insert(2, json.dumps({"step": 2, "eval_loss": 9.0}))  # an evaluation record of a step
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def compare(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [str(BIN / "fms-compare-runs"), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


def test_the_status_follows_the_tolerance_and_the_largest_gap_is_named(tmp_path):
    losses = {s: 10.0 / s for s in range(1, 11)}
    norms = {s: 1.0 + s / 10 for s in range(1, 11)}
    a = write_run(tmp_path / "a", losses, norms)
    b = write_run(tmp_path / "b", {**losses, 5: losses[5] * 1.01}, norms)  # 1% apart at step 5

    same = compare(str(a), str(a / "metrics.jsonl"), "--rtol=0", "--atol=0")
    assert same.returncode == 0 and "within the tolerance (rtol 0, atol 0) over 10 steps" in same.stdout, same.stderr
    assert len(same.stdout.splitlines()) == 1 + 10 + 2  # header, a line per step, the largest gap, the verdict

    apart = compare(str(a), str(b))
    assert apart.returncode == 1, apart.stderr
    assert "largest gap: loss at step 5: 2 vs 2.02 (|A - B| 2.00e-02, relative 9.90e-03)" in apart.stdout
    assert "beyond the tolerance (rtol 0.001, atol 1e-06) at 1 of 10 steps, first at step 5 (loss)" in apart.stdout
    assert compare(str(a), str(b), "--rtol=0.02").returncode == 0
    assert compare(str(a), str(b), "--steps=4", "--rtol=0", "--atol=0").returncode == 0  # step 5 not compared

    # steps 9 and 10 logged before a stop, then again after the resume: the last values count
    resumed = write_run(tmp_path / "resumed", {**losses, 9: 99.0, 10: 99.0}, norms)
    with (resumed / "metrics.jsonl").open("a") as f:
        for s in (9, 10):
            f.write(json.dumps({"step": s, "loss": losses[s], "grad_norm": norms[s]}) + "\n")
    assert compare(str(resumed), str(a), "--rtol=0", "--atol=0").returncode == 0


def test_bad_input_is_one_line_and_status_2(tmp_path):
    a = write_run(tmp_path / "a", {1: 1.0}, {1: 1.0})
    b = write_run(tmp_path / "b", {2: 1.0}, {2: 1.0})
    for args, says in (
        ([str(a), str(b)], f"error: {a} and {b} have no training step in common: nothing to compare"),
        ([str(a), str(tmp_path / "none")], f"error: {tmp_path / 'none'}: no such metrics file"),
        ([str(a), str(a), "--rtol=-1"], "error: --rtol=-1.0 --atol=1e-06: tolerances are >= 0"),
    ):
        proc = compare(*args)
        assert proc.returncode == 2 and proc.stderr.startswith(says) and proc.stderr.count("\n") == 1, proc.stderr


def test_a_non_finite_value_matches_only_itself():
    from fms_fsdp.metrics.compare import Gap

    assert not Gap(step=1, key="loss", a=2.0, b=float("inf")).within(rtol=1.0, atol=1.0)
    assert not Gap(step=1, key="loss", a=float("nan"), b=2.0).within(rtol=1.0, atol=1.0)
    assert Gap(step=1, key="loss", a=float("inf"), b=float("inf")).within(rtol=0.0, atol=0.0)
    assert Gap(step=1, key="loss", a=2.0, b=float("inf")).relative == float("inf")
