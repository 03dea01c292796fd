"""fms-average-checkpoints: two ranks average three checkpoints of a run into the average computed by hand
(each rank holding half of the model), the output carries the last checkpoint's other state, resumes and
exports like any checkpoint; inputs that cannot be averaged end in one line before any work."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from fms_fsdp.cli import average_checkpoints as average_command

from conftest import ROOT, TINY, launch, run_here

WEIGHTS = (1.0, 2.0, 1.0)


def whole(checkpoint: Path, tmp: Path) -> dict:
    """A checkpoint's whole state as DCP's own converter reads it."""
    tmp.mkdir(parents=True, exist_ok=True)
    dcp_to_torch_save(checkpoint, tmp / "state.pt")
    return torch.load(tmp / "state.pt", weights_only=False)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A one-rank run of 4 steps with a checkpoint at each (and a weight average, whose state rides along)."""
    out = tmp_path_factory.mktemp("average") / "run"
    run_here(
        [
            "--num_steps=4",
            "--checkpoint_interval=1",
            "--checkpoint_keep=4",
            "--ema_decay=0.9",
            f"--ckpt_save_path={out}",
        ]
    )
    return out


@pytest.mark.slow  # two ranks, an export and a resume: about 25 s
def test_two_ranks_average_by_hand_and_the_result_resumes_and_exports(run, tmp_path):
    sources = [run / "checkpoints" / f"step_{s}_ckp" for s in (2, 3, 4)]
    out = tmp_path / "averaged_ckp"
    weights = ",".join(map(str, WEIGHTS))
    proc = launch("scripts/average_checkpoints.py", [*map(str, sources), f"--out={out}", f"--weights={weights}"], 2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    held = re.search(r"on 2 rank\(s\): each held ([\d.]+) MiB of the model's ([\d.]+) MiB", proc.stdout)
    assert held and float(held.group(1)) < 0.6 * float(held.group(2)), proc.stdout  # no rank holds it whole

    states = [whole(s, tmp_path / s.name) for s in sources]
    got = whole(out, tmp_path / "got")
    shares = [w / sum(WEIGHTS) for w in WEIGHTS]
    for name, value in got["model_state"].items():
        by_hand = sum(share * state["model_state"][name] for share, state in zip(shares, states))
        torch.testing.assert_close(value, by_hand, rtol=1e-6, atol=1e-7)
    assert any(not torch.equal(got["model_state"][k], states[-1]["model_state"][k]) for k in got["model_state"])
    for part in ("optimizer_state", "ema_state"):  # the rest is the last checkpoint's, untouched
        assert torch.equal(
            torch.cat([t.flatten() for t in _tensors(got[part])]),
            torch.cat([t.flatten() for t in _tensors(states[-1][part])]),
        )
    meta = torch.load(out / "metadata.pth", weights_only=True)
    assert meta["step"] == 4 and meta["averaged_from"] == {"checkpoints": list(map(str, sources)), "weights": shares}
    assert (out / "COMPLETE").is_file() and not list(tmp_path.glob(".averaged_ckp*"))

    exported = tmp_path / "model.safetensors"
    subprocess.run(
        [sys.executable, "scripts/export_model.py", f"--load_path={out}", f"--save_path={exported}"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    assert all(torch.equal(t, got["model_state"][k]) for k, t in load_file(str(exported)).items())

    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed / "checkpoints" / "step_4_ckp")
    said = run_here(["--num_steps=5", "--checkpoint_interval=1", "--ema_decay=0.9", f"--ckpt_save_path={resumed}"])
    assert f"resumed from {resumed / 'checkpoints' / 'step_4_ckp'} at step 4" in said


def _tensors(tree) -> list[torch.Tensor]:
    """Every tensor of a nested state, in a fixed order."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for k in sorted(tree, key=str) for t in _tensors(tree[k])]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return []


def refusal(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as ended:
        average_command(list(argv))
    assert ended.value.code != 0
    return capsys.readouterr().err.strip()


def test_what_cannot_be_averaged_is_refused_in_one_line(run, tmp_path, capsys):
    a, b = (str(run / "checkpoints" / f"step_{s}_ckp") for s in (3, 4))
    out = f"--out={tmp_path / 'avg'}"
    assert "give two or more checkpoint folders" in refusal(capsys, a, out)
    assert "--weights=1.0: give one weight of at least 0 per checkpoint (2)" in refusal(
        capsys, a, b, out, "--weights=1"
    )
    assert f"{run} is not a complete checkpoint folder" in refusal(capsys, a, str(run), out)
    assert "exists: give a new folder" in refusal(capsys, a, b, f"--out={run}")
    other = tmp_path / "other"
    run_here([*TINY, "--vocab_size=512", "--num_steps=1", "--checkpoint_interval=1", f"--ckpt_save_path={other}"])
    line = refusal(capsys, a, str(other / "checkpoints" / "step_1_ckp"), out)
    assert (
        line.startswith("error: ")
        and "hold different models (base_model.embedding.weight: 256x256 against 512x256)" in line
    ), line
    assert not (tmp_path / "avg").exists()
