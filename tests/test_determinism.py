"""--deterministic: the same command twice gives bit-identical losses, gradient norms and weights (two
ranks, FSDP, data read by loader workers), fms-compare-runs says so at zero tolerance, and what cannot be
repeatable is refused at start-up."""

import pytest
import torch
from test_compare import compare

import fms_fsdp.train.loop
from fms_fsdp.determinism import deterministic
from fms_fsdp.errors import ConfigError
from fms_fsdp.flags import parse_args
from fms_fsdp.train.step import not_deterministic_error
from fms_fsdp.weights.reader import read_model

from conftest import flags, launch, run_here

pytestmark = pytest.mark.torch_api  # also run on the oldest and newest torch (scripts/test_torch.sh)


@pytest.mark.slow  # two 2-rank runs (about 18 s): the slow tier
def test_the_same_command_twice_is_bit_identical(data, tmp_path):
    runs = [tmp_path / "a", tmp_path / "b"]
    for out in runs:
        proc = launch("main_training.py", flags(data, out, "--deterministic=True", "--num_steps=6"), 2)
        assert proc.returncode == 0, proc.stderr[-3000:]
    compared = compare(*map(str, runs), "--rtol=0", "--atol=0")
    assert compared.returncode == 0 and "within the tolerance (rtol 0, atol 0) over 6 steps" in compared.stdout
    a, b = (read_model(out / "checkpoints" / "step_6_ckp") for out in runs)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_mode_is_the_runs_alone_and_fault_tolerance_is_refused(tmp_path, monkeypatch):
    seen = []
    train_run = fms_fsdp.train.loop.train_run

    def watched(*args, **kwargs):  # the real loop, its torch settings noted
        seen.append((torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark))
        return train_run(*args, **kwargs)

    monkeypatch.setattr(fms_fsdp.train.loop, "train_run", watched)
    for on, out in ((True, "on"), (False, "off")):
        run_here([f"--deterministic={on}", "--num_steps=1", f"--ckpt_save_path={tmp_path / out}"])
    assert seen == [(True, False), (False, torch.backends.cudnn.benchmark)]
    assert not torch.are_deterministic_algorithms_enabled()  # put back: the process is as it was
    with pytest.raises(ConfigError, match="^--deterministic with --fault_tolerance: replica groups come and go"):
        parse_args(["--deterministic=True", "--fault_tolerance=True"])


def test_an_operation_without_a_deterministic_kernel_is_one_line_naming_it():
    """torch's own refusal under the mode (max_unpool2d has no deterministic CPU kernel) becomes the step's
    one line naming the operation and the flag; any other error is left as it is."""
    x = torch.arange(16.0).reshape(1, 1, 4, 4)
    pooled, where = torch.nn.functional.max_pool2d(x, 2, return_indices=True)
    with deterministic(True, 0), pytest.raises(RuntimeError) as refused:
        torch.nn.functional.max_unpool2d(pooled, where, 2)
    told = not_deterministic_error(7, refused.value)
    assert told is not None and "\n" not in str(told)
    assert str(told).startswith("step 7: --deterministic: torch ") and "max_unpooling2d_forward_out" in str(told)
    assert not_deterministic_error(7, RuntimeError("shape mismatch")) is None
