"""--dry_run's rehearsal of the start at full size (--plan_world_size=N, as torchtitan's
COMM_MODE=fake_backend): for each kind of rank, this process joins torch's fake process group of N
ranks as that rank (every collective returns at once and moves nothing) and runs the start's own
code: the mesh, the model built on the meta device (no memory behind it), pruned to the rank's
pipeline stages, tensor parallelism, float8, activation checkpointing, compile and FSDP2
(parallel/assemble.py `parallelised`), the pipeline's schedule, and the optimizer's first step, which makes
its state. The bytes of the parameters, their gradients and the optimizer's state are read from the
shards it leaves (DTensor local shapes); the memory plan checks its analytic figures against them.

The kinds of rank: the ranks of one pipeline stage hold the same modules, split alike, and FSDP2 cuts
a parameter's rows as torch.chunk does, so the first rank of a shard group holds the largest shard
(what every rank of the group allocates: FSDP2 pads the others to it). One rank per pipeline rank is
rehearsed: the one at coordinate 0 of every other mesh dimension. The mesh is laid out on the CPU's
device type whatever the run's device: the tensors are on the meta device either way.

A setting the real wrapping refuses ends the rehearsal as it would end the start: in one line (the
ConfigError's, or what torch raised and the rank it raised on).
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from multiprocessing import get_context
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fms_fsdp.compat import fake_store
from fms_fsdp.errors import ConfigError, TrainingError, first_line
from fms_fsdp.memory.plan import State
from fms_fsdp.memory.settings import state_share
from fms_fsdp.optim import OptimizerSettings, build_optimizer
from fms_fsdp.parallel.assemble import ModelBuild, describe, parallelised
from fms_fsdp.parallel.mesh import build_mesh
from fms_fsdp.parallel.settings import MeshShape

REHEARSED_ON = torch.device("cpu")  # the mesh's device type (and the pipeline stages')


def rehearsed_ranks(shape: MeshShape, world_size: int) -> list[int]:
    """The ranks rehearsed: the first of each pipeline stage's ranks."""
    per_stage = world_size // shape.pp
    return [pp_rank * per_stage for pp_rank in range(shape.pp)]


def rehearse(
    build: ModelBuild, *, optimizer: OptimizerSettings, world_size: int, log: Callable[[str], None]
) -> list[State]:
    """Each pipeline rank's state as its real shards hold it, from a rehearsal of its start in a world of
    `world_size` ranks; rank 0's start-up line goes to `log` as a real start logs it. ConfigError (one
    line) where the wrapping fails.
    Each rank is rehearsed in a process of its own, as many at once as there are cores: DTensor's caches
    keep the meshes of a finished world, whose groups the next world lacks. The processes come from a
    fork server that imported torch and this package once: clean of this process's threads, whose
    locks a plain fork could copy held, and a process that dies is said, never waited for."""
    ranks = rehearsed_ranks(build.shape, world_size)
    context = get_context("forkserver")
    # torch's compiler imported in the server once, not in every rank's process
    context.set_forkserver_preload([__name__] + (["torch._dynamo"] if build.parallel.compile else []))
    workers = min(len(ranks), os.cpu_count() or 1)
    rehearsal = partial(_rehearse, build, optimizer, world_size)
    try:
        with ProcessPoolExecutor(workers, mp_context=context, max_tasks_per_child=1) as pool:
            results = list(pool.map(rehearsal, ranks))  # the first rank's error first
    except BrokenProcessPool:
        raise TrainingError(
            "--dry_run: a rehearsal process died (out of memory, or killed); run it again, with fewer cores busy"
        ) from None
    for _, line in results:
        if line is not None:
            log(line)
    return [state for state, _ in results]


@contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """This process as `rank` of a fake process group of `world_size` ranks, for the block."""
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=fake_store())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _rehearse(
    build: ModelBuild, optimizer: OptimizerSettings, world_size: int, rank: int
) -> tuple[State, Optional[str]]:
    """The state of `rank`'s shards after its start and first optimizer step; rank 0's start-up line."""
    with fake_world(rank, world_size):
        try:
            mesh = build_mesh(build.shape, REHEARSED_ON, None)
            model, pipeline, done, n_lora = parallelised(
                replace(build, device=REHEARSED_ON), mesh, torch.device("meta")
            )
            if pipeline is not None:
                pipeline.start()
            stepped = _first_step(optimizer, model)
        except ConfigError:
            raise
        except Exception as e:
            raise ConfigError(
                f"--dry_run: these flags fail at the start of rank {rank} of {world_size}, where the model is "
                f"parallelised: {type(e).__name__}: {first_line(e)}"
            ) from None
        line = describe(build, mesh, model, done, n_lora) if rank == 0 else None  # on the run's device
        state = _state(model, stepped)  # the step made fp32 states: in --optimizer_state_dtype's bytes
        return replace(state, optimizer=int(state.optimizer * state_share(optimizer.state_dtype))), line


def _first_step(settings: OptimizerSettings, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer after a step on zero gradients, which makes its state on the meta device,
    by the single-tensor kernels (the same state: the fused ones take no meta tensors, and DTensor
    shards the foreach ones' tensor lists several times slower)."""
    fp32 = replace(settings, impl="foreach", skip_bad_steps=0, state_dtype="fp32")  # _rehearse scales 8-bit ones
    optimizer = build_optimizer(model, fp32, REHEARSED_ON)
    for group in optimizer.param_groups:
        group["foreach"] = False
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    return optimizer


def _bytes(t: torch.Tensor) -> int:
    """The bytes of this rank's part of `t`."""
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> State:
    """Parameters, gradients (the trainable parameters' shards, as FSDP2 reduce-scatters into) and the
    optimizer's state on the device (AdamW's step counts stay on the host)."""
    params = list(model.parameters())
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return State(
        sum(_bytes(p) for p in params),
        sum(_bytes(p.grad) for p in params if p.grad is not None),
        sum(_bytes(t) for t in state if t.device.type == "meta"),
    )
