"""What else happens at a step boundary: stop requests and time-based saves, owned by the loop.

SIGTERM (a preemption, scancel), SIGUSR1 (Slurm's time-limit warning) and SIGINT (Ctrl-C; a second
one ends the rank at once) ask the run to save and stop after the current step, as does --max_run_minutes once that time has passed since the run started; so does LAUNCHER_DIED (lifetime.py), which Linux sends a rank when
its torchrun dies, after which the run ends in an error (on every node, so no launcher waits for the
dead one).
--checkpoint_minutes asks for a save, as does --checkpoint_interval=auto after the time between
saves that it chooses (`SaveClock`). Every rank must decide alike, so the ranks agree on these flags
in one small all-reduce, together with the checkpointer's "still writing a background save" so that
a finished async save is committed soon. A host-blocking collective every step would cost the GPU
its queue of work, so they agree only every AGREE_SECONDS of training, sooner when a time-based save
falls due (a number of steps every rank derives from the same reduced figures), and on the last
step; a signal is therefore acted on within about AGREE_SECONDS plus a step.
"""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from fms_fsdp.lifetime import STOP_SIGNALS
from fms_fsdp.parallel.process_group import DistInfo, collective_timeout

AGREE_SECONDS = 2.0
MAX_STEPS_BETWEEN_AGREEMENTS = 1000
AUTO_FIRST_STALL_S = 30.0
GPU_HOURS_BETWEEN_FAILURES = 50000.0


