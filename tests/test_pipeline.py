"""Pipeline parallelism's plan (fms_fsdp/parallel/pipeline.py): the stages each rank holds, the split of the
blocks, the microbatches, and every start-up error in one line. The runs themselves (every schedule
against one rank, with FSDP and TP, resumed across P) are tests/test_meshes.py's."""

import re

import pytest

from fms_fsdp.errors import ConfigError
from fms_fsdp.flags import parse_args
from fms_fsdp.model.variants import get_model_config
from fms_fsdp.parallel.mesh import mesh_shape
from fms_fsdp.parallel.pipeline import PipelinePlan, balanced_split, check_pipeline
from fms_fsdp.parallel.process_group import DistInfo
from fms_fsdp.settings import mesh_of, pipeline_of

from conftest import TINY

pytestmark = pytest.mark.torch_api  # also run on the oldest and newest torch (scripts/test_torch.sh)


def plan(*args: str, variant: str = "tiny") -> PipelinePlan:
    cfg = parse_args([*TINY, f"--model_variant={variant}", *args])
    model_config = get_model_config(variant, cfg.vocab_size)
    check_pipeline(pipeline_of(cfg), model_config)
    result = PipelinePlan.of(pipeline_of(cfg), model_config)
    assert result is not None
    return result


def test_looped_and_v_shaped_schedules_give_each_rank_its_stages(monkeypatch):
    from fms_fsdp import compat

    monkeypatch.setattr(compat, "TORCH", (2, 13))  # V-shaped schedules run from torch 2.13
    looped = plan("--pipeline_parallel_size=2", "--batch_size=4")
    assert (looped.schedule, looped.stages, looped.microbatches) == ("Interleaved1F1B", 4, 4)
    assert looped.stages_of(0) == [0, 2] and looped.stages_of(1) == [1, 3]
    v = plan("--pipeline_parallel_size=2", "--pipeline_schedule=ZBVZeroBubble", "--batch_size=4")
    assert v.stages_of(0) == [0, 3] and v.stages_of(1) == [1, 2]
    single = plan("--pipeline_parallel_size=4", "--pipeline_schedule=1F1B", "--batch_size=8")
    assert single.stages_of(3) == [3] and single.microbatches == 4  # the fewest dividing 8, >= 4 stages
    assert single.blocks == ((0, 1), (1, 2), (2, 3), (3, 4))


def test_the_split_balances_the_embedding_and_head_against_the_blocks():
    """llama3_8b's 128k-token head and embedding each weigh about 2.4 blocks: the first and last of 4
    stages take fewer of its 32 blocks; an explicit split is taken as given."""
    blocks = balanced_split(get_model_config("llama3_8b"), 4)
    sizes = [stop - start for start, stop in blocks]
    assert sum(sizes) == 32 and blocks[0][0] == 0 and blocks[-1][1] == 32
    assert sizes[0] < sizes[1] and sizes[-1] < sizes[2], sizes
    given = plan("--pipeline_parallel_size=2", "--pipeline_schedule=GPipe", "--pipeline_split=1,3")
    assert given.blocks == ((0, 1), (1, 4))


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--pipeline_parallel_size=4"],
            "--pipeline_parallel_size=4 x 2 stage(s) per rank (the default of --pipeline_schedule=Interleaved1F1B)"
            " = 8 stages, more than tiny's 4 blocks: every stage needs a block; set --pipeline_stages_per_rank=1, "
            "use a one-stage schedule (--pipeline_schedule=1F1B or GPipe), or lower --pipeline_parallel_size",
        ),
        (
            ["--pipeline_parallel_size=4", "--pipeline_stages_per_rank=3"],
            "4 x 3 stage(s) per rank = 12 stages, more than tiny's 4 blocks: every stage needs a block; lower "
            "--pipeline_stages_per_rank or --pipeline_parallel_size",
        ),
        (
            ["--pipeline_parallel_size=2", "--pipeline_microbatches=3"],
            "--pipeline_microbatches=3 must divide --batch_size=2",
        ),
        (
            ["--pipeline_parallel_size=2", "--pipeline_schedule=1F1B", "--batch_size=1"],
            "1F1B needs at least as many microbatches as stages (2), not 1",
        ),
        (
            [
                "--pipeline_parallel_size=4",
                "--pipeline_schedule=Interleaved1F1B",
                "--pipeline_stages_per_rank=1",
                "--batch_size=9",
                "--pipeline_microbatches=9",
            ],
            "a multiple of its rounds (9 // 4 ranks = 2)",
        ),
        (
            ["--pipeline_parallel_size=2", "--pipeline_schedule=GPipe", "--pipeline_stages_per_rank=2"],
            "runs one stage per rank",
        ),
        (
            ["--pipeline_parallel_size=2", "--pipeline_schedule=DualPipeV", "--pipeline_stages_per_rank=3"],
            "exactly 2 stages per rank",
        ),
        (
            ["--pipeline_parallel_size=2", "--pipeline_schedule=GPipe", "--pipeline_split=2,3"],
            "adding up to the model's 4 blocks",
        ),
        (["--pipeline_parallel_size=2", "--grad_accum_steps=2"], "does not combine with --grad_accum_steps"),
        (
            ["--pipeline_parallel_size=2", "--eval_harness_tasks=hellaswag"],
            "does not combine with --eval_harness_tasks",
        ),
    ],
)
def test_pipeline_errors_name_the_flag_and_numbers_at_start_up(args, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        plan(*args)


def test_the_world_must_divide_by_the_stages_and_the_schedule_be_torchs():
    with pytest.raises(ConfigError, match=re.escape("--pipeline_parallel_size=2 must divide the world size 3")):
        mesh_shape(mesh_of(parse_args([*TINY, "--pipeline_parallel_size=2"])), 3, 3)
    with pytest.raises(ConfigError, match="--pipeline_schedule"):
        parse_args([*TINY, "--pipeline_schedule=OneFOneB"])
    assert mesh_shape(mesh_of(parse_args([*TINY, "--pipeline_parallel_size=2"])), 8, 8).dims() == [
        ("pp", 2),
        ("replicate", 1),
        ("shard", 4),
    ]


def test_every_stage_reads_its_data_parallel_ranks_lines_and_one_rank_saves_their_state():
    """16 ranks as PP 2 x (FSDP 4 x TP 2): ranks 0-7 hold the first stage, 8-15 the second; rank r's
    data-parallel rank is (r % 8) // 2 on both; the first stage's TP leaders write the loader states."""
    infos = [DistInfo(r, 16, r % 8, 8, None, tp=2, cp=1, pp=2) for r in range(16)]  # type: ignore[arg-type]
    assert [i.dp_rank for i in infos] == [0, 0, 1, 1, 2, 2, 3, 3] * 2 and infos[0].dp_size == 4
    assert [i.rank for i in infos if i.writes_data_state] == [0, 2, 4, 6]


def test_v_shaped_schedules_need_torch_2_13(monkeypatch):
    """torch 2.11 stopped ZBVZeroBubble and DualPipeV at their first step (a gloo pair never connected):
    refused there, in one line."""
    from fms_fsdp import compat

    monkeypatch.setattr(compat, "TORCH", (2, 11))
    with pytest.raises(ConfigError, match="--pipeline_schedule=DualPipeV needs torch 2.13 or later"):
        plan("--pipeline_parallel_size=2", "--pipeline_schedule=DualPipeV", "--batch_size=4")
