"""Selective activation checkpointing: fms-fsdp's pattern of checkpointed blocks
(--selective_checkpointing) and what a checkpointed block keeps (--ac_mode: block, or op), or where it
keeps it (offload: on the host, nothing recomputed)."""

from __future__ import annotations

from fractions import Fraction
from functools import partial
from typing import Any, Callable

import torch
from fms.models.llama import LLaMA
from torch import nn
from torch.autograd.graph import save_on_cpu
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts, noop_context_fn

from fms_fsdp.compat import (
    matmul_and_attention_ops,
    reduce_scatter_op,
)
from fms_fsdp.parallel.context_parallel import RING_ATTENTION
from fms_fsdp.parallel.pipeline import blocks_of


def checkpointed_blocks(n_blocks: int, fraction: Fraction) -> list[bool]:
    """fms-fsdp's selective pattern: block i (from 1) is checkpointed when i*p reaches a cut-off that
    starts at 1/2 and grows by 1 at each checkpointed block."""
    cutoff, chosen = Fraction(1, 2), []
    for i in range(1, n_blocks + 1):
        take = fraction > 0 and i * fraction >= cutoff
        cutoff += take
        chosen.append(take)
    return chosen


# kept by --ac_mode=op: the outputs of matmuls and attention (ring attention's op whole: its K/V
# exchanges are not redone either; and, under tensor parallelism, of the sequence-parallel
# reduce-scatters, as torchtitan keeps them: not redone in backward); everything else is recomputed
_OP_MODE_SAVED = [*matmul_and_attention_ops(), reduce_scatter_op(), RING_ATTENTION]
_CONTEXTS: dict[str, Callable[[], Any]] = {
    "block": noop_context_fn,
    "op": partial(create_selective_checkpoint_contexts, _OP_MODE_SAVED),
}


class Checkpointed(nn.Module):
    """Mixed into a block's class in place (`block.__class__ = checkpointed_class(...)`, as fully_shard
    mixes FSDPModule into the classes it shards): its forward runs under non-reentrant
    torch.utils.checkpoint.

    Why a class swap: torch's public checkpoint_wrapper puts the block inside a module of its own,
    which inserts `_checkpoint_wrapped_module` into every parameter's name, so checkpoints, exports and
    --ckpt_load_path would need their keys remapped both ways; torch's name-keeping, hook-based
    checkpoint (torch.distributed._composable) is private API; and a forward patched onto the instance
    as a closure would, in a deep copy, still run the original's weights. The swapped block stays an
    instance of its class and keeps its parameters, their names and its other methods; it can be
    deep-copied (the copy runs its own weights) and compiled (dynamo traces the checkpoint as one
    region). tests/test_parallel.py checks each."""

    ac_context: Callable[[], Any] = noop_context_fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        context = type(self).ac_context
        if context is noop_context_fn:  # whole blocks: dynamo (2.13) cannot trace the default passed explicitly
            return checkpoint(super().forward, *args, use_reentrant=False, **kwargs)
        return checkpoint(super().forward, *args, use_reentrant=False, context_fn=context, **kwargs)


class Offloaded(nn.Module):
    """Mixed into a block's class in place, as Checkpointed is (--ac_mode=offload): what its forward saves
    for backward is copied to host memory (pinned on a GPU) and back when backward needs it, one tensor at
    a time; nothing is recomputed (Megatron's activation offloading; torch's save_on_cpu)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with save_on_cpu(pin_memory=torch.cuda.is_available()):
            return super().forward(*args, **kwargs)


_CHECKPOINTED_CLASSES: dict[tuple[type, str], type] = {}


def checkpointed_class(cls: type, mode: str) -> type:
    """The subclass of `cls` whose forward is checkpointed under --ac_mode `mode` (made once)."""
    if (cls, mode) not in _CHECKPOINTED_CLASSES:
        if mode == "offload":
            _CHECKPOINTED_CLASSES[cls, mode] = type(f"Offloaded{cls.__name__}", (Offloaded, cls), {})
        else:
            _CHECKPOINTED_CLASSES[cls, mode] = type(
                f"Checkpointed{cls.__name__}", (Checkpointed, cls), {"ac_context": staticmethod(_CONTEXTS[mode])}
            )
    return _CHECKPOINTED_CLASSES[cls, mode]


def apply_activation_checkpointing(model: LLaMA, fraction: Fraction, mode: str = "block") -> int:
    """Recompute the chosen blocks' activations in backward: whole blocks, or (mode op) all but the
    matmul and attention outputs; or (mode offload) keep them on the host. Parameter names and checkpoint
    keys do not depend on the setting."""
    blocks = blocks_of(model)
    chosen = checkpointed_blocks(len(blocks), fraction)
    for block, take in zip(blocks, chosen):
        if take:
            block.__class__ = checkpointed_class(type(block), mode)
    return sum(chosen)
