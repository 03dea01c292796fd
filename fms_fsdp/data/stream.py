"""One reader's token stream: its logical shards of each dataset, mixed by weight line by line,
documents stripped, framed with bos/eos and packed into lines of seq_length + 1 tokens.

A reader (consumer c of C: one data-loader worker of one rank) owns logical shards c, c + C, c + 2C,
... of every dataset and reads them round-robin, one document at a time. Its whole position is a
few integers per shard (epoch, documents read, tokens read of the current one) and a line counter:
no token buffer, so states are small and can be regrouped over any number of readers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from fms_fsdp.data.order import permute, round_keys, shard_bounds
from fms_fsdp.data.shards import DataError, Dataset

_LOOKAHEAD = 256  # document ids computed at once per shard
_CHOICE_BLOCK = 4096  # dataset choices drawn at once


@dataclass(frozen=True)
class Packing:
    """How documents become lines."""

    seq_length: int
    eos: int
    bos: Optional[int]
    bol: Optional[int]
    eol: Optional[int]
    strip: frozenset[int]
    vocab_size: int


def n_logical_shards(logical_shards: int, documents: int) -> int:
    """Shards of a dataset: logical_shards, or fewer when it has fewer documents (none is empty)."""
    return min(logical_shards, documents)


def shard_table(dataset_state: dict[str, Any], consumer: int, consumers: int, n_shards: int) -> dict[int, tuple]:
    """shard id -> (epoch, cursor, offset) for one reader's dataset state."""
    ids = range(consumer, n_shards, consumers)
    return {s: (int(e), int(c), int(o)) for s, e, c, o in
            zip(ids, dataset_state["epoch"], dataset_state["cursor"], dataset_state["offset"])}


class DatasetReader:
    """The logical shards of one dataset owned by one reader."""

    def __init__(self, ds: Dataset, ds_index: int, n_shards: int, consumer: int, consumers: int, seed: int,
                 packing: Packing, table: Optional[dict[int, tuple]] = None, next_shard: int = 0):
        self.ds, self.ds_index, self.seed, self.packing = ds, ds_index, seed, packing
        self.shards = np.arange(consumer, n_shards, consumers)
        self.bounds = [shard_bounds(ds.documents, n_shards, int(s)) for s in self.shards]
        zeros = [(0, 0, 0)] * len(self.shards)
        rows = zeros if table is None else [table[int(s)] for s in self.shards]
        self.epoch = np.array([r[0] for r in rows], dtype=np.int64)
        self.cursor = np.array([r[1] for r in rows], dtype=np.int64)
        self.offset = np.array([r[2] for r in rows], dtype=np.int64)
        self.next = next_shard % max(1, len(self.shards))
        self._ids: dict[int, tuple[int, int, np.ndarray]] = {}  # shard -> (epoch, first cursor, doc ids)
        self._framed: tuple[tuple[int, int, int], np.ndarray] = ((-1, -1, -1), np.empty(0, np.int64))

    def _doc_id(self, i: int) -> int:
        epoch, cursor = int(self.epoch[i]), int(self.cursor[i])
        cached = self._ids.get(i)
        if cached is None or cached[0] != epoch or not cached[1] <= cursor < cached[1] + len(cached[2]):
            lo, hi = self.bounds[i]
            positions = np.arange(lo + cursor, min(hi, lo + cursor + _LOOKAHEAD))
            keys = round_keys(self.seed, self.ds_index, epoch)
            cached = (epoch, cursor, permute(positions, self.ds.documents, keys))
            self._ids[i] = cached
        return int(cached[2][cursor - cached[1]])

    def _frame(self, i: int) -> np.ndarray:
        """The current document of shard i: stripped, checked, with bos/eos; empty if nothing is left."""
        key = (i, int(self.epoch[i]), int(self.cursor[i]))
        if self._framed[0] != key:
            tokens, path, j = self.ds.document(self._doc_id(i))
            p, lo, hi = self.packing, 0, len(tokens)
            while lo < hi and int(tokens[lo]) in p.strip:
                lo += 1
            while hi > lo and int(tokens[hi - 1]) in p.strip:
                hi -= 1
            body = tokens[lo:hi]
            if hi > lo and int(body.max()) >= p.vocab_size:
                raise DataError(f"{self.ds.root / path.lstrip('/')}: document {j} has token id {int(body.max())} "
                                f">= vocab_size {p.vocab_size}; set --vocab_size or fix the data")
            parts = ([[p.bos]] if p.bos is not None else []) + [body, [p.eos]]
            self._framed = (key, np.concatenate(parts).astype(np.int64) if hi > lo else np.empty(0, np.int64))
        return self._framed[1]

    def _finish_document(self, i: int) -> None:
        self.cursor[i] += 1
        self.offset[i] = 0
        lo, hi = self.bounds[i]
        if self.cursor[i] >= hi - lo:
            self.epoch[i] += 1
            self.cursor[i] = 0
        self.next = (i + 1) % len(self.shards)

    def fill(self, out: np.ndarray) -> None:
        """Fill `out` with the next tokens of this reader's documents."""
        filled, empty_in_a_row = 0, 0
        while filled < len(out):
            i = self.next
            framed = self._frame(i)
            empty_in_a_row = empty_in_a_row + 1 if len(framed) == 0 else 0
            if empty_in_a_row > self.ds.documents:
                raise DataError(f"{self.ds.root}: every document is empty once stripped of bos/eos/strip_tokens")
            rest = framed[int(self.offset[i]):]
            take = min(len(out) - filled, len(rest))
            out[filled: filled + take] = rest[:take]
            filled += take
            self.offset[i] += take
            if self.offset[i] >= len(framed):  # done, or an empty document skipped
                self._finish_document(i)

    def state(self) -> dict[str, Any]:
        return {"epoch": self.epoch.astype(np.int32), "cursor": self.cursor.astype(np.int32),
                "offset": self.offset.astype(np.int32), "next": self.next}


