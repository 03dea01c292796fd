"""Selective activation checkpointing (pattern, modes) and mesh shapes."""

import copy
from fractions import Fraction

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from fms_fsdp.errors import ConfigError
from fms_fsdp.flags import parse_args
from fms_fsdp.model.initialization import init_weights
from fms_fsdp.model.variants import build_model, get_model_config
from fms_fsdp.parallel.activation_checkpointing import apply_activation_checkpointing, checkpointed_blocks
from fms_fsdp.parallel.mesh import check_tensor_parallel, mesh_shape
from fms_fsdp.parallel.parallelize import apply_autocast
from fms_fsdp.settings import mesh_of

from conftest import train

pytestmark = pytest.mark.torch_api  # also run on the oldest and newest torch (scripts/test_torch.sh)

T, F = True, False

# fms-fsdp's selective-checkpointing table for 15 blocks
PATTERNS = {
    "0": [F] * 15,
    "-1": [F] * 15,
    "1/100": [F] * 15,
    "1/5": [F, F, T, F, F] * 3,
    "0.2": [F, F, T, F, F] * 3,
    "1/3": [F, T, F] * 5,
    "1/2": [T, F] * 7 + [T],
    "3/5": [T, F, T, F, T] * 3,
    "2/3": [T, F, T] * 5,
    "1": [T] * 15,
    "2": [T] * 15,
}


@pytest.mark.parametrize("p", PATTERNS)
def test_selective_checkpointing_pattern_for_15_blocks(p):
    assert checkpointed_blocks(15, Fraction(p)) == PATTERNS[p]


def cfg(*flags):
    return parse_args(["--use_dummy_dataset", *flags])


def mesh(*flags):
    """The mesh's settings of these flags."""
    return mesh_of(cfg(*flags))


def test_mesh_shapes():
    assert mesh_shape(mesh("--sharding_strategy=fsdp"), 16, 8) == (1, 16, 1, 1, 1, 1)
    assert mesh_shape(mesh("--sharding_strategy=hsdp"), 16, 8) == (2, 8, 1, 1, 1, 1)
    assert mesh_shape(mesh("--sharding_strategy=hsdp", "--sharding_group_size=4"), 16, 8) == (4, 4, 1, 1, 1, 1)
    assert mesh_shape(mesh("--sharding_strategy=ddp"), 16, 8) == (16, 1, 1, 1, 1, 1)
    # tensor parallel innermost; data parallelism over the rest, HSDP's default group the node's share
    assert mesh_shape(mesh("--sharding_strategy=fsdp", "--tensor_parallel_size=4"), 16, 8) == (1, 4, 4, 1, 1, 1)
    assert mesh_shape(mesh("--sharding_strategy=hsdp", "--tensor_parallel_size=4"), 16, 8) == (2, 2, 4, 1, 1, 1)
    assert mesh_shape(
        mesh("--sharding_strategy=hsdp", "--tensor_parallel_size=2", "--sharding_group_size=2"), 16, 8
    ) == (4, 2, 2, 1, 1, 1)
    assert mesh_shape(mesh("--sharding_strategy=ddp", "--tensor_parallel_size=8"), 16, 8).dp == 2
    # pipeline parallel outermost: each stage's world / P ranks laid out as without it
    assert mesh_shape(mesh("--sharding_strategy=hsdp", "--pipeline_parallel_size=2"), 16, 8) == (1, 8, 1, 1, 2, 1)
    # expert parallel: a split of each shard group, not a dimension of the mesh
    assert mesh_shape(mesh("--sharding_strategy=hsdp", "--expert_parallel_size=4"), 16, 8) == (2, 8, 1, 1, 1, 4)
    # context parallel: a group of C (x T) ranks per line; HSDP's default group the node's share of lines
    assert mesh_shape(mesh("--sharding_strategy=hsdp", "--context_parallel_size=2"), 16, 8) == (2, 4, 1, 2, 1, 1)
    assert mesh_shape(
        mesh("--sharding_strategy=fsdp", "--context_parallel_size=2", "--tensor_parallel_size=2"), 16, 8
    ) == (1, 4, 2, 2, 1, 1)


@pytest.mark.parametrize(
    "flags, world, match",
    [
        (["--tensor_parallel_size=3"], (12, 4), r"--tensor_parallel_size=3 must divide the ranks per node \(4\)"),
        (
            ["--tensor_parallel_size=4", "--sharding_strategy=hsdp", "--sharding_group_size=3"],
            (16, 8),
            r"--sharding_group_size=3 does not divide the world size 16 / --tensor_parallel_size=4 = 4 data-parallel",
        ),
    ],
)
def test_tensor_parallel_size_that_does_not_fit_the_world_is_an_error(flags, world, match):
    with pytest.raises(ConfigError, match=match):
        mesh_shape(mesh(*flags), *world)


