"""Synthetic data for benchmarks and smoke tests: learnable token lines, no files.

Every line walks one fixed random cycle through the vocabulary (token t is always followed by the
same token, a bigram a model learns quickly, so the loss falls); line k of the run (counted over
all ranks) starts at a point drawn from a generator seeded by (seed, k), so the batches of one global step are the same whatever the world size, so a 2-rank run
and a 1-rank run with the same global batch see the same lines.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Union

import torch

from fms_fsdp.ramp import Ramp


class DummyDataLoader:
    """Yields (inputs, labels) int64 batches of shape [batch_size, seq_length] (with `ramp`, those of each
    step: `accum` batches to a step); resumable."""

    def __init__(
        self,
        *,
        batch_size: int,
        seq_length: int,
        vocab_size: int,
        seed: int,
        rank: int,
        world_size: int,
        ramp: Optional[Ramp] = None,
        accum: int = 1,
    ):
        self.batch_size, self.seq_length, self.vocab_size = batch_size, seq_length, vocab_size
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.ramp, self.accum = ramp, accum
        self.batches_seen = 0
        self.cycle = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))

    def _line(self, k: int, length: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + k)
        start = torch.randint(self.vocab_size, (1,), generator=g)
        return self.cycle[(start + torch.arange(length + 1)) % self.vocab_size]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            b = self.batches_seen
            size, length = (self.batch_size, self.seq_length) if self.ramp is None else self.ramp.shape(b // self.accum)
            before = b * self.batch_size if self.ramp is None else self.ramp.lines_before(b, self.accum)
            first = before * self.world_size + self.rank * size  # lines of the run (every rank's) before these
            lines = torch.stack([self._line(first + i, length) for i in range(size)])
            self.batches_seen += 1
            yield lines[:, :-1], lines[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {"batches_seen": self.batches_seen}

    def load_state_dict(self, state: Union[dict[str, Any], list[dict[str, Any]]]) -> None:
        """This rank's state, or every rank's (all ranks have seen the same number of batches)."""
        self.batches_seen = int((state[0] if isinstance(state, list) else state)["batches_seen"])
