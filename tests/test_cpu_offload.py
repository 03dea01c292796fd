"""--cpu_offload (FSDP2's CPUOffloadPolicy): two ranks train to the losses and gradient norms of the run
without it, bit for bit, and its checkpoint resumes without it; one rank, which has no FSDP, is refused
(tests/error_cases.py). On a CPU the host is the device, so only the plumbing and the plan's arithmetic
(tests/test_memory.py) are checked here: the device memory it saves needs two GPUs."""

import pytest

from conftest import TINY, launch, records, resume_from

RUN = [*TINY, "--num_steps=6", "--batch_size=2", "--checkpoint_interval=3"]


def trained(out, *extra: str) -> list[list[float]]:
    proc = launch("main_training.py", [*RUN, f"--ckpt_save_path={out}", *extra], 2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    offloaded = "parameters, gradients and optimizer state on the host (CPU offload)" in proc.stdout
    assert offloaded == ("--cpu_offload=True" in extra)
    return [[r["loss"], r["grad_norm"]] for r in records(out) if "loss" in r]


@pytest.mark.slow  # three 2-rank runs (about 20 s)
@pytest.mark.torch_api  # FSDP2's offload policy: also run on the oldest and newest torch
def test_offloaded_training_equals_the_run_without_and_resumes_without_it(tmp_path):
    offloaded = trained(tmp_path / "offload", "--cpu_offload=True")
    assert offloaded == trained(tmp_path / "plain")
    out = resume_from(tmp_path / "offload", 3, tmp_path / "resumed")
    assert trained(out) == offloaded[3:]
