"""--batch_size_schedule and --seq_length_schedule: the batch size and line length of each optimizer step.

A schedule `0:2,1000:4,3000:8` says: from the start each step takes 2 lines per data-parallel rank (as
--batch_size counts them), once 1000 steps are done 4, once 3000 are done 8. The largest stage is the
flag's own value (--batch_size, --seq_length), which the memory plan and --dry_run judge. Both are
functions of the step alone, so every reader of the data knows the shape of each batch it makes: the
loader stays exactly-once and resumes exactly across every change (and across a rescale), and the
synthetic data too. Stages given in tokens seen (--ramp_unit=tokens) are turned into steps at start-up
(`steps_of_tokens`), for the run's number of data-parallel ranks; a resumed run keeps its checkpoint's
steps as they were and counts the later stages' tokens from there, on any world size. The learning-rate schedule may count
the tokens of the steps instead of the steps (--lr_schedule_unit=tokens: `full_steps`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from fms_fsdp.errors import ConfigError


@dataclass(frozen=True)
class Stages:
    """A value by optimizer step: `values[i]` from `starts[i]` steps done on (starts[0] is 0)."""

    starts: tuple[int, ...]
    values: tuple[int, ...]

    @classmethod
    def parse(cls, flag: str, text: str, largest: int, of: str, unit: str = "step") -> "Stages":
        """The stages of `--flag=text` (one stage of `largest` when empty); ConfigError naming the flag
        unless it is `step:value,...` (`unit`: what a start counts) from 0, starts increasing, values
        positive, the largest `of`'s value."""
        if not text:
            return cls((0,), (largest,))
        try:
            pairs = [tuple(int(x) for x in stage.split(":")) for stage in text.replace(" ", "").split(",")]
            starts, values = zip(*pairs) if all(len(p) == 2 for p in pairs) else ((), ())
        except ValueError:
            starts, values = (), ()
        if not starts or starts[0] != 0 or list(starts) != sorted(set(starts)) or min(values) < 1:
            raise ConfigError(
                f"--{flag}={text}: give {unit}:value stages from {unit} 0 in increasing {unit}s, e.g. 0:2,1000:4,3000:8"
            )
        if max(values) != largest:
            raise ConfigError(
                f"--{flag}={text}: its largest stage is {max(values)} but --{of}={largest}; --{of} is the "
                f"largest stage (the memory plan's): set --{of}={max(values)}"
            )
        return cls(tuple(starts), tuple(values))

    def at(self, step: int) -> int:
        """The value of the step after `step` steps are done (0-based)."""
        return self.values[bisect.bisect_right(self.starts, step) - 1]

    @property
    def changes(self) -> bool:
        return len(self.values) > 1


@dataclass(frozen=True)
class Ramp:
    """The batch size and line length of every step."""

    batch: Stages
    seq: Stages

    @property
    def changes(self) -> bool:
        return self.batch.changes or self.seq.changes

    def shape(self, step: int) -> tuple[int, int]:
        """(lines per data-parallel rank and micro-batch, tokens per line) of 0-based step `step`."""
        return self.batch.at(step), self.seq.at(step)

    def tokens(self, step: int) -> int:
        batch, seq = self.shape(step)
        return batch * seq

    def full_steps(self, steps: float) -> float:
        """The tokens of the first `steps` steps over those of a step of the largest stages: the steps of
        the largest batch and lines that took as many tokens."""
        whole = int(steps)
        done = _sum_before(self.tokens, (*self.batch.starts, *self.seq.starts), whole)
        return (done + (steps - whole) * self.tokens(whole)) / (max(self.batch.values) * max(self.seq.values))

    def lines_before(self, batch: int, accum: int) -> int:
        """The lines a rank took in its first `batch` micro-batches (`accum` to a step)."""
        step, inner = divmod(batch, accum)
        return _sum_before(self.batch.at, self.batch.starts, step) * accum + inner * self.batch.at(step)


def _sum_before(value: Callable[[int], int], changes: Sequence[int], steps: int) -> int:
    """value(0) + ... + value(steps - 1) of a value that changes only at the steps `changes`."""
    bounds = sorted({0, steps, *(s for s in changes if s < steps)})
    return sum((b - a) * value(a) for a, b in zip(bounds, bounds[1:]))


@dataclass(frozen=True)
class Resumed:
    """Where a resumed run goes on from: its checkpoint's step and tokens seen (every rank's), and the
    shapes its steps had (the schedules in steps that the checkpoint recorded)."""

    step: int
    tokens_seen: int
    ramp: Ramp


def steps_of_tokens(batch: Stages, seq: Stages, lines_per_step: int, resumed: Optional[Resumed] = None) -> Ramp:
    """The Ramp of `batch` and `seq` whose stages start at tokens seen (--ramp_unit=tokens): each stage from
    the first step before which at least its tokens were seen, a step taking batch x seq x
    `lines_per_step` tokens (data-parallel ranks x --grad_accum_steps lines per line of --batch_size). A
    stage that a single step passes over is left out. `resumed`: the checkpoint a run goes on from, whose
    steps keep the shapes they had (and the learning rate the tokens they took, on any world size); the
    stages whose tokens it had seen hold from its step, the later ones start by the tokens seen from there."""
    start = resumed or Resumed(0, 0, Ramp(batch, seq))  # from step 0: no step before it keeps a shape
    at_step = {}  # token bound -> the step its stages start at
    step, seen = start.step, start.tokens_seen
    for bound in sorted({*batch.starts, *seq.starts}):
        if bound <= start.tokens_seen:
            continue
        per_step = batch.at(seen) * seq.at(seen) * lines_per_step
        steps = -(-(bound - seen) // per_step)  # whole steps, rounded up
        step, seen = step + steps, seen + steps * per_step
        at_step[bound] = step

    def in_steps(stages: Stages, before: Stages) -> Stages:
        starts = {s: v for s, v in zip(before.starts, before.values) if s < start.step}
        starts[start.step] = stages.at(start.tokens_seen)
        starts |= {at_step[t]: v for t, v in zip(stages.starts, stages.values) if t in at_step}  # a later one wins
        kept: list[tuple[int, int]] = []
        for s, v in sorted(starts.items()):
            if not kept or kept[-1][1] != v:  # a stage that goes on is not a new one
                kept.append((s, v))
        return Stages(tuple(s for s, _ in kept), tuple(v for _, v in kept))

    return Ramp(in_steps(batch, start.ramp.batch), in_steps(seq, start.ramp.seq))


def ramp_of(batch_schedule: str, seq_schedule: str, batch_size: int, seq_length: int) -> Optional[Ramp]:
    """The Ramp of --batch_size_schedule and --seq_length_schedule (whose largest stages are --batch_size and
    --seq_length); None when every step has their shape; ConfigError naming a schedule that cannot be."""
    ramp = Ramp(
        Stages.parse("batch_size_schedule", batch_schedule, batch_size, "batch_size"),
        Stages.parse("seq_length_schedule", seq_schedule, seq_length, "seq_length"),
    )
    return ramp if ramp.changes else None
