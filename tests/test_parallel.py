"""Selective activation checkpointing pattern and mesh shapes."""

from fractions import Fraction

import pytest

from fms_fsdp.config import parse_args
from fms_fsdp.errors import ConfigError
from fms_fsdp.parallel import checkpointed_blocks, mesh_shape

T, F = True, False

# fms-fsdp's table for 15 blocks (../shared/REFERENCE.md)
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


def test_mesh_shapes():
    assert mesh_shape(cfg("--sharding_strategy=fsdp"), 16, 8) == (1, 16)
    assert mesh_shape(cfg("--sharding_strategy=hsdp"), 16, 8) == (2, 8)
    assert mesh_shape(cfg("--sharding_strategy=hsdp", "--sharding_group_size=4"), 16, 8) == (4, 4)
    assert mesh_shape(cfg("--sharding_strategy=ddp"), 16, 8) == (16, 1)


def test_shard_group_that_does_not_divide_is_an_error():
    with pytest.raises(ConfigError, match="--sharding_group_size=3 does not divide the world size 4"):
        mesh_shape(cfg("--sharding_strategy=hsdp", "--sharding_group_size=3"), 4, 4)
