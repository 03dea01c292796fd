"""Data-mixture schedules (Levanter's stage weights): --weights_schedule='0:3,1,1;20000:1,1,2' gives the
datasets' weights from step 0, then from step 20000 on. A step is the optimizer step (counted from 0
here: stage S covers the steps after S have been trained), so every rank and every loader worker
switches at the same batch, whatever the world size, the workers or where the run resumed."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from fms_fsdp.errors import ConfigError


@dataclass(frozen=True)
class MixtureSchedule:
    """Stages of (first step, weights), the first at step 0, steps increasing."""

    stages: tuple[tuple[int, tuple[float, ...]], ...]

    @staticmethod
    def parse(text: str) -> "MixtureSchedule":
        """'0:3,1,1;20000:1,1,2' -> its stages; ConfigError naming --weights_schedule for anything else."""
        stages = []
        for part in filter(None, (p.strip() for p in str(text).split(";"))):
            step, sep, weights = part.partition(":")
            try:
                stage = (int(step), tuple(float(w) for w in weights.split(",")))
            except ValueError:
                stage = (-1, ())
            bad = not all(math.isfinite(w) and w >= 0 for w in stage[1])
            if not sep or stage[0] < 0 or bad or sum(stage[1]) <= 0:
                raise ConfigError(
                    f"--weights_schedule: cannot read {part!r}; write step:weight,weight,...;step:... "
                    "(weights >= 0, not all 0), e.g. '0:3,1,1;20000:1,1,2'"
                )
            stages.append(stage)
        if not stages or stages[0][0] != 0 or any(a[0] >= b[0] for a, b in zip(stages, stages[1:])):
            raise ConfigError("--weights_schedule: its stages must start at step 0 and go up, e.g. '0:3,1;1000:1,1'")
        if len({len(w) for _, w in stages}) != 1:
            raise ConfigError("--weights_schedule: every stage must give one weight per dataset")
        return MixtureSchedule(tuple(stages))

    def weights_at(self, step: int) -> tuple[float, ...]:
        """The weights of (0-based) optimizer step `step`."""
        i = bisect.bisect_right([s for s, _ in self.stages], step) - 1
        return self.stages[i][1]
