"""What else happens at a step boundary: stop requests and time-based saves, owned by the loop.

SIGTERM (a preemption, scancel) and SIGUSR1 (Slurm's time-limit warning) ask the run to save and
stop after the current step; --checkpoint_minutes asks for a save. Every rank must decide alike, so
each boundary takes one small all-reduce of these flags, together with the checkpointer's "still
writing a background save" so that a finished async save is committed at once.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from fms_fsdp.config import train_config
from fms_fsdp.distributed import DistInfo

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Records a SIGTERM / SIGUSR1; created at process start, so a signal during start-up counts."""

    def __init__(self) -> None:
        self.signal = 0
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal = signum


@dataclass(frozen=True)
class Boundary:
    """The decisions of one step boundary, the same on every rank."""

    stop: Optional[str]  # the signal's name when any rank was asked to stop
    save: bool  # a checkpoint is due: the interval, the last step, --checkpoint_minutes, or a stop
    written: bool  # no rank is still writing a background save


class StepTriggers:
    """Polled once per step by every rank."""

    def __init__(self, cfg: train_config, info: DistInfo, stop: StopRequest):
        self.cfg, self.info, self.stop = cfg, info, stop
        self.group = dist.new_group(backend="gloo")
        self.last_save = time.monotonic()

    def poll(self, step: int, writing: bool) -> Boundary:
        """Agree on stop, save and background-write state after `step`; `writing`: this rank's
        background save is not done yet."""
        minutes = self.cfg.checkpoint_minutes
        clock = minutes is not None and self.info.is_main and time.monotonic() - self.last_save >= 60 * minutes
        flags = torch.tensor([float(self.stop.signal), float(clock), float(writing)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        stop = signal.Signals(int(flags[0])).name if flags[0] else None
        interval = step % self.cfg.checkpoint_interval == 0 or step == self.cfg.num_steps
        return Boundary(stop=stop, save=stop is not None or bool(flags[1]) or interval, written=not flags[2])

    def saved(self) -> None:
        """Restart the --checkpoint_minutes clock."""
        self.last_save = time.monotonic()
