"""What else happens at a step boundary: stop requests and time-based saves, owned by the loop.

SIGTERM (a preemption, scancel) and SIGUSR1 (Slurm's time-limit warning) ask the run to save and
stop after the current step; --checkpoint_minutes asks for a save. Every rank must decide alike, so
the ranks agree on these flags in one small all-reduce, together with the checkpointer's "still
writing a background save" so that a finished async save is committed soon. A host-blocking
collective every step would cost the GPU its queue of work, so they agree only every AGREE_SECONDS
of training, sooner when a --checkpoint_minutes save falls due (a number of steps every rank derives
from the same reduced figures), and on the last step; a signal is therefore acted on within about
AGREE_SECONDS plus a step.
"""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from fms_fsdp.config import train_config
from fms_fsdp.distributed import DistInfo

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
AGREE_SECONDS = 2.0
MAX_STEPS_BETWEEN_AGREEMENTS = 1000


class StopRequest:
    """Records a SIGTERM / SIGUSR1; created at the start of a run, so a signal during start-up counts.
    `restore` puts back the handlers it found (a run called from Python leaves the process as it was)."""

    def __init__(self) -> None:
        self.signal = 0
        self.previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal = signum

    def restore(self) -> None:
        """Put back the handlers found at creation."""
        for sig, handler in self.previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


@dataclass(frozen=True)
class Boundary:
    """The decisions of one step boundary, the same on every rank."""

    stop: Optional[str]  # the signal's name when any rank was asked to stop
    save: bool  # a checkpoint is due: the interval, the last step, --checkpoint_minutes, or a stop
    written: bool  # the ranks agreed and none is still writing a background save


class StepTriggers:
    """Polled once per step by every rank; collective only at agreement steps."""

    def __init__(self, cfg: train_config, info: DistInfo, stop: StopRequest, start_step: int = 0):
        self.cfg, self.info, self.stop = cfg, info, stop
        self.group = dist.new_group(backend="gloo")
        self.last_save = time.monotonic()
        self.last_agreement = (start_step, time.monotonic())
        self.next_agreement = start_step + 1  # the first step agrees, and measures the step time

    def poll(self, step: int, writing: bool) -> Boundary:
        """The decisions after `step`: agreed with the other ranks when `step` is an agreement step,
        else only the step-count saves; `writing`: this rank's background save is not done yet."""
        saves = self.cfg.checkpoint_interval > 0
        interval = saves and (step % self.cfg.checkpoint_interval == 0 or step == self.cfg.num_steps)
        if step < self.next_agreement and step != self.cfg.num_steps:
            return Boundary(stop=None, save=interval, written=False)
        now = time.monotonic()
        minutes = self.cfg.checkpoint_minutes
        until_save = math.inf if minutes is None else 60 * minutes - (now - self.last_save)
        clock = minutes is not None and self.info.is_main and until_save <= 0
        last_step, last_time = self.last_agreement
        # one MAX all-reduce; the seconds to the next time-based save travel negated, to get their minimum
        flags = torch.tensor([float(self.stop.signal), float(clock), float(writing), now - last_time,
                              -min(until_save, AGREE_SECONDS)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        step_time = float(flags[3]) / max(1, step - last_step)  # the same on every rank
        horizon = -float(flags[4])  # agree again by then: every few seconds, and by the next time-based save
        every = min(MAX_STEPS_BETWEEN_AGREEMENTS, max(1, int(horizon / max(step_time, 1e-9))))
        self.last_agreement, self.next_agreement = (step, now), step + every
        stop = signal.Signals(int(flags[0])).name if flags[0] else None
        return Boundary(stop=stop, save=saves and (stop is not None or bool(flags[1]) or interval), written=not flags[2])

    def saved(self) -> None:
        """Restart the --checkpoint_minutes clock."""
        self.last_save = time.monotonic()
