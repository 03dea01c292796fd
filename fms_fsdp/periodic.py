"""Work the training loop runs at some steps, beside the steps themselves: evaluation (evaluation/evaluate.py),
lm-eval tasks (evaluation/harness.py), periodic exports (checkpoint/export.py) and the profiler (profiling.py).

Each is a `Periodic`: the loop asks it whether it is `due` at a step, `run`s it (every rank, after the
step's checkpoint is committed) and hands the `Report` it returns to the metrics reporter; `finish`
once the loop has ended normally (a collective: waits for work still in flight, raises its failure),
`close` on every way out (no collective: threads, buffers). The step guard, checkpointing and fault
tolerance are not periodic work: their order is the loop's contract (train/loop.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch


@dataclass(frozen=True)
class Report:
    """What periodic work reports: `record`, a metrics record of its own (metrics.jsonl, the trackers;
    rank 0 prints `line`); `interval`, figures added to the next interval record (summed); `seconds`
    spent outside the steps, not counted in step_time."""

    seconds: float = 0.0
    record: Optional[dict[str, Any]] = None
    line: str = ""
    interval: dict[str, float] = field(default_factory=dict)
    scores_checkpoint: bool = False  # an evaluation: --checkpoint_keep_best ranks the step's checkpoint by it


class Periodic(Protocol):
    """Work due at some steps of the loop (see the module's docstring)."""

    reads_model: bool  # the step guard checks the model first: never export or evaluate a diverged one

    def due(self, step: int) -> bool:
        """Whether it runs after optimizer step `step`."""
        ...

    def run(self, step: int, model: torch.nn.Module) -> Report:
        """Do it on the model as trained to `step` (every rank calls it)."""
        ...

    def finish(self) -> None:
        """The loop ended normally: wait for what is in flight (every rank calls it)."""
        ...

    def close(self) -> None:
        """On every way out of the loop, an exception's too: free threads and buffers, no collective."""
        ...
