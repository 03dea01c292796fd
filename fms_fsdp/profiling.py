"""Profiles of a few training steps: torch.profiler traces (--use_profiler), and on CUDA an optional memory
snapshot of the same steps (--profiler_memory_snapshot); `StepProfiler` is the loop's periodic work
(periodic.Periodic) that steps it."""

from __future__ import annotations

import contextlib
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from fms_fsdp.compat import cuda_memory_snapshot, record_cuda_memory_history
from fms_fsdp.errors import ConfigError
from fms_fsdp.parallel.process_group import DistInfo
from fms_fsdp.periodic import Report

# skip 1 step, warm up 2, record 3: past compilation and FSDP's first all-gathers, bounded in size
WAIT, WARMUP, ACTIVE = 1, 2, 3
MEMORY_HISTORY_ENTRIES = 100_000


@dataclass(frozen=True, kw_only=True)
class ProfilerSettings:
    """--use_profiler, --profiler_rank0_only, --profiler_dir and --profiler_memory_snapshot."""

    enabled: bool
    rank0_only: bool
    folder: Optional[str]  # None: <ckpt_save_path>/profiler
    memory_snapshot: bool


def check_profiler(settings: ProfilerSettings, device: torch.device) -> None:
    """ConfigError when the profiler settings need what this run lacks (before any expensive work)."""
    if settings.memory_snapshot and device.type != "cuda":
        raise ConfigError(
            "--profiler_memory_snapshot records the CUDA allocator: this run has no GPU; drop the flag or run on CUDA"
        )


def _with_memory_snapshot(handler: Callable[[profile], None], path: Path) -> Callable[[profile], None]:
    """The trace handler, then the allocator history recorded since the start, written to `path`
    atomically; recording stops there."""

    def on_trace_ready(prof: profile) -> None:
        handler(prof)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            pickle.dump(cuda_memory_snapshot(), f)
        os.replace(tmp, path)
        record_cuda_memory_history(enabled=None)

    return on_trace_ready


@contextlib.contextmanager
def maybe_profiler(settings: ProfilerSettings, info: DistInfo, run_folder: Path) -> Iterator[Optional[profile]]:
    """A torch.profiler context writing Chrome traces to --profiler_dir (default: `run_folder`/profiler),
    or None when profiling is off (or this rank is not profiled). Call .step() on it once per step."""
    if not settings.enabled or (settings.rank0_only and not info.is_main):
        yield None
        return
    folder = Path(settings.folder) if settings.folder else run_folder / "profiler"
    folder.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if info.device.type == "cuda" else [])
    handler: Any = tensorboard_trace_handler(str(folder), worker_name=f"rank{info.rank}")
    if settings.memory_snapshot:
        record_cuda_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        handler = _with_memory_snapshot(handler, folder / f"memory_snapshot_rank{info.rank}.pickle")
    try:
        with profile(
            activities=activities,
            schedule=schedule(wait=WAIT, warmup=WARMUP, active=ACTIVE, repeat=1),
            on_trace_ready=handler,
            record_shapes=True,
            profile_memory=True,
            with_stack=False,
        ) as prof:
            yield prof
    finally:
        if settings.memory_snapshot:  # a run that ended before the profiled steps stops recording too
            record_cuda_memory_history(enabled=None)


class StepProfiler:
    """The profiler of a run (maybe_profiler), stepped after every training step while it is on."""

    reads_model = False

    def __init__(self, settings: ProfilerSettings, info: DistInfo, run_folder: Path):
        self._stack = contextlib.ExitStack()
        self.prof = self._stack.enter_context(maybe_profiler(settings, info, run_folder))

    def due(self, step: int) -> bool:
        return self.prof is not None

    def run(self, step: int, model: torch.nn.Module) -> Report:
        assert self.prof is not None
        self.prof.step()
        return Report()

    def finish(self) -> None:
        """Stop profiling (a trace not yet written is written now)."""
        self.close()

    def close(self) -> None:
        self._stack.close()
