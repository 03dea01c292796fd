"""Activations for the memory plan (plan.py), traced rather than counted from a formula: a 1- and a
2-block copy of the model, in the compute dtype, runs forward and backward on fake tensors (no memory,
no compute) under torch's MemTracker, at micro-batches 1 and 2, for each activation-checkpointing mode;
what stays alive after forward gives, per block and outside the blocks, what autograd saves, and the
head's forward gives the loss's working set. Activations grow linearly in the micro-batch, so each is
kept as a line through B=1 and B=2 (`Activations`), from which the plan extends to any batch size and
checkpointing fraction.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Optional

import torch

from fms_fsdp.compat import mem_tracker
from fms_fsdp.model.lora import LoRASpec, add_adapters
from fms_fsdp.model.loss import CHUNK_BYTES, CUDA_CHUNK_BYTES
from fms_fsdp.model.variants import build_model, get_model_config
from fms_fsdp.parallel.activation_checkpointing import apply_activation_checkpointing
from fms_fsdp.parallel.parallelize import apply_autocast


@dataclass(frozen=True)
class Activations:
    """Bytes alive after forward, linear in the micro-batch B: outside the blocks, per block (one per
    checkpointing mode: none, block, op), and the loss's (saved and transient)."""

    outside: tuple[float, float]  # (at B=0, per sample)
    per_block: dict[str, tuple[float, float]]
    loss_saved: tuple[float, float]  # the gradients the chunked loss computes in forward
    loss_transient: tuple[float, float]  # one chunk's logits and their gradient

    @staticmethod
    def at(line: tuple[float, float], batch: int) -> int:
        return int(line[0] + line[1] * batch)


@dataclass(frozen=True)
class Shape:
    """What activations depend on: the model, the sequence length and the compute dtype."""

    variant: str
    vocab_size: Optional[int]
    seq_length: int
    mixed_precision: bool
    gpu: bool  # the loss's chunks are sized for a GPU
    lora: Optional[LoRASpec]  # adapters, the base frozen
    autocast: bool = False  # bf16 through autocast over fp32 weights (one rank, no FSDP)


@lru_cache(maxsize=64)
def _traced(shape: Shape, mode: str, blocks: int, batch: int) -> tuple[int, int, int]:
    """(activation bytes alive after forward outside the loss, loss bytes saved, loss transient peak) of
    a `blocks`-block copy of the model at micro-batch `batch`, on fake tensors."""
    FakeTensorMode, MemTracker, _ModState = mem_tracker()

    config = get_model_config(shape.variant, shape.vocab_size, shape.seq_length).updated(nlayers=blocks)
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if shape.mixed_precision and not shape.autocast else torch.float32)
    try:
        with FakeTensorMode():
            model = build_model(config, torch.device("cpu"))
            model.head.max_chunk_bytes = CUDA_CHUNK_BYTES if shape.gpu else CHUNK_BYTES
            if model.routing is not None:  # a sparse model's tokens spread evenly over its experts
                model.routing.even = True
            if shape.lora is not None:  # left trainable, as MemTracker hooks every parameter: an adapted
                add_adapters(model, shape.lora)  # layer's input is saved for lora_A's gradient either way
                model.requires_grad_(True)
            if mode != "none":
                apply_activation_checkpointing(model, Fraction(1), mode)
            if shape.autocast:
                apply_autocast(model)
            tokens = torch.zeros(batch, shape.seq_length, dtype=torch.long)
            tracker = MemTracker()
            tracker.track_external(model)
            with tracker:
                before = tracker.get_tracker_snapshot("current")
                loss = model(tokens, labels=tokens)
                after = tracker.get_tracker_snapshot("current")
                loss.backward()
            head = tracker.memory_tracking[model.head].snapshots
    finally:
        torch.set_default_dtype(dtype)
    (device,) = after

    def total(snapshot: list) -> int:
        return snapshot[-1][device]["Total"]

    saved = total(head[_ModState.POST_FW]) - total(head[_ModState.PRE_FW])
    transient = total(head[_ModState.PEAK_FW]) - total(head[_ModState.POST_FW])
    alive = after[device].get("Activation", 0) - before[device].get("Activation", 0)
    return alive - saved, saved, transient


def _line(at1: float, at2: float) -> tuple[float, float]:
    """(value at B=0, per sample) through the values at B=1 and B=2."""
    return 2 * at1 - at2, at2 - at1


def trace_activations(shape: Shape, modes: tuple[str, ...]) -> Activations:
    """Activations of the model for the given checkpointing modes ('none' always); each trace is run
    once per process."""
    runs = {
        (mode, blocks, batch): _traced(shape, mode, blocks, batch)
        for mode in dict.fromkeys(("none", *modes))
        for blocks in (1, 2)
        for batch in (1, 2)
    }
    one, two = ([runs["none", 1, b][0] for b in (1, 2)], [runs["none", 2, b][0] for b in (1, 2)])
    per_block = {}
    for mode in dict.fromkeys(("none", *modes)):
        deltas = [runs[mode, 2, b][0] - runs[mode, 1, b][0] for b in (1, 2)]
        per_block[mode] = _line(*deltas)
    outside = _line(*(o - (t - o) for o, t in zip(one, two)))
    saved = _line(*(runs["none", 1, b][1] for b in (1, 2)))
    transient = _line(*(runs["none", 1, b][2] for b in (1, 2)))
    return Activations(outside, per_block, saved, transient)
