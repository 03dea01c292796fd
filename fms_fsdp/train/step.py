"""One optimizer step (`train_step`): micro-batches copied to the device without blocking the host,
forward and backward, gradient clipping, the bad-step guard, the update; and the one line an
out-of-memory at a step ends in. The loop (train/loop.py) runs it step after step."""

from __future__ import annotations

import re
import time
from fractions import Fraction
from typing import Iterator, NamedTuple, Optional

import torch

from fms_fsdp.errors import TrainingError
from fms_fsdp.model.variants import CausalLM
from fms_fsdp.optim import clip_gradients
from fms_fsdp.parallel.parallelize import set_gradient_sync
from fms_fsdp.parallel.pipeline import Pipeline
from fms_fsdp.resilience.ft import FaultTolerance
from fms_fsdp.train.guard import StepGuard
from fms_fsdp.train.settings import StepSettings

Batches = Iterator[tuple[torch.Tensor, torch.Tensor]]


class StepResult(NamedTuple):
    """What train_step leaves on the device (detached), and the host's wait for data."""

    loss: torch.Tensor  # the objective: cross entropy, plus the z-loss term under --z_loss_weight
    grad_norm: torch.Tensor
    data_wait: float
    z_loss: Optional[torch.Tensor]  # the z-loss term (None without --z_loss_weight)


def to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host batch to `device` without blocking the host: on CUDA through contiguous pinned
    memory (the loaders' inputs and labels are strided views of one array, and a strided source would
    go through a pageable copy)."""
    if device.type == "cuda":
        pinned = torch.empty(batch.shape, dtype=batch.dtype, pin_memory=True)
        batch = pinned.copy_(batch)
    return batch.to(device, non_blocking=True)


def train_step(
    *,
    model: CausalLM,
    optimizer: torch.optim.Optimizer,
    guard: StepGuard,
    step: int,
    batches: Batches,
    settings: StepSettings,
    device: torch.device,
    global_norm: bool,
    pipeline: Optional[Pipeline] = None,
    ft: Optional[FaultTolerance] = None,
) -> Optional[StepResult]:
    """Optimizer step `step` over grad_accum_steps micro-batches (or, under pipeline parallelism, one
    batch through the rank's stages: the loss reaches every stage and the gradient norm is the whole
    model's, so every stage's guard decides alike), without a host sync; `guard` judges it before the
    update (and may leave it out). Returns the detached loss (and its z-loss term), the gradient norm
    before clipping (global when clipping, skipping bad steps, `global_norm` or pipelined, else this
    rank's) and the seconds spent waiting for data. Under --fault_tolerance, None when the step did not
    commit (a replica group was lost in it): nothing was updated."""
    if pipeline is not None:
        t = time.perf_counter()
        inputs, labels = next(batches)
        wait = time.perf_counter() - t
        total, z_total = pipeline.step(to_device(inputs, device), to_device(labels, device))
        norm = clip_gradients(model, settings.grad_clip_thresh, True, pipeline.group)
    else:
        total, z_total, wait = accumulate(model, batches, settings.grad_accum_steps, device)
        norm = clip_gradients(model, settings.grad_clip_thresh, global_norm or guard.skipping)
    if ft is not None and not ft.commit():
        optimizer.zero_grad(set_to_none=True)
        return None
    guard.judge(step, total, norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(total, norm, wait, z_total)


def accumulate(
    model: CausalLM, batches: Batches, steps: int, device: torch.device
) -> tuple[torch.Tensor, Optional[torch.Tensor], float]:
    """Forward and backward of `steps` micro-batches (--grad_accum_steps): (their mean loss, z-loss term
    or None, the seconds spent waiting for data)."""
    total = torch.zeros((), device=device)
    z_total = torch.zeros((), device=device) if model.head.z_loss_weight else None
    wait = 0.0
    if model.routing is not None:  # the MoE layers' auxiliary losses are averaged like the loss
        model.routing.grad_scale = 1 / steps
    for micro in range(steps):
        t = time.perf_counter()
        inputs, labels = next(batches)
        wait += time.perf_counter() - t
        set_gradient_sync(model, micro == steps - 1)
        loss = model(to_device(inputs, device), labels=to_device(labels, device))
        (loss / steps).backward()
        total += loss.detach() / steps
        if z_total is not None and model.head.z_loss is not None:
            z_total += model.head.z_loss / steps
    return total, z_total, wait


NOT_DETERMINISTIC = re.compile(r"(\S+) does not have a deterministic implementation")


def not_deterministic_error(step: int, error: RuntimeError) -> Optional[TrainingError]:
    """The one-line error for torch's refusal, under --deterministic, of an operation at `step` that has
    no deterministic kernel (naming it); None for any other error."""
    found = NOT_DETERMINISTIC.search(str(error))
    if found is None:
        return None
    return TrainingError(
        f"step {step}: --deterministic: torch {torch.__version__} has no deterministic {found.group(1)}, which "
        "this run uses; run without --deterministic, or without the flag that brings that operation in",
        every_rank=False,
    )


def out_of_memory_error(
    step: int, error: torch.OutOfMemoryError, batch_size: int, checkpointing: Optional[Fraction], device: torch.device
) -> TrainingError:
    """The one-line error for an out-of-memory at `step`: what was being allocated, the device's
    memory, and the flags that lower the peak."""
    asked = re.search(r"[Tt]ried to allocate ([\d.]+ [KMGT]?i?B)", str(error))
    what = f"allocating {asked.group(1)}" if asked else "out of memory"
    where = device.type
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        where = (
            f"{props.name} ({props.total_memory / 2**30:.1f} GiB, "
            f"{torch.cuda.memory_allocated(device) / 2**30:.1f} GiB allocated)"
        )
    if checkpointing is None or checkpointing < 1:
        advice = (
            f"lower --batch_size (now {batch_size}) or checkpoint more blocks "
            "(--fsdp_activation_checkpointing=True --selective_checkpointing=1)"
        )
    else:
        advice = f"lower --batch_size (now {batch_size}) or shard over more GPUs"
    return TrainingError(f"step {step}: out of memory {what} on {where}; {advice}", every_rank=False)