@pytest.mark.parametrize(
    "flags, match",
    [
        (
            ["--model_variant=tiny", "--tensor_parallel_size=4"],
            r"divide the model's KV heads, 2",
        ),  # 4 heads, 2 KV heads
        (["--model_variant=llama2_7b", "--tensor_parallel_size=64"], r"divide the model's attention heads, 32"),
        (["--model_variant=llama2_13b", "--tensor_parallel_size=5"], r"divide the model's FFN width, 13824"),
        (["--model_variant=tiny", "--tensor_parallel_size=2", "--vocab_size=4095"], r"vocabulary size, 4095"),
        (
            ["--model_variant=tiny", "--tensor_parallel_size=2", "--seq_length=63"],
            r"sequence length \(--seq_length\), 63",
        ),
        (["--model_variant=llama3_8b", "--tensor_parallel_size=2", "--float8=True"], r"does not combine with --float8"),
    ],
)
def test_tensor_parallel_size_that_does_not_split_the_model_is_an_error(flags, match):
    c = cfg(*flags)
    with pytest.raises(ConfigError, match=match):
        check_tensor_parallel(mesh_of(c), get_model_config(c.model_variant, c.vocab_size, c.seq_length))


def test_shard_group_that_does_not_divide_is_an_error():
    with pytest.raises(ConfigError, match="--sharding_group_size=3 does not divide the world size 4"):
        mesh_shape(mesh("--sharding_strategy=hsdp", "--sharding_group_size=3"), 4, 4)


def backward_flops(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    """Matmul FLOPs of one backward (recomputed forward matmuls included)."""
    loss = model(tokens, labels=tokens)
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    return counter.get_total_flops()


def test_checkpointed_blocks_keep_names_gradients_and_deep_copies():
    """The chosen blocks change class (as under fully_shard), not structure: same parameter names and
    checkpoint keys, same gradients; a deep copy runs its own weights (a patched forward would run the
    original's). Whole blocks recompute their matmuls in backward; per-op checkpointing keeps them, and
    offloaded blocks recompute nothing."""
    plain = build_model(get_model_config("tiny", 256), torch.device("cpu"))
    init_weights(plain, 0)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    flops = {"none": backward_flops(plain, tokens)}
    for mode in ("block", "op", "offload"):
        ac = copy.deepcopy(plain)
        ac.zero_grad(set_to_none=True)
        assert apply_activation_checkpointing(ac, Fraction(1), mode) == plain.config.nlayers
        kind = "Offloaded" if mode == "offload" else "Checkpointed"
        assert type(ac.base_model.layers[0]).__name__ == f"{kind}LLaMABlock"
        assert isinstance(ac.base_model.layers[0], type(plain.base_model.layers[0]))
        assert [n for n, _ in ac.named_parameters()] == [n for n, _ in plain.named_parameters()]
        assert ac.state_dict().keys() == plain.state_dict().keys()
        flops[mode] = backward_flops(ac, tokens)
        for (name, a), b in zip(plain.named_parameters(), ac.parameters()):
            assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7), (mode, name)
        twin = copy.deepcopy(ac)
        with torch.no_grad():
            for p in twin.base_model.layers.parameters():
                p.zero_()
            assert not torch.equal(twin(tokens), ac(tokens)), mode
    assert flops["op"] == flops["offload"] == flops["none"] < flops["block"], flops


def test_an_autocast_model_is_still_its_class_with_its_keys_and_runs_under_autocast():
    """apply_autocast swaps the model's class for Autocast<class>: same object type for isinstance,
    same state_dict, fp32 parameters, and its forward is the class's under bf16 autocast (not fp32)."""
    plain = build_model(get_model_config("tiny", 256), torch.device("cpu"))
    init_weights(plain, 0)
    model = copy.deepcopy(plain)
    apply_autocast(model)
    assert isinstance(model, type(plain)) and type(model).__name__ == f"Autocast{type(plain).__name__}"
    assert model.state_dict().keys() == plain.state_dict().keys()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(tokens)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            expected = plain(tokens)
        assert out.dtype == expected.dtype and torch.equal(out, expected)
        assert not torch.equal(out.float(), plain(tokens).float())


@pytest.mark.slow
def test_offloaded_activations_train_two_fsdp_ranks_as_without(tmp_path):
    """--ac_mode=offload on every block under FSDP (its gathered weights saved for backward go to the host
    and back too): the losses of the run that keeps its activations."""
    runs = {}
    for name, ac in (("kept", []), ("offloaded", ["--fsdp_activation_checkpointing=True", "--ac_mode=offload"])):
        runs[name] = [
            r["loss"] for r in train(tmp_path / name, ["--num_steps=4", "--batch_size=2", *ac]) if "loss" in r
        ]
    assert len(runs["kept"]) == 4 and runs["offloaded"] == pytest.approx(runs["kept"], rel=1e-6)
