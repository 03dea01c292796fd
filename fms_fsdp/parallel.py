"""Device and process group, the data-parallel DeviceMesh, and how the model is parallelised:
selective activation checkpointing, per-block torch.compile, FSDP2 (fully_shard) with bf16 mixed
precision. fsdp, hsdp and ddp are all FSDP2 over a 2-D (replicate, shard) mesh of different shapes.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from fractions import Fraction
from typing import Optional, TypeVar

import torch
import torch.distributed as dist
from fms.models.llama import LLaMA
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from fms_fsdp.config import ConfigError, parse_fraction, train_config

T = TypeVar("T")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: global and node-local rank, and its device."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_device(flag: str, local_rank: int) -> torch.device:
    """--device auto|cuda|cpu -> the torch device of this rank."""
    if flag == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device=cuda: no CUDA device is visible; use --device=cpu or --device=auto")
    if flag == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise ConfigError(
            f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs are visible: "
            "set torchrun's --nproc_per_node to at most the GPU count"
        )
    return torch.device("cuda", local_rank)


def init_distributed(cfg: train_config) -> DistInfo:
    """Check the mesh against the world size, then start the process group (NCCL on GPUs, gloo on
    CPU). Without torchrun's environment a single-process group on localhost is started, so
    `python main_training.py` works too."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    mesh_shape(cfg, world, local_world)
    device = resolve_device(cfg.device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl", device_id=device)
    else:
        dist.init_process_group(backend="gloo")
    return DistInfo(rank, world, local_rank, local_world, device)


def broadcast_from_rank0(obj: T, timeout: timedelta = timedelta(minutes=30)) -> T:
    """Rank 0's `obj` on every rank (every rank calls it). It goes over a gloo group of its own, so a
    CPU object and a long wait for rank 0 are fine under NCCL and its watchdog."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    group = dist.new_group(backend="gloo", timeout=timeout)
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    dist.destroy_process_group(group)
    return box[0]


def mesh_shape(cfg: train_config, world_size: int, local_world_size: int) -> tuple[int, int]:
    """(replicate, shard) sizes for the sharding strategy; ConfigError when they don't divide."""
    if cfg.sharding_strategy == "fsdp":
        return 1, world_size
    if cfg.sharding_strategy == "ddp":
        return world_size, 1
    group = cfg.sharding_group_size or local_world_size
    if world_size % group:
        raise ConfigError(
            f"--sharding_group_size={group} does not divide the world size {world_size}; "
            "pick a divisor (default: ranks per node)"
        )
    return world_size // group, group


def build_mesh(cfg: train_config, info: DistInfo) -> DeviceMesh:
    """The 2-D data-parallel mesh ('replicate', 'shard')."""
    shape = mesh_shape(cfg, info.world_size, info.local_world_size)
    return init_device_mesh(info.device.type, shape, mesh_dim_names=("replicate", "shard"))


def checkpointed_blocks(n_blocks: int, fraction: Fraction) -> list[bool]:
    """fms-fsdp's selective pattern: block i (from 1) is checkpointed when i*p reaches a cut-off that
    starts at 1/2 and grows by 1 at each checkpointed block."""
    cutoff, chosen = Fraction(1, 2), []
    for i in range(1, n_blocks + 1):
        take = fraction > 0 and i * fraction >= cutoff
        cutoff += take
        chosen.append(take)
    return chosen


def apply_activation_checkpointing(model: LLaMA, fraction: Fraction) -> int:
    """Recompute the chosen blocks' activations in backward (non-reentrant torch.utils.checkpoint).
    The block's parameters keep their names, so checkpoints don't depend on this setting."""
    blocks = list(model.base_model.layers)
    chosen = checkpointed_blocks(len(blocks), fraction)
    for block, take in zip(blocks, chosen):
        if take:
            forward = block.forward
            block.forward = lambda *a, _f=forward, **kw: checkpoint(_f, *a, use_reentrant=False, **kw)
    return sum(chosen)


def apply_fsdp(model: LLaMA, mesh: DeviceMesh, mixed_precision: bool) -> None:
    """fully_shard every LLaMABlock, then the root (embedding, final norm, head)."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else MixedPrecisionPolicy()
    blocks = list(model.base_model.layers)
    for i, block in enumerate(blocks):
        # the last block is needed again right at the start of backward: keep it gathered
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def parallelize(model: LLaMA, cfg: train_config, mesh: DeviceMesh) -> Optional[int]:
    """Activation checkpointing, then compile, then FSDP2, in torchtitan's order. Returns how many
    blocks are checkpointed (None when activation checkpointing is off)."""
    n_ckpt = None
    if cfg.fsdp_activation_checkpointing:
        n_ckpt = apply_activation_checkpointing(model, parse_fraction("selective_checkpointing", cfg.selective_checkpointing))
    if cfg.use_torch_compile:
        for block in model.base_model.layers:
            block.compile()
    apply_fsdp(model, mesh, cfg.mixed_precision)
    return n_ckpt
