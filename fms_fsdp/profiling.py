"""torch.profiler traces of a few training steps (use_profiler)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Optional

from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from fms_fsdp.config import train_config
from fms_fsdp.parallel import DistInfo

# skip 1 step, warm up 2, record 3: past compilation and FSDP's first all-gathers, bounded in size
WAIT, WARMUP, ACTIVE = 1, 2, 3


def maybe_profiler(cfg: train_config, info: DistInfo) -> contextlib.AbstractContextManager[Optional[profile]]:
    """A torch.profiler context writing Chrome traces to profiler_dir, or a null context when
    profiling is off (or this rank is not profiled). Call .step() on it once per training step."""
    if not cfg.use_profiler or (cfg.profiler_rank0_only and not info.is_main):
        return contextlib.nullcontext()
    folder = Path(cfg.profiler_dir or Path(cfg.ckpt_save_path) / "profiler")
    folder.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if info.device.type == "cuda" else [])
    return profile(
        activities=activities,
        schedule=schedule(wait=WAIT, warmup=WARMUP, active=ACTIVE, repeat=1),
        on_trace_ready=tensorboard_trace_handler(str(folder), worker_name=f"rank{info.rank}"),
        record_shapes=True,
        profile_memory=True,
        with_stack=False,
    )
