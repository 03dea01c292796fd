"""Learning-rate schedules, as multipliers of learning_rate at step x (0-based) of num_steps.

- initial + cosine: fms-fsdp's default, quadratic warmup then cosine to min_lr_ratio
  (0.1 gives exactly fms-fsdp's min(1 - (1 - x/w)^2, 0.1 + 0.45 (1 + cos(pi x / N)))).
- initial + linear: warmup, then a straight line from 1 to min_lr_ratio at the last step.
- initial + inv_sqrt: warmup, then sqrt(warmup / x), not below min_lr_ratio (Levanter's inv_sqrt).
- initial + wsd: warmup, stable at 1, linear decay to min_lr_ratio over the last decay_steps.
- initial + constant: warmup, then 1.
- annealing: fms-fsdp's annealing stage, 1 - x/N.
With --lr_cycles=K the initial stage's schedule runs K times over num_steps, each cycle warming up
again (Levanter's cycles). Any num_steps >= 1 works (fms-fsdp divided by zero below 20 steps).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.optim.lr_scheduler import LambdaLR

from fms_fsdp.config import train_config


def default_warmup(num_steps: int) -> int:
    """fms-fsdp's warmup length: min(2000, num_steps // 20)."""
    return min(2000, num_steps // 20)


@dataclass(frozen=True)
class ScheduleSettings:
    """The learning-rate flags: --training_stage, --lr_schedule, --num_steps, --lr_cycles,
    --warmup_steps, --decay_steps, --min_lr_ratio."""

    stage: str
    schedule: str
    steps: int
    cycles: int
    warmup: Optional[int]
    decay: Optional[int]
    min_ratio: float

    @staticmethod
    def of(cfg: train_config) -> "ScheduleSettings":
        return ScheduleSettings(
            cfg.training_stage,
            cfg.lr_schedule,
            cfg.num_steps,
            cfg.lr_cycles,
            cfg.warmup_steps,
            cfg.decay_steps,
            cfg.min_lr_ratio,
        )


def lr_multiplier(settings: ScheduleSettings) -> Callable[[int], float]:
    """The schedule the settings choose, as a function of the 0-based step."""
    n = settings.steps
    if settings.stage == "annealing":
        return lambda x: 1 - min(x, n) / n
    starts = [i * n // settings.cycles for i in range(settings.cycles)] + [n]

    def multiplier(x: int) -> float:
        i = bisect.bisect_right(starts, x, hi=settings.cycles) - 1
        return _one_cycle(settings, starts[i + 1] - starts[i])(x - starts[i])

    return multiplier


def _one_cycle(settings: ScheduleSettings, n: int) -> Callable[[int], float]:
    """The initial stage's schedule over one cycle of n steps."""
    warmup = default_warmup(n) if settings.warmup is None else settings.warmup
    r = settings.min_ratio
    decay = max(1, n // 5 if settings.decay is None else settings.decay)
    timescale = max(1, warmup)

    def warm(x: int) -> float:
        return 1.0 if warmup == 0 else 1 - (1 - min(x, warmup) / warmup) ** 2

    after_warmup = {
        "cosine": lambda x: r + (1 - r) / 2 * (1 + math.cos(math.pi * min(x, n) / n)),
        "linear": lambda x: 1 - (1 - r) * min(1.0, max(0, x - warmup) / max(1, n - warmup)),
        "inv_sqrt": lambda x: max(r, math.sqrt(timescale / max(x, timescale))),
        "wsd": lambda x: 1 - (1 - r) * min(1.0, max(0, x - (n - decay)) / decay),
        "constant": lambda x: 1.0,
    }[settings.schedule]
    return lambda x: min(warm(x), after_warmup(x))


def build_scheduler(optimizer: torch.optim.Optimizer, settings: ScheduleSettings) -> LambdaLR:
    """A LambdaLR stepping once per optimizer step."""
    return LambdaLR(optimizer, lr_multiplier(settings))
