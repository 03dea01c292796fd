"""Learning-rate schedules, as multipliers of learning_rate at step x (0-based) of num_steps.

- initial + cosine: fms-fsdp's default, quadratic warmup then cosine to min_lr_ratio
  (0.1 gives exactly fms-fsdp's min(1 - (1 - x/w)^2, 0.1 + 0.45 (1 + cos(pi x / N)))).
- initial + linear: warmup, then a straight line from 1 to min_lr_ratio at the last step.
- initial + inv_sqrt: warmup, then sqrt(warmup / x), not below min_lr_ratio (Levanter's inv_sqrt).
- initial + inv: warmup, then 1 / (1 + (1/r - 1) t / decay) t steps after it, reaching r =
  min_lr_ratio after the decay steps (Levanter's inv).
- initial + wsd: warmup, stable at 1, linear decay to min_lr_ratio over the last decay_steps.
- initial + constant: warmup, then 1.
- annealing: fms-fsdp's annealing stage, 1 - x/N.
With --lr_cycles=K the initial stage's schedule runs K times over num_steps (or cycles of
--lr_cycle_length steps, a fraction of the run or a list of lengths, or cycles ending at
--lr_cycle_ends), each cycle warming up again, by --lr_rewarmup after the first (Levanter's cycles and
rewarmup). Warmup and decay are steps, or fractions of a cycle below 1. Any num_steps >= 1 works
(fms-fsdp divided by zero below 20 steps). With --lr_schedule_unit=tokens and a ramp of the batch size or
line length, x is the tokens of the steps done over those of a step of the largest batch and lines, and
N the run's tokens counted so (ramp.py).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

import torch
from torch.optim.lr_scheduler import LambdaLR

from fms_fsdp.errors import ConfigError
from fms_fsdp.ramp import Ramp


def default_warmup(num_steps: int) -> int:
    """fms-fsdp's warmup length: min(2000, num_steps // 20)."""
    return min(2000, num_steps // 20)


@dataclass(frozen=True, kw_only=True)
class ScheduleSettings:
    """The learning-rate flags: --training_stage, --lr_schedule, --num_steps, the cycles (--lr_cycles,
    --lr_cycle_length or --lr_cycle_ends, as the steps they start at), --warmup_steps, --lr_rewarmup,
    --decay_steps, --min_lr_ratio."""

    stage: str
    schedule: str
    steps: int
    starts: tuple[int, ...]
    warmup: Optional[float]
    rewarmup: Optional[float]
    decay: Optional[float]
    min_ratio: float
    tokens: Optional[Ramp] = None  # --lr_schedule_unit=tokens: the steps' shapes, whose tokens it counts

    def __post_init__(self) -> None:
        """ConfigError for a decay longer than the shortest cycle."""
        shortest = min(b - a for a, b in zip(self.starts, [*self.starts[1:], self.steps]))
        if self.decay is not None and self.decay >= 1 and self.decay > shortest:
            raise ConfigError(f"--decay_steps={self.decay:g} is more than the {shortest} steps of a cycle")


def cycle_starts(
    n: int, cycles: int = 1, length: Optional[str] = None, ends_given: Optional[Sequence[int]] = None
) -> tuple[int, ...]:
    """The steps the schedule's cycles start at (0 first) in a run of `n` steps: --lr_cycles equal
    cycles, --lr_cycle_length (steps, a fraction of the run, or a list of lengths) or --lr_cycle_ends;
    ConfigError naming the flag for a form it cannot read or more than one of them."""
    given = [
        f
        for f, on in (
            ("--lr_cycles", cycles > 1),
            ("--lr_cycle_length", length),
            ("--lr_cycle_ends", ends_given),
        )
        if on
    ]
    if len(given) > 1:
        raise ConfigError(f"{' and '.join(given)} both set the cycles: give one")
    if ends_given is not None:
        ends = list(ends_given)
        if not ends or ends != sorted(set(ends)) or ends[0] < 1 or ends[-1] > n:
            raise ConfigError(
                f"--lr_cycle_ends={','.join(map(str, ends))}: give increasing steps from 1 to --num_steps={n}"
            )
        return (0, *(e for e in ends if e < n))
    if length is not None:
        return _starts_of_lengths(length, n)
    return tuple(i * n // cycles for i in range(cycles))


def _starts_of_lengths(text: str, n: int) -> tuple[int, ...]:
    """Cycle starts for --lr_cycle_length: '1000' (steps), '0.25' (of the run) or '1000,2000' (lengths)."""
    try:
        values = [float(v) for v in str(text).split(",")]
    except ValueError:
        values = []
    if not values or any(v <= 0 or (v >= 1 and v != int(v)) for v in values) or (len(values) > 1 and min(values) < 1):
        raise ConfigError(
            f"--lr_cycle_length={text}: give steps (1000), a fraction of the run below 1 (0.25) or lengths (1000,2000)"
        )
    if len(values) == 1:
        length = int(values[0]) if values[0] >= 1 else max(1, round(values[0] * n))
        return tuple(range(0, n - length + 1, length)) or (0,)  # steps left over join the last cycle
    starts, at = [0], 0
    for value in values:  # steps left after them: one more cycle to the end
        at += int(value)
        if at < n:
            starts.append(at)
    return tuple(starts)


def _steps(value: Optional[float], n: int, default: int) -> int:
    """A warmup or decay flag in steps: a step count, or a fraction of the n steps of a cycle below 1."""
    if value is None:
        return default
    return int(value) if value >= 1 else int(value * n)


def lr_multiplier(settings: ScheduleSettings) -> Callable[[float], float]:
    """The schedule the settings choose, as a function of the 0-based step; with `tokens`, of the tokens
    of the steps done, counted in steps of the largest batch and lines (Ramp.full_steps)."""
    ramp = settings.tokens
    if ramp is not None:
        counted = replace(settings, steps=max(1, math.ceil(ramp.full_steps(settings.steps))), tokens=None)
        by_steps = lr_multiplier(counted)
        return lambda x: by_steps(ramp.full_steps(x))
    n = settings.steps
    if settings.stage == "annealing":
        return lambda x: 1 - min(x, n) / n
    starts = [*settings.starts, n]
    cycles = len(settings.starts)

    def multiplier(x: float) -> float:
        i = bisect.bisect_right(starts, x, hi=cycles) - 1
        return _one_cycle(settings, starts[i + 1] - starts[i], first=i == 0)(x - starts[i])

    return multiplier


def _one_cycle(settings: ScheduleSettings, n: int, first: bool = True) -> Callable[[float], float]:
    """The initial stage's schedule over one cycle of n steps (a later one warms up by --lr_rewarmup)."""
    warmup = _steps(settings.warmup, n, default_warmup(n))
    if not first and settings.rewarmup is not None:
        warmup = _steps(settings.rewarmup, n, warmup)
    r = settings.min_ratio
    decay = max(1, _steps(settings.decay, n, n // 5))
    inv_decay = max(1, _steps(settings.decay, n, n - warmup))
    timescale = max(1, warmup)

    def warm(x: float) -> float:
        return 1.0 if warmup == 0 else 1 - (1 - min(x, warmup) / warmup) ** 2

    after_warmup = {
        "cosine": lambda x: r + (1 - r) / 2 * (1 + math.cos(math.pi * min(x, n) / n)),
        "linear": lambda x: 1 - (1 - r) * min(1.0, max(0, x - warmup) / max(1, n - warmup)),
        "inv_sqrt": lambda x: max(r, math.sqrt(timescale / max(x, timescale))),
        "inv": lambda x: max(r, 1 / (1 + (1 / max(r, 1e-12) - 1) * max(0, x - warmup) / inv_decay)),
        "wsd": lambda x: 1 - (1 - r) * min(1.0, max(0, x - (n - decay)) / decay),
        "constant": lambda x: 1.0,
    }[settings.schedule]
    return lambda x: min(warm(x), after_warmup(x))


def build_scheduler(optimizer: torch.optim.Optimizer, settings: ScheduleSettings) -> LambdaLR:
    """A LambdaLR stepping once per optimizer step."""
    return LambdaLR(optimizer, lr_multiplier(settings))
