"""--optimizer_state_dtype=int8 (torchao's AdamW8bit) on 2 FSDP ranks: it trains as fp32 states do within
STATES_TOL, its checkpoints (which hold the states in fp32) resume within RESUME_TOL, and with the other
setting (the states converted as they load) within STATES_TOL. torchao compiles its update on first use;
the runs compared take its eager path (TORCHDYNAMO_DISABLE), which computes the same update (the compiled
one differs by 1e-5), and one rank takes the compiled update without a warning."""

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils._pytree import tree_map_only

from fms_fsdp.flags import make_config
from fms_fsdp.optim import build_optimizer, load_low_bit_states, low_bit_state
from fms_fsdp.settings import optimizer_of
from fms_fsdp.weights.fused import plain_tensor

from conftest import TINY, launch, launch_runs, records, resume_from

# 8-bit moments round each block of 256 to its largest value's 1/127 steps: over 6 steps at the tiny
# recipe's learning rate the losses stay within 1% of fp32's (0.5% measured)
STATES_TOL = 1e-2
# a resume quantizes the checkpoint's fp32 moments again: a block whose largest momentum is negative can
# move by one step (the signed map ends at -0.993, not -1): the next losses agree within 5e-4 (1.2e-4 measured)
RESUME_TOL = 5e-4
RUN = [*TINY, "--num_steps=6", "--batch_size=2", "--sharding_strategy=fsdp", "--checkpoint_interval=3"]
EAGER = {"TORCHDYNAMO_DISABLE": "1"}


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in records(out) if "loss" in r]


@pytest.mark.slow  # two launches of 2 ranks
def test_eight_bit_states_train_as_fp32_states_and_resume_from_their_checkpoints(tmp_path):
    def run(name: str, dtype: str) -> list[str]:
        return [*RUN, f"--optimizer_state_dtype={dtype}", f"--ckpt_save_path={tmp_path / name}"]

    launch_runs(2, [run("fp32", "fp32"), run("int8", "int8")], EAGER)
    fp32, int8 = losses(tmp_path / "fp32"), losses(tmp_path / "int8")
    assert len(int8) == 6 and int8 != fp32 and int8 == pytest.approx(fp32, rel=STATES_TOL), (int8, fp32)
    # int8 resumed as int8, and each resumed with the other setting (its states converted as they load)
    resumes = {"resumed": ("int8", "int8"), "int8_to_fp32": ("int8", "fp32"), "fp32_to_int8": ("fp32", "int8")}
    for name, (saved, _) in resumes.items():
        resume_from(tmp_path / saved, 3, tmp_path / name)
    log = launch_runs(2, [run(name, now) for name, (_, now) in resumes.items()], EAGER)
    assert losses(tmp_path / "resumed") == pytest.approx(int8[3:], rel=RESUME_TOL), (losses(tmp_path / "resumed"), int8)
    assert "kept its optimizer states in int8; they load into int8" not in log
    for name, (saved, now) in list(resumes.items())[1:]:
        assert f"kept its optimizer states in {saved}; they load into {now} ones" in log, log[-3000:]
        continued, switched = {"int8": int8, "fp32": fp32}[saved][3:], losses(tmp_path / name)
        assert switched != continued and switched == pytest.approx(continued, rel=STATES_TOL), (switched, continued)


@pytest.mark.slow
def test_eight_bit_states_and_ramps_on_tensor_parallel_ranks_train_as_on_one(tmp_path):
    """tp2 (one data-parallel rank, its lines split over two): each rank quantizes its own slices, and the
    ramps of batch and line length take one rank's shapes; the losses of one rank with both."""
    ramp = ["--batch_size_schedule=0:1,2:2", "--seq_length_schedule=0:32,3:64", "--optimizer_state_dtype=int8"]
    for name, ranks, extra in (("one", 1, []), ("tp2", 2, ["--tensor_parallel_size=2"])):
        flags = [*RUN, "--num_steps=4", *ramp, *extra, f"--ckpt_save_path={tmp_path / name}"]
        proc = launch("main_training.py", flags, ranks, EAGER)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    one, tp2 = (records(tmp_path / name) for name in ("one", "tp2"))
    assert [(r["batch_size"], r["seq_length"]) for r in tp2] == [(1, 32), (1, 32), (2, 32), (2, 64)]
    assert [r["loss"] for r in tp2] == pytest.approx([r["loss"] for r in one], rel=1e-4)


@pytest.mark.slow  # 7 s: compiles the update
def test_one_rank_trains_with_torchaos_compiled_update_and_no_warning(tmp_path):
    """What a user's first try runs: one rank, torchao's update compiled by torch.compile on the CPU, with
    nothing on stderr (neither torchao's import nor the compile warns)."""
    proc = launch(
        "main_training.py", [*RUN, "--num_steps=2", "--optimizer_state_dtype=int8", f"--ckpt_save_path={tmp_path}"], 1
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(losses(tmp_path)) == 2 and not proc.stderr, proc.stderr[-3000:]  # torchao's import, compile: quiet


def test_a_checkpoints_fp32_states_load_back_into_eight_bit_ones(monkeypatch):
    """What a checkpoint holds of 8-bit states is their fp32 values (fused.plain_tensor), and loading
    quantizes them back into the optimizer's own 8-bit tensors, which stay 8-bit after set_state_dict."""
    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)  # torchao's update, eager
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.Linear(64, 128))
    optimizer = build_optimizer(model, optimizer_of(make_config(optimizer_state_dtype="int8")), torch.device("cpu"))
    model(torch.randn(4, 128)).square().mean().backward()
    optimizer.step()
    held = optimizer.state[model[0].weight]["exp_avg"]
    assert low_bit_state(held) and not low_bit_state(torch.zeros(1))
    saved = held.dequantize().clone()
    _, optim_sd = get_state_dict(model, optimizer)
    checkpoint = tree_map_only(torch.Tensor, plain_tensor, optim_sd)  # as a save writes it
    assert type(checkpoint["state"]["0.weight"]["exp_avg"]) is torch.Tensor
    held.copy_(torch.zeros_like(saved))  # what a fresh optimizer holds before a resume
    load_low_bit_states(optimizer, checkpoint)
    set_state_dict(model, optimizer, model_state_dict=model.state_dict(), optim_state_dict=checkpoint)
    loaded = optimizer.state[model[0].weight]["exp_avg"]
    assert low_bit_state(loaded) and torch.allclose(loaded.dequantize(), saved, rtol=0.02, atol=1e-6)
