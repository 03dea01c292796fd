"""Bad steps: non-finite and spiking gradient norms are skipped on the device (--skip_bad_steps), up to
N in a row; the default stops at the first non-finite step."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from safetensors.torch import load_file

import fms_fsdp.train.step
from fms_fsdp.errors import ConfigError, TrainingError
from fms_fsdp.flags import parse_args
from fms_fsdp.optim import clip_gradients
from fms_fsdp.startup import facts
from fms_fsdp.train.guard import SPIKE_MIN_HISTORY, StepGuard

from conftest import TINY, records, run_here


def test_a_bad_step_leaves_the_weights_and_adam_state_as_they_were(one_process_group):
    cfg = parse_args([*TINY, "--skip_bad_steps=2", "--spike_sigma=6"])
    weight = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.AdamW([weight], lr=0.1, fused=True)
    guard = StepGuard(cfg.skip_bad_steps, cfg.spike_sigma, optimizer, torch.device("cpu"))
    norms = [1.0 + 0.01 * (i % 5) for i in range(SPIKE_MIN_HISTORY)] + [50.0, math.nan, 1.02, 1.01, math.inf, 80.0]
    applied = []
    for step, norm in enumerate(norms, 1):
        weight.grad = torch.full((4,), step / 10)
        before = weight.detach().clone()
        guard.judge(step, torch.tensor(2.0), torch.tensor(norm))
        optimizer.step()
        applied.append(not torch.equal(before, weight.detach()))
        assert applied[-1] == bool(guard.kept), step
    n = SPIKE_MIN_HISTORY
    assert applied == [True] * n + [False, False, True, True, False, False]  # a spike, NaN, fine, inf, spike
    assert int(optimizer.state[weight]["step"]) == n + 2  # Adam's step count leaves the skipped steps out
    assert guard.skipped_since_report() == 4 and guard.skipped_since_report() == 0
    guard.check()  # two in a row is within --skip_bad_steps=2
    guard.judge(len(norms) + 1, torch.tensor(2.0), torch.tensor(math.nan))  # the third in a row
    with pytest.raises(TrainingError, match=f"step {len(norms) + 1}: 3 bad steps in a row"):
        guard.check()


def test_early_steps_are_never_spikes_and_no_sigma_skips_only_non_finite_steps(one_process_group):
    for flags, expected in ((["--spike_sigma=6"], True), (["--spike_sigma=none"], False)):
        weight = torch.nn.Parameter(torch.zeros(2))
        optimizer = torch.optim.AdamW([weight], lr=0.1, fused=True)
        cfg = parse_args([*TINY, "--skip_bad_steps=1", *flags])
        guard = StepGuard(cfg.skip_bad_steps, cfg.spike_sigma, optimizer, torch.device("cpu"))
        for step in range(1, SPIKE_MIN_HISTORY + 2):
            weight.grad = torch.ones(2)
            guard.judge(step, torch.tensor(1.0), torch.tensor(1000.0 if step in (2, SPIKE_MIN_HISTORY + 1) else 1.0))
            optimizer.step()
            assert bool(guard.kept) or (expected and step == SPIKE_MIN_HISTORY + 1), step


def poison(monkeypatch, steps: set[int]) -> None:
    """Training's gradients turn NaN at `steps` (counted from the first step of the run)."""
    calls = itertools.count(1)

    def clip(model, max_norm, global_norm):
        norm = clip_gradients(model, max_norm, global_norm)
        if next(calls) in steps:
            for p in model.parameters():
                p.grad.mul_(math.nan)
            return norm * math.nan
        return norm

    monkeypatch.setattr(fms_fsdp.train.step, "clip_gradients", clip)


def test_a_run_skips_nan_steps_then_stops_after_too_many_in_a_row(tmp_path, monkeypatch):
    out = tmp_path / "skip"
    poison(monkeypatch, {3, 5})
    run_here([f"--ckpt_save_path={out}", "--num_steps=6", "--skip_bad_steps=1", "--export_model_at_end=True"])
    logged = records(out)
    assert [r["skipped_steps"] for r in logged] == [0, 0, 1, 0, 1, 0]
    assert all(math.isfinite(r["loss"]) for r in logged if r["skipped_steps"] == 0)
    assert all(torch.isfinite(t).all() for t in load_file(str(out / "model_step_6.safetensors")).values())
    poison(monkeypatch, {3, 4})
    with pytest.raises(TrainingError, match="step 4: 2 bad steps in a row .*--skip_bad_steps=1"):
        run_here([f"--ckpt_save_path={tmp_path / 'stop'}", "--num_steps=6", "--skip_bad_steps=1"])
    poison(monkeypatch, {2})
    with pytest.raises(TrainingError, match="step 2: the loss or gradient norm is not finite"):
        run_here([f"--ckpt_save_path={tmp_path / 'default'}", "--num_steps=4"])


def test_skipping_needs_the_fused_kernels():
    with pytest.raises(ConfigError, match="--skip_bad_steps leaves steps out inside the fused AdamW"):
        facts(parse_args([*TINY, "--skip_bad_steps=1", "--optimizer_impl=foreach"]))
