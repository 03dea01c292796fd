"""The background writer of checkpoints (--async_checkpoint) and periodic exports: each rank copies its
shards to CPU buffers (the only time training waits) and DCP writes them from there in another
thread, over a gloo group of the writer's own, so its collectives never pair up with the training
thread's. A model built unfused (tensor parallel) is written under fms's fused names (fused.py)."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from fms_fsdp.compat import reusable_stager
from fms_fsdp.weights.fused import FusingStager, fused_groups
from fms_fsdp.weights.reader import storage_writer


def staging_buffers(device: torch.device) -> DefaultStager:
    """Where a background write copies the state before writing it: CPU buffers allocated at the first
    write and reused by every later one (cached by tensor storage), pinned and filled by non-blocking
    copies on CUDA, so a write stalls training for one device-to-host copy."""
    cuda = device.type == "cuda"
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=cuda
        )
    )


class BackgroundWriter:
    """Writes {"model_state", ["optimizer_state"]} state dicts as DCP folders in the background. Made at
    start-up on every rank (a group made later would need the launcher's store, gone if it died)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stager: DefaultStager | None = staging_buffers(device)
        self.group = dist.new_group(backend="gloo")

    def write(self, state: dict[str, Any], folder: Path) -> Future:
        """Stage `state` now and write it to `folder` in the background; the future completes when this
        rank's part is written. Every rank calls it."""
        assert self.stager is not None, "the writer is closed"
        if not reusable_stager():  # torch < 2.13: a stager stages once (compat.py)
            self.stager = staging_buffers(self.device)
        stager = FusingStager(self.stager) if fused_groups(state["model_state"]) else self.stager
        return dcp.async_save(
            state, storage_writer=storage_writer(folder), process_group=self.group, async_stager=stager
        )

    def close(self) -> None:
        """Free the staging buffers (a write under way keeps what it staged)."""
        if self.stager is not None:
            self.stager.close()
            self.stager = None
