"""--ema_decay: the moving average of the weights follows its formula step by step, is checkpointed and
resumed exactly, evaluated beside the weights (eval_loss_ema) and, with --export_ema, exported (also as a
Hugging Face folder that transformers loads with the package's logits)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from fms_fsdp.errors import ConfigError
from fms_fsdp.model.variants import build_model, get_model_config

from conftest import ROOT, flags, launch, records, resume_from, run_here
from test_hf import read_hf_model

DECAY = 0.5  # far from 1: four steps move the average well away from both the start and the weights


def checkpoint(run: Path, step: int, tmp: Path) -> dict[str, dict[str, torch.Tensor]]:
    """A checkpoint's whole state as DCP's own converter reads it (not the package's reader)."""
    tmp.mkdir(parents=True, exist_ok=True)
    target = tmp / f"step_{step}.pt"
    dcp_to_torch_save(run / "checkpoints" / f"step_{step}_ckp", target)
    return torch.load(target, weights_only=False)


def ema_flags(data: Path, out: Path, *extra: str) -> list[str]:
    return flags(data, out, f"--ema_decay={DECAY}", "--num_steps=4", *extra)


def averaged_flags(data: Path, out: Path) -> list[str]:
    """4 steps with the average, a checkpoint every step, evaluated at steps 2 and 4, the final model
    exported with the average."""
    evaluation = [f"--eval_data_path={data}", "--eval_interval=2", "--eval_batches=2"]
    export = ["--export_ema=True", "--export_model_at_end=True"]
    return ema_flags(data, out, "--checkpoint_interval=1", "--checkpoint_keep=4", *evaluation, *export)


@pytest.fixture(scope="module")
def averaged(data, tmp_path_factory) -> Path:
    """A one-rank run of averaged_flags."""
    out = tmp_path_factory.mktemp("ema") / "run"
    run_here(averaged_flags(data, out))
    return out


def follows_the_formula(run: Path, tmp: Path) -> None:
    """The average of step 4 is the one of step 2 moved towards the weights of steps 3 and 4."""
    states = {step: checkpoint(run, step, tmp) for step in (2, 3, 4)}
    weights = {step: s["model_state"] for step, s in states.items()}
    ema = {step: s["ema_state"] for step, s in states.items()}
    assert ema[4].keys() == weights[4].keys()
    for name, start in ema[2].items():  # average = decay x average + (1 - decay) x weights, after each step
        by_hand = DECAY * start + (1 - DECAY) * weights[3][name]
        by_hand = DECAY * by_hand + (1 - DECAY) * weights[4][name]
        torch.testing.assert_close(ema[4][name], by_hand, rtol=1e-6, atol=1e-7)
    gap = max((ema[4][k] - weights[4][k]).abs().max().item() for k in weights[4])
    assert gap > 1e-4  # the average is not the weights


def test_the_average_follows_its_formula_and_is_evaluated_and_exported(averaged, tmp_path):
    follows_the_formula(averaged, tmp_path)
    evaluations = [r for r in records(averaged) if "eval_loss" in r]
    assert [r["step"] for r in evaluations] == [2, 4]
    for r in evaluations:
        assert {"eval_loss_ema", "eval_ppl_ema"} <= r.keys() and r["eval_loss_ema"] != r["eval_loss"], r
        assert any(k.startswith("eval_loss_ema/") for k in r), r

    exported = load_file(str(averaged / "model_step_4.safetensors"))
    average = checkpoint(averaged, 4, tmp_path / "last")["ema_state"]
    assert exported.keys() == average.keys()
    assert all(torch.equal(exported[k], average[k]) for k in exported)


def test_a_run_resumed_midway_has_the_same_average_bit_for_bit(averaged, data, tmp_path):
    out = resume_from(averaged, 2, tmp_path / "run")
    run_here(averaged_flags(data, out))  # resumes at step 2, goes on to 4
    resumed, straight = checkpoint(out, 4, tmp_path / "a"), checkpoint(averaged, 4, tmp_path / "b")
    assert all(torch.equal(resumed["ema_state"][k], straight["ema_state"][k]) for k in straight["ema_state"])
    evaluated = [
        {r["step"]: r["eval_loss_ema"] for r in records(run) if "eval_loss_ema" in r} for run in (out, averaged)
    ]
    assert evaluated[0][4] == evaluated[1][4]


def test_held_on_the_host_the_average_and_its_evaluation_are_the_same(averaged, data, tmp_path):
    """--ema_on_host (here the host is the device: the copies are what a GPU run makes, not their saving):
    the average of step 4 and its evaluation are the device-held run's, to the bit."""
    out = tmp_path / "run"
    run_here([*averaged_flags(data, out), "--ema_on_host=True"])
    held, device = checkpoint(out, 4, tmp_path / "a"), checkpoint(averaged, 4, tmp_path / "b")
    assert all(torch.equal(held["ema_state"][k], device["ema_state"][k]) for k in device["ema_state"])
    evaluated = [[r["eval_loss_ema"] for r in records(run) if "eval_loss_ema" in r] for run in (out, averaged)]
    assert len(evaluated[0]) == 2 and evaluated[0] == evaluated[1]


def test_turned_on_at_a_resume_the_average_starts_at_the_resumed_weights(data, tmp_path):
    out = tmp_path / "run"
    run_here(flags(data, out, "--num_steps=2", "--checkpoint_interval=2"))
    said = run_here(ema_flags(data, out, "--checkpoint_interval=2", "--num_steps=3", "--checkpoint_keep=3"))
    assert "holds no weight average: --ema_decay's starts at its weights" in said
    before, after = checkpoint(out, 2, tmp_path / "a"), checkpoint(out, 3, tmp_path / "b")
    assert "ema_state" not in before
    for name, w in after["model_state"].items():  # one step from the resumed weights
        torch.testing.assert_close(
            after["ema_state"][name], DECAY * before["model_state"][name] + (1 - DECAY) * w, rtol=1e-6, atol=1e-7
        )


@pytest.mark.slow
def test_two_ranks_average_their_shards_and_transformers_loads_the_export_with_our_logits(data, tmp_path):
    """Two ranks (FSDP: each averages its own shards, held on the host) follow the formula on the whole
    tensors, and the Hugging Face export of the average gives the package's logits."""
    out = tmp_path / "run"
    extra = ["--checkpoint_interval=1", "--checkpoint_keep=4", "--export_ema=True", "--export_interval=4"]
    extra += ["--ema_on_host=True"]
    proc = launch("main_training.py", ema_flags(data, out, *extra, "--export_format=hf"), 2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    follows_the_formula(out, tmp_path)

    from transformers import AutoModelForCausalLM

    config = get_model_config("tiny", 1024)
    folder = out / "exports" / "step_4"
    exported = read_hf_model(str(folder), config)
    average = checkpoint(out, 4, tmp_path / "last")["ema_state"]
    assert all(torch.equal(exported[k], average[k].to(exported[k].dtype)) for k in exported)
    ours = build_model(config, torch.device("cpu"))
    ours.load_state_dict(exported)
    theirs = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32).eval()
    tokens = torch.randint(0, 1024, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        gap = (theirs(tokens).logits - ours.float().eval()(tokens)).abs().max().item()
    assert gap < 1e-4, gap


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--export_ema=True"], "--export_ema exports the weight average: set --ema_decay too"),
        (["--ema_on_host=True"], "--ema_on_host says where the weight average is held: set --ema_decay too"),
        (["--ema_decay=1"], "--ema_decay: must be < 1"),
        (["--ema_decay=0.9", "--fault_tolerance=True"], "--ema_decay with --fault_tolerance"),
    ],
)
def test_wrong_settings_are_refused_in_one_line(extra, message, data, tmp_path):
    with pytest.raises(ConfigError, match=message):
        run_here(flags(data, tmp_path / "run", *extra))


@pytest.mark.slow
def test_the_command_exports_a_checkpoints_average_or_says_it_has_none(averaged, tmp_path):
    """fms-export-model --ema=True: a checkpoint's average, the file the run itself exported with
    --export_ema; a checkpoint of a run without --ema_decay is refused in one line."""
    target = tmp_path / "average.safetensors"
    command = [sys.executable, "scripts/export_model.py", f"--save_path={target}", "--ema=True"]
    done = subprocess.run(
        [*command, f"--load_path={averaged / 'checkpoints' / 'step_4_ckp'}"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    exported, by_run = load_file(str(target)), load_file(str(averaged / "model_step_4.safetensors"))
    assert exported.keys() == by_run.keys() and all(torch.equal(exported[k], by_run[k]) for k in exported)
    plain = ROOT / "tests" / "assets" / "checkpoints" / "layout1"
    refused = subprocess.run(
        [*command, f"--load_path={next(plain.glob('**/step_*_ckp'))}"], cwd=ROOT, capture_output=True, text=True
    )
    assert refused.returncode != 0 and "holds no weight average" in refused.stderr and "--ema_decay" in refused.stderr
