"""The free-space guard: before each save, make room for it as the keep policy allows, or stop with
one line saying how much is free and how much is needed. Object storage has no free space to measure:
there only unfinished saves are removed (the run says once that the guard does not apply)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist

from fms_fsdp.checkpoint.layout import complete_checkpoints, delete_checkpoint, remove_stale
from fms_fsdp.checkpoint.policy import KeepPolicy
from fms_fsdp.storage import is_remote, make_folder

_MARGIN = 1.05  # a checkpoint's files take a little more than its tensors


def checkpoint_bytes(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, group: dist.ProcessGroup, average: bool = False
) -> int:
    """Bytes of one checkpoint: the model and optimizer shards of one replica (DCP writes each once), and
    a second copy of the model's with `average` (--ema_decay's; at most the model's size). Every rank
    calls it."""
    mesh = getattr(next(model.parameters()), "device_mesh", None)  # None: one rank, no FSDP
    local = 0
    if mesh is None or mesh.get_coordinate()[0] == 0:  # the first replica along the mesh's 'replicate' dimension
        local = sum(t.numel() * t.element_size() for t in _tensors(model.state_dict())) * (1 + average)
        local += sum(t.numel() * t.element_size() for t in _tensors(optimizer.state_dict()))
    total = torch.tensor([local], dtype=torch.float64)
    dist.all_reduce(total, group=group)
    return int(total.item() * _MARGIN)


def prune_for(root: Path, needed: int, policy: KeepPolicy, scores: Mapping[int, float]) -> float:
    """Delete unfinished saves, what the keep policy would delete (`scores`: its monitored metric by
    step), then the oldest checkpoints, until `needed` bytes are free or only the newest complete
    checkpoint is left; returns the bytes free. One rank runs it."""
    make_folder(root)
    remove_stale(root)
    if is_remote(root):
        return float("inf")
    free = shutil.disk_usage(root).free
    complete = complete_checkpoints(root)
    doomed = set(policy.to_delete([s for s, _ in complete], scores))
    deletable = [p for s, p in complete if s in doomed] + [p for s, p in complete[:-1] if s not in doomed]
    for path in deletable:
        if free >= needed:
            break
        print(f"checkpoint: {free / 2**30:.2f} GiB free, {needed / 2**30:.2f} GiB needed: deleting {path}", flush=True)
        delete_checkpoint(path)
        free = shutil.disk_usage(root).free
    return free


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a nested state dict (local shards of DTensors)."""
    if isinstance(obj, torch.Tensor):
        return [obj.to_local() if hasattr(obj, "to_local") else obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []
