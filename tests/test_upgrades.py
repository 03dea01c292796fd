"""Checkpoints across upgrades: each checkpoint kept from an earlier version (tests/kept_checkpoints.py)
resumes on today's code with the losses the writing code gave after it; a checkpoint records its layout
and the package's version and commit; a newer layout is refused in one line, by a resume, by
--ckpt_load_path and by fms_to_hf.py."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kept_checkpoints import ASSETS, KEPT_STEP, RTOL, STEPS, average_gap, expected, kept, kept_flags, run_flags

from fms_fsdp.versions import LAYOUT, installed

from conftest import ROOT, launch, records

pytestmark = pytest.mark.torch_api  # also run on the oldest and newest torch (scripts/test_torch.sh)


def resumed(name: str, out: Path) -> subprocess.CompletedProcess:
    """Kept checkpoint `name` copied into the run folder `out`, and that run resumed to STEPS on 2 ranks."""
    shutil.copytree(ASSETS / name / "checkpoints", out / "checkpoints")
    return launch("main_training.py", kept_flags(name, ASSETS / "data", out), 2)


@pytest.mark.slow  # 2 ranks each; in CI's slow tier and on every torch release (scripts/test_torch.sh)
@pytest.mark.parametrize("name", kept())
def test_a_kept_checkpoint_resumes_with_the_losses_it_gave(name, tmp_path):
    out = tmp_path / "run"
    proc = resumed(name, out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / f'step_{KEPT_STEP}_ckp'} at step {KEPT_STEP}" in proc.stdout
    losses = {str(r["step"]): r["loss"] for r in records(out) if "loss" in r}
    recorded = expected(name)["losses_after"]
    assert list(losses) == list(recorded), (losses, recorded)
    assert losses == pytest.approx(recorded, rel=RTOL), (losses, recorded)
    if "average_gap_after" in expected(name):  # the weight average went on from the kept one, not from the weights
        gap = average_gap(out / "checkpoints" / f"step_{STEPS}_ckp")
        assert gap == pytest.approx(expected(name)["average_gap_after"], rel=1e-2)
    meta = torch.load(out / "checkpoints" / f"step_{STEPS}_ckp" / "metadata.pth", weights_only=True)
    assert meta["layout"] == LAYOUT and meta["package_version"] == installed("fms-fsdp") != "not installed"
    assert len(meta["commit"].split()[0]) == 40 or meta["commit"].startswith("unknown"), meta["commit"]


def test_every_layout_has_a_kept_checkpoint():
    """A change of what a checkpoint holds raises LAYOUT and keeps a checkpoint of the new layout."""
    layouts = {expected(name)["written_by"]["layout"] for name in kept()}
    assert layouts == set(range(1, LAYOUT + 1)), layouts
    assert expected("layout1")["written_by"]["package_version"] is None  # written before layouts were recorded


@pytest.fixture
def newer(tmp_path) -> Path:
    """A run folder whose checkpoint says it has the layout after this code's."""
    out = tmp_path / "run"
    shutil.copytree(ASSETS / "layout1" / "checkpoints", out / "checkpoints")
    step = out / "checkpoints" / f"step_{KEPT_STEP}_ckp"
    meta = torch.load(step / "metadata.pth", weights_only=True)
    torch.save({**meta, "layout": LAYOUT + 1, "package_version": "9.0.0"}, step / "metadata.pth")
    return out


def refusal(step: Path) -> str:
    return (
        f"error: {step} has checkpoint layout {LAYOUT + 1}, written by fms-fsdp 9.0.0; this fms-fsdp "
        f"({installed('fms-fsdp')}) reads layouts up to {LAYOUT}: upgrade it to resume or convert this checkpoint"
    )


@pytest.mark.pinned_torch  # the package's own refusal, before any torch call
def test_a_newer_layout_is_refused_in_one_line_and_kept(newer):
    """The resume refuses it and neither falls back to an older checkpoint nor sets it aside."""
    step = newer / "checkpoints" / f"step_{KEPT_STEP}_ckp"
    proc = launch("main_training.py", run_flags(ASSETS / "data", newer, STEPS), 2)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == refusal(step), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in (newer / "checkpoints").iterdir()) == [step.name]


@pytest.mark.pinned_torch  # the package's own refusal, before any torch call
@pytest.mark.slow
def test_a_newer_layout_is_refused_by_a_load_path_and_by_the_conversion(newer, tmp_path):
    step = newer / "checkpoints" / f"step_{KEPT_STEP}_ckp"
    flags = run_flags(ASSETS / "data", tmp_path / "other", STEPS)
    proc = launch("main_training.py", [*flags, f"--ckpt_load_path={step}"], 1)
    assert proc.returncode != 0 and proc.stderr.strip().splitlines()[-1] == refusal(step), proc.stderr[-3000:]
    convert = [sys.executable, "fms_to_hf.py", f"--load_path={step}", f"--save_path={tmp_path / 'hf'}"]
    proc = subprocess.run(convert, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and proc.stderr.strip().splitlines()[-1] == refusal(step), proc.stderr[-3000:]
    assert not (tmp_path / "hf").exists()
