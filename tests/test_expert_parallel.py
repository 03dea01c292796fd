"""Expert parallelism (parallel/expert_parallel.py): --expert_parallel_size=2 trains to the losses of the
same mesh without it for 20 steps, on FSDP, HSDP and pipeline meshes of 4 ranks; its checkpoint of step 15
resumes at EP=1, at EP=4 and at another data-parallel size. What cannot be spread is refused in one line
(tests/error_cases.py). The runs share launches (tests/runs_worker.py)."""

from pathlib import Path

import pytest
import torch
from test_moe import SPARSE

from conftest import launch_runs, records, resume_from

# fp32: only the order of the sums differs between the meshes (measured: equal to 4 decimals)
RTOL = 2e-4
STEPS = ["--num_steps=20", "--batch_size=1"]


def run(out: Path, *extra: str) -> list[str]:
    return [*SPARSE, f"--ckpt_save_path={out}", *extra]


def losses(out: Path) -> list[list[float]]:
    """Each step's loss and gradient norm (Adam would hide a wrong scale of the experts' gradients from
    the losses, not from the norm)."""
    return [[r["loss"], r["grad_norm"]] for r in records(out) if "loss" in r]


@pytest.mark.slow  # 13 s: two 2-rank runs
@pytest.mark.torch_api  # DeviceMesh, DTensor, FSDP2 and all-to-all: also run on the oldest and newest torch
def test_two_ranks_with_their_experts_spread_train_as_without(tmp_path):
    ep1, ep2 = tmp_path / "ep1", tmp_path / "ep2"
    launch_runs(2, [run(ep1, "--num_steps=4"), run(ep2, "--num_steps=4", "--expert_parallel_size=2")])
    torch.testing.assert_close(losses(ep2), losses(ep1), rtol=RTOL, atol=0)


@pytest.fixture(scope="module")
def meshes(tmp_path_factory) -> Path:
    """20 steps of one global batch of 4 lines on 4 ranks: without expert parallelism (ep1), and at EP=2 on
    FSDP (checkpointed at step 15), HSDP 2 x 2 and a 2-stage pipeline; then fsdp's step 15 resumed at EP=1
    and EP=4 on 4 ranks, and at EP=2 on 2 ranks of 2 lines each."""
    root = tmp_path_factory.mktemp("ep")
    pipe = ["--num_steps=20", "--batch_size=2", "--pipeline_parallel_size=2", "--pipeline_microbatches=2"]
    launch_runs(
        4,
        [
            run(root / "ep1", *STEPS),
            run(root / "fsdp", *STEPS, "--expert_parallel_size=2", "--checkpoint_interval=15"),
            run(
                root / "hsdp", *STEPS, "--expert_parallel_size=2", "--sharding_strategy=hsdp", "--sharding_group_size=2"
            ),
            run(root / "pp", *pipe, "--expert_parallel_size=2"),
        ],
    )
    for name in ("to_ep1", "to_ep4", "to_dp2"):
        resume_from(root / "fsdp", 15, root / name)
    launch_runs(4, [run(root / f"to_ep{e}", *STEPS, f"--expert_parallel_size={e}") for e in (1, 4)])
    launch_runs(2, [run(root / "to_dp2", "--num_steps=20", "--batch_size=2", "--expert_parallel_size=2")])
    return root


@pytest.mark.slow  # about 50 s: four 4-rank runs of 20 steps in one launch
def test_two_expert_ranks_train_as_one_on_fsdp_hsdp_and_pipeline_meshes(meshes):
    one = losses(meshes / "ep1")
    assert len(one) == 20 and one[-1][0] < one[0][0] - 0.5
    for name in ("fsdp", "hsdp", "pp"):
        torch.testing.assert_close(losses(meshes / name), one, rtol=RTOL, atol=0, msg=name)


@pytest.mark.slow  # two more launches of 5 steps
def test_an_ep2_checkpoint_resumes_at_ep1_ep4_and_another_data_parallel_size(meshes):
    going_on = losses(meshes / "fsdp")[15:]
    # 2 ranks of 2 lines: each micro-batch's balance loss is over 2 lines, not 1, which changes the gradients
    # (measured: losses within 3.4e-3, gradient norms within 4.4e-3); the first loss, before any update, is
    # the same (1e-7): the same weights and the same lines
    for name, rtol in {"to_ep1": RTOL, "to_ep4": RTOL, "to_dp2": 1e-2}.items():
        got = losses(meshes / name)
        assert len(got) == 5, (name, got)
        torch.testing.assert_close(got, going_on, rtol=rtol, atol=0, msg=name)
        assert got[0][0] == pytest.approx(going_on[0][0], rel=RTOL), name