class StopRequest:
    """Records a STOP_SIGNALS signal; created at the start of a run, so a signal during start-up counts
    (and --max_run_minutes counts from then). After a first Ctrl-C (SIGINT) a second ends the process at
    once, as SIGINT's default does: no save, no traceback. `restore` puts back the handlers it found (a run called
    from Python leaves the process as it was)."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.signal = 0
        self.agreed: Optional[str] = None  # what every rank stopped on, once they did (the loop sets it)
        self.previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal = signum
        if signum == signal.SIGINT:  # Ctrl-C: a second one ends the process at once, without a traceback
            signal.signal(signal.SIGINT, signal.SIG_DFL)

    def restore(self) -> None:
        """Put back the handlers found at creation."""
        for sig, handler in self.previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


@dataclass(frozen=True, kw_only=True)
class TriggerSettings:
    """The flags of step boundaries: --num_steps, --checkpoint_interval (steps, 0 or auto),
    --checkpoint_minutes, --expected_hours_between_failures, --collective_timeout_minutes,
    --max_run_minutes."""

    num_steps: int
    interval: Union[int, str]
    minutes: Optional[float]
    hours_between_failures: Optional[float]
    timeout_minutes: Optional[float]
    max_run_minutes: Optional[float] = None


class SaveClock:
    """The seconds between time-based saves: --checkpoint_minutes, or with --checkpoint_interval=auto
    the interval that loses least to failures plus saving, Young's sqrt(2 x stall x MTBF), from the
    mean training stall of the saves measured so far (AUTO_FIRST_STALL_S until one is) and
    --expected_hours_between_failures."""

    def __init__(self, settings: TriggerSettings, info: DistInfo):
        self.info = info
        self.auto = settings.interval == "auto"
        hours = settings.hours_between_failures
        self.mtbf_s = 3600 * (default_hours_between_failures(info.world_size) if hours is None else hours)
        self.stalls: list[float] = []
        self.every_s = self._young() if self.auto else None if settings.minutes is None else 60 * settings.minutes
        if self.auto:
            self._log("an assumed stall until a save is measured")

    def _stall(self) -> float:
        return sum(self.stalls) / len(self.stalls) if self.stalls else AUTO_FIRST_STALL_S

    def _young(self) -> float:
        return math.sqrt(2 * self._stall() * self.mtbf_s)

    def _log(self, why: str) -> None:
        if self.info.is_main:
            print(
                f"checkpoint interval (auto): {_duration(self.every_s)} = sqrt(2 x {self._stall():.3g} s save stall "
                f"x {self.mtbf_s / 3600:.3g} h between failures); {why}",
                flush=True,
            )

    def saved(self, stall_s: float) -> None:
        """Take a measured stall into the estimate (auto only); logs the interval when it moves by 10%."""
        if not self.auto:
            return
        self.stalls.append(stall_s)
        before, self.every_s = self.every_s, self._young()
        if abs(self.every_s - before) > 0.1 * before:
            self._log(f"the mean stall of {len(self.stalls)} saves")


def default_hours_between_failures(gpus: int) -> float:
    """Hours between failures of a job on `gpus` devices: Llama 3's 419 unexpected interruptions in 54
    days on 16384 GPUs (one per 3.1 h, about 50000 GPU-hours), at most a week."""
    return min(GPU_HOURS_BETWEEN_FAILURES / max(1, gpus), 168.0)


def _duration(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds < 120 else f"{seconds / 60:.3g} min"


@dataclass(frozen=True)
class Boundary:
    """The decisions of one step boundary, the same on every rank."""

    stop: Optional[str]  # the signal's name when any rank was asked to stop
    save: bool  # a checkpoint is due: the interval, the last step, the save clock, or a stop
    written: bool  # the ranks agreed and none is still writing a background save


class StepTriggers:
    """Polled once per step by every rank; collective only at agreement steps."""

    def __init__(self, settings: TriggerSettings, info: DistInfo, stop: StopRequest, start_step: int = 0):
        self.settings, self.info, self.stop = settings, info, stop
        self.clock = SaveClock(settings, info)
        # the agreement is a training collective: it fails after --collective_timeout_minutes, as FSDP's do
        self.group = dist.new_group(backend="gloo", timeout=collective_timeout(settings.timeout_minutes))
        self.last_save = time.monotonic()
        self.last_agreement = (start_step, time.monotonic())
        self.next_agreement = start_step + 1  # the first step agrees, and measures the step time
        limit = settings.max_run_minutes
        self.deadline = math.inf if limit is None else stop.started + 60 * limit
        self.longest_save = 0.0  # the run stops that much before --max_run_minutes, for its last save

    def poll(self, step: int, writing: bool) -> Boundary:
        """The decisions after `step`: agreed with the other ranks when `step` is an agreement step,
        else only the step-count saves; `writing`: this rank's background save is not done yet."""
        steps, last = self.settings.interval, self.settings.num_steps
        saves = steps != 0
        interval = saves and (step == last or (isinstance(steps, int) and step % steps == 0))
        if step < self.next_agreement and step != last:
            return Boundary(stop=None, save=interval, written=False)
        now = time.monotonic()
        every_s = self.clock.every_s
        until_save = math.inf if every_s is None else every_s - (now - self.last_save)
        clock = every_s is not None and self.info.is_main and until_save <= 0
        until_end = self.deadline - self.longest_save - now
        ended = self.info.is_main and until_end <= 0
        last_step, last_time = self.last_agreement
        # one MAX all-reduce; the seconds to the next time-based save (or the end) travel negated, to get
        # their minimum
        flags = torch.tensor(
            [
                float(self.stop.signal),
                float(clock),
                float(writing),
                now - last_time,
                -min(until_save, until_end, AGREE_SECONDS),
                float(ended),
            ]
        )
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        step_time = float(flags[3]) / max(1, step - last_step)  # the same on every rank
        horizon = -float(flags[4])  # agree again by then: every few seconds, and by the next time-based save
        every = min(MAX_STEPS_BETWEEN_AGREEMENTS, max(1, int(horizon / max(step_time, 1e-9))))
        self.last_agreement, self.next_agreement = (step, now), step + every
        stop = signal.Signals(int(flags[0])).name if flags[0] else None
        if stop is None and flags[5]:
            stop = f"--max_run_minutes={self.settings.max_run_minutes:g}"
        return Boundary(
            stop=stop, save=saves and (stop is not None or bool(flags[1]) or interval), written=not flags[2]
        )

    def moved(self, step: int) -> None:
        """The run goes on from `step` (a replica group caught up, --fault_tolerance): the next step agrees
        and measures the step time again."""
        self.last_agreement, self.next_agreement = (step, time.monotonic()), step + 1

    def saved(self, stall_s: float) -> None:
        """A checkpoint was saved, training waited `stall_s` for it: restart the save clock."""
        self.clock.saved(stall_s)
        self.last_save = time.monotonic()
        self.longest_save = max(self.longest_save, stall_s)
