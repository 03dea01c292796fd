"""One reader's token stream: its logical shards of each dataset, mixed by weight line by line,
documents stripped, framed with bos/eos and packed into lines of seq_length + 1 tokens.

A reader (consumer c of C: one data-loader worker of one rank) owns logical shards c, c + C, c + 2C,
... of every dataset. A logical shard is a contiguous range of a dataset's documents in file order
(so it touches one or two files), read in an order permuted anew each epoch. The reader interleaves
document by document a window of ACTIVE_SHARDS shards, taken in a seeded priority order among those
of its shards furthest behind, so few files are hot at a time, while documents that are adjacent
in a file land far apart in the stream. Its whole position is a few integers per shard (epoch,
documents read, tokens read of the current one) and a line counter: no token buffer, so states are
small and can be regrouped over any number of readers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from fms_fsdp.data.order import permute, round_keys, shard_bounds
from fms_fsdp.data.shards import DataError, Dataset

ACTIVE_SHARDS = 8  # logical shards a reader interleaves at a time, per dataset
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


def shard_documents(documents: int, n_shards: int, shard: int, epoch: int, seed: int, ds_index: int,
                    positions: np.ndarray) -> np.ndarray:
    """Dataset document indices read at `positions` (0, 1, ...) of `shard` in `epoch`."""
    lo, hi = shard_bounds(documents, n_shards, shard)
    return lo + permute(positions, hi - lo, round_keys(seed, ds_index, shard, epoch))


class DatasetReader:
    """The logical shards of one dataset owned by one reader. Per-shard positions are plain Python
    ints on this hot path; state() turns them into small numpy arrays."""

    def __init__(self, ds: Dataset, ds_index: int, n_shards: int, consumer: int, consumers: int, seed: int,
                 packing: Packing, table: Optional[dict[int, tuple]] = None, next_shard: int = 0):
        self.ds, self.ds_index, self.n_shards, self.seed, self.packing = ds, ds_index, n_shards, seed, packing
        self.shards = list(range(consumer, n_shards, consumers))
        self.sizes = [hi - lo for lo, hi in (shard_bounds(ds.documents, n_shards, s) for s in self.shards)]
        rows = [(0, 0, 0)] * len(self.shards) if table is None else [table[s] for s in self.shards]
        self.epoch, self.cursor, self.offset = (list(col) for col in zip(*rows)) if rows else ([], [], [])
        self.next = next_shard
        self._order: tuple[int, list[int], int] = (-1, [], 0)  # (round, shards by priority, finished prefix)
        self._active = self._window()
        self._ahead: dict[int, tuple[int, int, list[int], list[int]]] = {}  # shard -> (epoch, cursor, files, indices)
        self._current: tuple[tuple[int, int, int], np.ndarray] = ((-1, -1, -1), np.empty(0, np.int64))
        self.read_docs: list[tuple[int, int]] = []  # (file, index) of the documents read since the last check

    def _window(self) -> list[int]:
        """The active shards: the first ACTIVE_SHARDS, in round R's seeded priority order, of those
        still in round R = the lowest epoch among this reader's shards. Derived from the state alone
        (the order of a round is computed once and its finished prefix skipped)."""
        if not self.shards:
            return []
        round_ = min(self.epoch)
        if self._order[0] != round_:
            priority = permute(np.array(self.shards), self.n_shards, round_keys(self.seed, self.ds_index, round_, -1))
            self._order = (round_, np.argsort(priority, kind="stable").tolist(), 0)
        _, order, skip = self._order
        while self.epoch[order[skip]] != round_:
            skip += 1
        self._order = (round_, order, skip)
        window = []
        for i in order[skip:]:
            if self.epoch[i] == round_:
                window.append(i)
                if len(window) == ACTIVE_SHARDS:
                    break
        return window

    def _locate(self, i: int) -> tuple[int, int]:
        """(file number, index in file) of shard i's current document."""
        epoch, cursor = self.epoch[i], self.cursor[i]
        ahead = self._ahead.get(i)
        if ahead is None or ahead[0] != epoch or not ahead[1] <= cursor < ahead[1] + len(ahead[2]):
            positions = np.arange(cursor, min(self.sizes[i], cursor + _LOOKAHEAD))
            docs = shard_documents(self.ds.documents, self.n_shards, self.shards[i], epoch, self.seed,
                                   self.ds_index, positions)
            ahead = (epoch, cursor, *self.ds.locate(docs))
            self._ahead[i] = ahead
        k = cursor - ahead[1]
        return ahead[2][k], ahead[3][k]

    def _body(self, i: int) -> np.ndarray:
        """Shard i's current document stripped of bos/eos/strip_tokens at both ends (a view)."""
        key = (i, self.epoch[i], self.cursor[i])
        if self._current[0] != key:
            file, j = self._locate(i)
            tokens = self.ds.read(file, j)
            lo, hi, strip = 0, len(tokens), self.packing.strip
            while lo < hi and int(tokens[lo]) in strip:
                lo += 1
            while hi > lo and int(tokens[hi - 1]) in strip:
                hi -= 1
            self._current = (key, tokens[lo:hi])
            self.read_docs.append((file, j))
        return self._current[1]

    def _finish_document(self, i: int) -> None:
        self.cursor[i] += 1
        self.offset[i] = 0
        if self.cursor[i] >= self.sizes[i]:
            self.epoch[i] += 1
            self.cursor[i] = 0
            self._ahead.pop(i, None)
            self._active = self._window()
        self.next = (self.next + 1) % len(self._active)

    def fill(self, out: np.ndarray) -> None:
        """Fill `out` with the next tokens of this reader's documents, each framed as
        [bos] document eos. A document's position (offset) counts framed tokens."""
        bos, eos = self.packing.bos, self.packing.eos
        first = int(bos is not None)
        filled, empty_in_a_row, n = 0, 0, len(out)
        while filled < n:
            i = self._active[self.next % len(self._active)]
            body = self._body(i)
            if len(body) == 0:
                empty_in_a_row += 1
                if empty_in_a_row > self.ds.documents:
                    raise DataError(f"{self.ds.root / self.ds.name}: every document is empty once stripped of "
                                    "bos/eos/strip_tokens")
                self._finish_document(i)
                continue
            empty_in_a_row = 0
            o = self.offset[i]
            if o < first:
                out[filled] = bos
                filled, o = filled + 1, o + 1
            k = min(n - filled, len(body) + first - o)
            out[filled: filled + k] = body[o - first: o - first + k]
            filled, o = filled + k, o + k
            if filled < n and o == len(body) + first:
                out[filled] = eos
                filled, o = filled + 1, o + 1
            self.offset[i] = o
            if o == len(body) + first + 1:
                self._finish_document(i)

    def check_vocab(self, tokens: np.ndarray) -> None:
        """After filling: every token id < vocab_size, else a DataError naming the document."""
        if len(tokens) and int(tokens.max()) >= self.packing.vocab_size:
            for file, j in self.read_docs:
                doc = self.ds.read(file, j)
                if len(doc) and int(doc.max()) >= self.packing.vocab_size:
                    path = self.ds.root / self.ds.entries[file].path.lstrip("/")
                    raise DataError(f"{path}: document {j} has token id {int(doc.max())} >= vocab_size "
                                    f"{self.packing.vocab_size}; set --vocab_size or fix the data")
            raise DataError(f"token id {int(tokens.max())} >= vocab_size {self.packing.vocab_size} in "
                            f"--bos/eos/bol/eol tokens; set --vocab_size")
        self.read_docs.clear()

    def state(self) -> dict[str, Any]:
        """Copies of the positions (lists: cheap enough to take at every batch)."""
        return {"epoch": self.epoch[:], "cursor": self.cursor[:], "offset": self.offset[:], "next": self.next}


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

    def next_line(self, line: np.ndarray) -> None:
        """Fill `line` (seq_length + 1 tokens) with [bol] documents... [eol], all from one dataset
        chosen by weight."""
        p = self.packing
        start, stop = int(p.bol is not None), len(line) - int(p.eol is not None)
        if p.bol is not None:
            line[0] = p.bol
        if p.eol is not None:
            line[-1] = p.eol
        reader = self.readers[self._dataset_for_line(self.lines)]
        reader.fill(line[start:stop])
        reader.check_vocab(line)
        self.lines += 1

    def state(self) -> dict[str, Any]:
        return {"consumer": self.consumer, "consumers": self.consumers, "lines": self.lines,
                "datasets": {name: r.state() for name, r in zip(self.names, self.readers)}}
