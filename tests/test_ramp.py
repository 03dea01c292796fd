"""--batch_size_schedule and --seq_length_schedule: each step takes the shape its stage says, a run stopped
mid-ramp resumes bit-identical and, like a rescale mid-ramp, reads every document at most once with the
tokens the shapes add up to; stages may start at tokens seen (--ramp_unit=tokens); --lr_schedule_unit=tokens
moves the schedule by the steps' tokens; what cannot
hold is refused in one line; --dry_run plans the largest stage."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from fms_fsdp.data.dummy import DummyDataLoader
from fms_fsdp.errors import ConfigError
from fms_fsdp.flags import parse_args
from fms_fsdp.ledger import ledger as data_ledger
from fms_fsdp.ramp import Ramp, Resumed, Stages, steps_of_tokens
from fms_fsdp.startup import facts

from conftest import TINY, flags, launch, records, resume_from, run_here

RAMP = ["--batch_size=4", "--seq_length=128", "--batch_size_schedule=0:2,3:4", "--seq_length_schedule=0:64,5:128"]
SHAPES = {1: (2, 64), 2: (2, 64), 3: (2, 64), 4: (4, 64), 5: (4, 64), 6: (4, 128), 7: (4, 128), 8: (4, 128)}


def ramped(data: Path, out: Path, *extra: str) -> list[str]:
    return [*flags(data, out, *RAMP, "--num_steps=8", "--checkpoint_interval=4"), *extra]


def ledger(checkpoint: Path) -> tuple[int, int, list]:
    """(documents read more than once, tokens read, each document's times read) of a checkpoint's ledger
    (fms-inspect-data --ledger's, in this process)."""
    datasets, _ = data_ledger(str(checkpoint))
    twice = sum(int((d.seen > 1).sum()) for d in datasets)
    return twice, sum(d.framed for d in datasets), [d.seen.tolist() for d in datasets]


@pytest.fixture(scope="module")
def straight(data, tmp_path_factory) -> Path:
    """A one-rank run of 8 steps through both ramps, checkpointed at steps 4 (mid-ramp) and 8."""
    out = tmp_path_factory.mktemp("ramp") / "run"
    run_here(ramped(data, out))
    return out


def test_each_step_takes_its_stages_shape_and_a_run_stopped_mid_ramp_resumes_bit_identical(straight, data, tmp_path):
    history = [r for r in records(straight) if "loss" in r]
    assert {r["step"]: (r["batch_size"], r["seq_length"]) for r in history} == SHAPES
    tokens = [b * s for _, (b, s) in sorted(SHAPES.items())]
    assert [r["tokens_seen"] for r in history] == [sum(tokens[:k]) for k in range(1, 9)]

    out = resume_from(straight, 4, tmp_path / "run")
    run_here(ramped(data, out))
    again = {r["step"]: r["loss"] for r in records(out) if "loss" in r}
    assert again == {r["step"]: r["loss"] for r in history if r["step"] > 4}  # bit for bit

    twice, read, seen = ledger(straight / "checkpoints" / "step_8_ckp")
    assert twice == 0 and read == sum(b * (s + 1) for b, s in SHAPES.values())  # each line: seq_length + 1 tokens
    assert ledger(out / "checkpoints" / "step_8_ckp") == (twice, read, seen)  # the same documents


def test_stages_counted_in_tokens_start_where_those_tokens_were_seen(straight, data, tmp_path):
    """RAMP's stages given in tokens seen (3 steps of 2 x 64 tokens, then 2 of 4 x 64): the same steps, the
    same losses to the bit, a note with the stages in steps, which the checkpoints record."""
    tokens = ["--batch_size_schedule=0:2,384:4", "--seq_length_schedule=0:64,896:128", "--ramp_unit=tokens"]
    printed = run_here([*ramped(data, tmp_path / "run"), *tokens])
    note = "note: --ramp_unit=tokens on 1 data-parallel ranks: in steps, --batch_size_schedule=0:2,3:4 "
    assert note + "--seq_length_schedule=0:64,5:128" in printed
    got, want = ({r["step"]: r["loss"] for r in records(run) if "loss" in r} for run in (tmp_path / "run", straight))
    assert len(got) == 8 and got == want
    recorded = torch.load(tmp_path / "run" / "checkpoints" / "step_8_ckp" / "metadata.pth", weights_only=True)
    assert recorded["config"]["batch_size_schedule"] == "0:2,3:4" and recorded["config"]["ramp_unit"] == "steps"


def test_token_starts_become_the_first_step_before_which_they_were_seen(monkeypatch):
    """A step takes batch x line x data-parallel ranks x --grad_accum_steps tokens; a stage starts at the
    first step before which its tokens were seen, and one that a single step passes over is left out."""
    batch, seq = Stages((0, 100), (1, 2)), Stages((0, 300), (32, 64))
    ramp = steps_of_tokens(batch, seq, lines_per_step=2)  # 64 tokens a step: step 2 has seen 128
    assert (ramp.batch, ramp.seq) == (Stages((0, 2), (1, 2)), Stages((0, 4), (32, 64)))  # then 128: 384 by 4
    assert steps_of_tokens(Stages((0, 128), (1, 2)), seq, 2).batch == Stages((0, 2), (1, 2))  # 128 at step 2
    passed_over = steps_of_tokens(Stages((0, 10, 20), (1, 2, 3)), Stages((0,), (32,)), 2).batch
    assert passed_over == Stages((0, 1), (1, 3))  # 64 tokens by step 1: the stage of 2 has no step
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(name, value)
    ramp_flags = ["--batch_size=2", "--batch_size_schedule=0:1,512:2", "--ramp_unit=tokens", "--grad_accum_steps=2"]
    run = facts(parse_args([*TINY, *ramp_flags, "--tensor_parallel_size=2"]))  # 2 data-parallel ranks
    assert run.cfg.batch_size_schedule == "0:1,2:2"  # 1 x 64 x 2 ranks x 2 micro-batches: 256 a step
    assert "note: --ramp_unit=tokens on 2 data-parallel ranks: in steps, --batch_size_schedule=0:1,2:2" in run.notes


def test_a_resumed_run_keeps_the_shapes_of_its_steps_and_counts_later_stages_from_its_tokens():
    """Stages at 384 and 896 tokens seen: 2 ranks start the larger batch at step 2 and the longer lines at
    step 3 (256 tokens a step, then 512); resumed on 1 rank after step 4 (2048 tokens) the steps keep
    those shapes, and resumed after step 1 (256 tokens) the later stages start where 1 rank sees their tokens."""
    batch, seq = Stages((0, 384), (2, 4)), Stages((0, 896), (64, 128))
    two = steps_of_tokens(batch, seq, lines_per_step=2)
    assert (two.batch, two.seq) == (Stages((0, 2), (2, 4)), Stages((0, 3), (64, 128)))
    assert steps_of_tokens(batch, seq, 1, Resumed(4, 2048, two)) == two
    later = steps_of_tokens(batch, seq, 1, Resumed(1, 256, two))  # 128 more tokens by step 2, then 512 by 4
    assert (later.batch, later.seq) == (Stages((0, 2), (2, 4)), Stages((0, 4), (64, 128)))
    assert steps_of_tokens(batch, seq, 1) == Ramp(Stages((0, 3), (2, 4)), Stages((0, 5), (64, 128)))  # from 0


@pytest.mark.slow
@pytest.mark.parametrize("unit", ["steps", "tokens"])
def test_a_rescale_mid_ramp_reads_every_document_at_most_once(unit, data, tmp_path):
    """Two ranks to step 4, then one rank on from their checkpoint to step 8, with RAMP's stages in steps,
    or in the tokens that 2 ranks see before RAMP's steps 4 and 6 (768 and 1792): then the resumed rank,
    which sees 256 tokens a step where 2 ranks saw 512, starts the longer lines after 2 of its steps
    (1280 tokens seen at step 4) instead of 1."""
    out = tmp_path / "run"
    tokens = ["--batch_size_schedule=0:2,768:4", "--seq_length_schedule=0:64,1792:128", "--ramp_unit=tokens"]
    ramp, shapes = ([], SHAPES) if unit == "steps" else (tokens, {**SHAPES, 6: (4, 64)})
    proc = launch("main_training.py", [*ramped(data, out, "--num_steps=4"), *ramp], 2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    printed = run_here([*ramped(data, out), *ramp])
    history = [r for r in records(out) if "loss" in r]
    assert {r["step"]: (r["batch_size"], r["seq_length"]) for r in history} == shapes
    if unit == "tokens":
        said = "--batch_size_schedule=0:2,3:4 --seq_length_schedule=0:64,6:128"
        assert f"note: --ramp_unit=tokens on 1 data-parallel ranks, resumed at step 4: in steps, {said}" in printed
    twice, read, _ = ledger(out / "checkpoints" / "step_8_ckp")
    lines = sum(2 * b * (s + 1) for step, (b, s) in shapes.items() if step <= 4)  # two ranks
    assert twice == 0 and read == lines + sum(b * (s + 1) for step, (b, s) in shapes.items() if step > 4)


def test_the_learning_rate_counted_in_tokens_moves_by_the_steps_tokens(tmp_path):
    """A batch of 1 line for 4 steps, then 2: each early step counts half a step of the largest batch, so
    the linear decay is over 2 + 4 = 6 counted steps."""
    lr = 1e-3
    schedule = ["--lr_schedule=linear", "--warmup_steps=0", "--min_lr_ratio=0", f"--learning_rate={lr}"]
    ramp = ["--batch_size=2", "--batch_size_schedule=0:1,4:2", "--lr_schedule_unit=tokens", "--num_steps=8"]
    run_here([*ramp, *schedule, f"--ckpt_save_path={tmp_path / 'run'}"])
    counted = [0, 0.5, 1, 1.5, 2, 3, 4, 5]  # full-batch steps done before steps 1..8
    got = [r["lr"] for r in records(tmp_path / "run") if "loss" in r]
    assert got == pytest.approx([lr * (1 - x / 6) for x in counted], rel=1e-9)


def test_the_stages_and_the_synthetic_lines_follow_the_schedule():
    stages = Stages.parse("batch_size_schedule", "0:2, 1000:4,3000:8", 8, "batch_size")
    assert [stages.at(s) for s in (0, 999, 1000, 2999, 3000, 10**9)] == [2, 2, 4, 4, 8, 8]
    ramp = Ramp(Stages((0, 2), (1, 2)), Stages((0, 3), (8, 16)))
    assert [ramp.shape(s) for s in range(5)] == [(1, 8), (1, 8), (2, 8), (2, 16), (2, 16)]
    assert ramp.full_steps(5) == pytest.approx((8 + 8 + 16 + 32 + 32) / 32)
    assert ramp.lines_before(5, 2) == 1 + 1 + 1 + 1 + 2  # 5 micro-batches, 2 to a step

    def lines(rank: int, world: int, batches: int) -> list[torch.Tensor]:
        loader = DummyDataLoader(
            batch_size=2, seq_length=16, vocab_size=64, seed=0, rank=rank, world_size=world, ramp=ramp, accum=2
        )
        it = iter(loader)
        return [torch.cat([inputs, labels[:, -1:]], 1) for inputs, labels in (next(it) for _ in range(batches))]

    one, two = lines(0, 1, 10), [lines(r, 2, 10) for r in range(2)]
    assert [tuple(b.shape) for b in one] == [
        (1, 9),
        (1, 9),
        (1, 9),
        (1, 9),
        (2, 9),
        (2, 9),
        (2, 17),
        (2, 17),
        (2, 17),
        (2, 17),
    ]
    # the run's lines in order: two ranks take, batch by batch, what one rank takes in two batches
    assert torch.equal(torch.cat([two[0][0], two[1][0]]), torch.cat([one[0], one[1]]))


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--batch_size_schedule=1:2,5:4"], "--batch_size_schedule=1:2,5:4: give step:value stages from step 0"),
        (["--batch_size_schedule=0:2,5:x"], "give step:value stages from step 0 in increasing steps"),
        (["--batch_size_schedule=0:2,5:4", "--batch_size=8"], "its largest stage is 4 but --batch_size=8"),
        (["--seq_length_schedule=0:32,5:64", "--seq_length=128"], "its largest stage is 64 but --seq_length=128"),
        (
            ["--batch_size_schedule=0:1,5:2", "--batch_size=2", "--pipeline_parallel_size=2"],
            "--batch_size_schedule with --pipeline_parallel_size=2: a pipeline's stages are built for one shape",
        ),
        (["--lr_schedule_unit=tokens"], "--lr_schedule_unit=tokens: without --batch_size_schedule"),
        (["--ramp_unit=tokens"], "--ramp_unit=tokens says what the stages of --batch_size_schedule"),
        (
            ["--batch_size_schedule=0:1,5:2", "--batch_size=2", "--ramp_unit=tokens", "--seq_length_schedule=9:64"],
            "--seq_length_schedule=9:64: give token:value stages from token 0 in increasing tokens",
        ),
        (
            ["--seq_length_schedule=0:30,5:64", "--seq_length=64", "--context_parallel_size=2"],
            "lines of 30 tokens do not split over --context_parallel_size=2 and --tensor_parallel_size=1: make every stage a multiple of 4",
        ),
    ],
)
def test_what_cannot_hold_is_refused_in_one_line(extra, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        facts(parse_args([*TINY, "--plan_world_size=4", "--dry_run=True", *extra]))


def test_the_dry_run_plans_the_largest_stage(capsys):
    from fms_fsdp.cli import train

    plans = []
    for extra in ([], ["--batch_size_schedule=0:1,100:4", "--seq_length_schedule=0:32,50:64"]):
        train([*TINY, "--dry_run=True", "--batch_size=4", "--seq_length=64", *extra])
        plans.append(next(line for line in capsys.readouterr().out.splitlines() if line.startswith("PLAN ")))
    assert plans[0] == plans[1]
