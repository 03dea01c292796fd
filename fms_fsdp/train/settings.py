"""The settings of the training loop (train/loop.py) and of its optimizer step (train/step.py), built from the
flags once, in fms_fsdp/settings.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union


@dataclass(frozen=True, kw_only=True)
class LoopSettings:
    """The flags the loop reads itself: how far it trains and reports, the bad-step guard, the straggler
    report, and how a run that stops or finishes ends."""

    num_steps: int
    report_interval: int
    seed: int
    deterministic: bool  # --deterministic: seeds and torch's deterministic settings for the run
    skip_bad_steps: int  # --skip_bad_steps (0: off)
    spike_sigma: Optional[float]  # none: non-finite steps only
    grad_clip_thresh: float  # a report's gradient norm is global when clipping makes it so
    straggler_threshold: float
    straggler_reports: int
    batch_size: int
    seq_length: int
    mixed_precision: bool
    checkpoint_interval: Union[int, str]  # 0: no checkpoints (what a stopped run says)
    stop_exit_status: int  # 0: a stopped run exits 0
    export_model_at_end: bool
    ema_decay: float = 0.0  # --ema_decay (0: no weight average)
    ema_on_host: bool = False  # --ema_on_host: the average in host memory


@dataclass(frozen=True, kw_only=True)
class StepSettings:
    """The flags of one optimizer step (built once: settings.py)."""

    grad_accum_steps: int
    grad_clip_thresh: float  # 0: no clipping