class Reader:
    """Lines of seq_length + 1 tokens for one reader (consumer) over all datasets."""

    def __init__(self, datasets: list[Dataset], weights: list[float], logical_shards: int, consumer: int,
                 consumers: int, seed: int, packing: Packing, state: Optional[dict[str, Any]] = None):
        self.consumer, self.consumers, self.seed, self.packing = consumer, consumers, seed, packing
        self.names = [d.name for d in datasets]
        self.p = np.asarray(weights, dtype=np.float64) / sum(weights)
        self.lines = 0 if state is None else int(state["lines"])
        self.readers = []
        for k, ds in enumerate(datasets):
            n = n_logical_shards(logical_shards, ds.documents)
            ds_state = None if state is None else state["datasets"][ds.name]
            table = None if ds_state is None else shard_table(ds_state, consumer, consumers, n)
            self.readers.append(DatasetReader(ds, k, n, consumer, consumers, seed, packing, table,
                                              0 if ds_state is None else ds_state["next"]))
        self._choices: tuple[int, np.ndarray] = (-1, np.empty(0, np.int64))

    def _dataset_for_line(self, line: int) -> int:
        if len(self.readers) == 1:
            return 0
        block = line // _CHOICE_BLOCK
        if self._choices[0] != block:
            rng = np.random.default_rng([self.seed, self.consumers, self.consumer, block])
            self._choices = (block, rng.choice(len(self.readers), size=_CHOICE_BLOCK, p=self.p))
        return int(self._choices[1][line % _CHOICE_BLOCK])

    def next_line(self) -> np.ndarray:
        """seq_length + 1 tokens: [bol] documents... [eol], all from one dataset chosen by weight."""
        p = self.packing
        line = np.empty(p.seq_length + 1, dtype=np.int64)
        start, stop = int(p.bol is not None), len(line) - int(p.eol is not None)
        if p.bol is not None:
            line[0] = p.bol
        if p.eol is not None:
            line[-1] = p.eol
        self.readers[self._dataset_for_line(self.lines)].fill(line[start:stop])
        self.lines += 1
        return line

    def state(self) -> dict[str, Any]:
        return {"consumer": self.consumer, "consumers": self.consumers, "lines": self.lines,
                "datasets": {name: r.state() for name, r in zip(self.names, self.readers)}}
