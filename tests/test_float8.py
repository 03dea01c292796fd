"""Float8 training through torchao (--float8), emulated on CPU: which layers convert, a run trains
close to the plain one, FSDP2's float8 all-gather works, and checkpoints and exports keep their format:
a float8 run resumes without float8 and the reverse."""

import pytest
import torch
from safetensors.torch import load_file

from fms_fsdp.flags import make_config
from fms_fsdp.model.float8 import convert_to_float8
from fms_fsdp.model.variants import build_model, get_model_config
from fms_fsdp.settings import float8_of

from conftest import TINY, run_here, train_here
from test_checkpoint import losses, run, weights

pytestmark = pytest.mark.torch_api  # also run on the oldest and newest torch (scripts/test_torch.sh)

FLOAT8 = ["--float8=True", "--float8_min_size=16"]


def converted(min_size: int) -> list[str]:
    from torchao.float8.float8_linear import Float8Linear

    model = build_model(get_model_config("tiny", 256), torch.device("meta"))
    convert_to_float8(
        model, float8_of(make_config(model_variant="tiny", float8=True, float8_min_size=min_size)), "cpu", False
    )
    return [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]


def test_the_blocks_linear_layers_of_the_chosen_size_convert_and_never_the_head():
    names = converted(16)
    assert len(names) == 16 and all(n.startswith("base_model.layers.") for n in names)
    assert {n.rsplit(".", 1)[-1] for n in names} == {"qkv_fused", "dense", "wg1_fused", "w2"}
    assert converted(512) == []  # tiny's layers have 256 features in or out
    assert not any("head" in n for n in converted(16))


def test_a_float8_run_trains_close_to_the_plain_run(tmp_path):
    args = ["--num_steps=8", "--learning_rate=1e-3", "--batch_size=4"]
    plain = [r["loss"] for r in train_here(tmp_path / "plain", args)]
    float8 = [r["loss"] for r in train_here(tmp_path / "float8", [*args, *FLOAT8])]
    rel = [abs(a - b) / b for a, b in zip(float8, plain)]
    # within 1% on average and 5% at every step (measured: 0.6% and 3.0%, one step of a spiky batch)
    assert sum(rel) / len(rel) < 0.01 and max(rel) < 0.05, rel
    assert max(rel) > 1e-4, rel  # and not the plain run: the matmuls really are in float8


@pytest.mark.pinned_torch  # the default tier's float8 runs touch the same torch calls
@pytest.mark.slow  # three 2-rank runs (about 30 s): the slow tier
def test_float8_checkpoints_resume_without_float8_and_the_reverse_and_export_the_same(tmp_path):
    """Two ranks, FSDP with float8 all-gather (tensorwise): the checkpoint holds plain tensors; the
    last run splits each line over the two ranks (--context_parallel_size=2), float8 all-gathered over
    shard x cp."""
    out = tmp_path / "run"
    base = [
        *TINY,
        "--checkpoint_interval=2",
        "--sharding_strategy=fsdp",
        "--report_interval=1",
        "--export_model_at_end=True",
        "--learning_rate=1e-3",
        f"--ckpt_save_path={out}",
    ]
    run([*base, "--num_steps=4", "--export_interval=4", *FLOAT8])
    saved = weights(out / "checkpoints" / "step_4_ckp")
    exported = load_file(str(out / "model_step_4.safetensors"))
    periodic = load_file(str(out / "exports" / "step_4" / "model.safetensors"))  # staged and written in the background
    for export in (exported, periodic):
        assert export.keys() == saved.keys()
        assert all(torch.equal(export[k].float(), saved[k].float()) for k in saved)
    first = losses(out)
    assert "resumed from" in run_here([*base, "--num_steps=6"])  # without float8, on one rank
    back = run([*base, "--num_steps=7", *FLOAT8, "--context_parallel_size=2"]).stdout  # and back, lines split
    assert "resumed from" in back and "mesh (replicate, shard, cp) = (1, 1, 2)" in back
    after = losses(out)
    assert after.keys() == set(range(1, 8))
    # training went on from the saved weights, not from new ones (whose loss is the first step's, 6.1)
    assert all(after[s] < first[1] - 1.0 for s in (5, 6, 7)), after
    plain_export = load_file(str(out / "model_step_6.safetensors"))
    assert {k: (v.dtype, v.shape) for k, v in plain_export.items()} == {
        k: (v.dtype, v.shape) for k, v in exported.items()
    }
