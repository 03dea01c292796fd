"""One reader's token stream: its logical shards of each dataset, mixed by weight line by line,
documents stripped, framed with bos/eos and packed into lines of seq_length + 1 tokens.

A reader (consumer c of C: one data-loader worker of one rank) owns logical shards c, c + C, c + 2C,
... of every dataset. A logical shard is a contiguous range of a dataset's documents in file order
(so it touches one or two files), cut into blocks: one document each where any document can be read
at random (Arrow, Megatron, token arrays: zero-copy), one row group in Parquet or 256 lines of text
(decoded once, then read whole). Each epoch a shard's
blocks, and the documents inside each block, are read in a new seeded order. The reader
interleaves, document by document, a window of ACTIVE_SHARDS shards, taken in a seeded priority
order among those of its shards furthest behind: few files are hot at a time, while documents
that are adjacent in a file land far apart in the stream. Its whole position is four integers per
shard (epoch, blocks done, documents done in the current block, tokens read of the current
document) and a line counter: no token buffer, so states are small and can be regrouped over any
number of readers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from fms_fsdp.data.order import permute, round_keys, shard_bounds
from fms_fsdp.data.shards import Dataset
from fms_fsdp.errors import DataError

ACTIVE_SHARDS = 8  # logical shards a reader interleaves at a time, per dataset
_LOOKAHEAD = 256  # block ids computed at once per shard
_CHOICE_BLOCK = 4096  # dataset choices drawn at once
POSITION = ("epoch", "cursor", "inner", "offset")  # a shard's position, as stored in reader states


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
    """shard id -> (epoch, cursor, inner, offset) for one reader's dataset state."""
    columns = [dataset_state[k] for k in POSITION]
    return {s: tuple(int(c[k]) for c in columns) for k, s in enumerate(range(consumer, n_shards, consumers))}


def strip_ends(tokens: np.ndarray, strip: frozenset[int]) -> np.ndarray:
    """A document without the bos/eos/strip_tokens at either end (a view)."""
    lo, hi = 0, len(tokens)
    while lo < hi and int(tokens[lo]) in strip:
        lo += 1
    while hi > lo and int(tokens[hi - 1]) in strip:
        hi -= 1
    return tokens[lo:hi]


class ShardPlan:
    """The blocks of one logical shard and their order in each epoch."""

    def __init__(self, ds: Dataset, n_shards: int, shard: int, seed: int, ds_index: int):
        self.shard, self.seed, self.ds_index = shard, seed, ds_index
        self.sequential = False  # a gzipped text file: blocks in file order
        lo, hi = shard_bounds(ds.documents, n_shards, shard)
        first, last = (int(np.searchsorted(ds.starts, d, side="right") - 1) for d in (lo, hi - 1))
        files, starts, seg_blocks = [], [], []  # per file segment: file, block starts (file-local docs)
        for f in range(first, last + 1):
            a, b = max(lo, int(ds.starts[f])) - int(ds.starts[f]), min(hi, int(ds.starts[f + 1])) - int(ds.starts[f])
            shard_file = ds.file(f)
            groups = shard_file.blocks
            self.sequential = self.sequential or shard_file.sequential
            if groups is None:
                cuts = np.arange(a, b + 1)
            else:
                cuts = np.unique(np.clip(groups, a, b))
            files.append(f)
            starts.append(cuts)
            seg_blocks.append(len(cuts) - 1)
        self.files, self.starts = files, starts
        self.first_block = np.concatenate([[0], np.cumsum(seg_blocks)])
        self.n_blocks = int(self.first_block[-1])

    def order(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """The blocks read at `positions` of the shard's epoch (in file order where a file cannot seek;
        the documents inside each block are shuffled all the same)."""
        if self.sequential:
            return positions.astype(np.int64)
        return permute(positions, self.n_blocks, round_keys(self.seed, self.ds_index, self.shard, epoch))

    def blocks(self, ids: np.ndarray) -> list[tuple[int, int, int, int]]:
        """(block id, file, first document in the file, documents) of each block id."""
        seg = np.searchsorted(self.first_block, ids, side="right") - 1
        out = []
        for block, k, b in zip(ids.tolist(), seg.tolist(), (ids - self.first_block[seg]).tolist()):
            cuts = self.starts[k]
            out.append((block, self.files[k], int(cuts[b]), int(cuts[b + 1] - cuts[b])))
        return out

    def inner_order(self, epoch: int, block: int, size: int) -> np.ndarray:
        """The order of the documents inside a block of `size` documents."""
        if size == 1:
            return np.zeros(1, np.int64)
        return permute(np.arange(size), size, round_keys(self.seed, self.ds_index, self.shard, epoch, block + 1))


class DatasetReader:
    """The logical shards of one dataset owned by one reader. Positions are plain Python ints on this
    hot path; state() copies them."""

    def __init__(
        self,
        ds: Dataset,
        *,
        ds_index: int,
        n_shards: int,
        consumer: int,
        consumers: int,
        seed: int,
        packing: Packing,
        table: Optional[dict[int, tuple]] = None,
        next_shard: int = 0,
    ):
        self.ds, self.ds_index, self.n_shards, self.seed, self.packing = ds, ds_index, n_shards, seed, packing
        self.shards = list(range(consumer, n_shards, consumers))
        rows = [table[s] if table else (0, 0, 0, 0) for s in self.shards]
        self.epoch, self.cursor, self.inner, self.offset = (list(c) for c in zip(*rows)) if rows else ([],) * 4
        self.next = next_shard
        self._plans: dict[int, ShardPlan] = {}
        self._order: tuple[int, list[int], int] = (-1, [], 0)  # (round, shards by priority, finished prefix)
        self._active = self._window()
        self._ahead: dict[
            int, tuple[int, int, list[tuple[int, int, int, int]]]
        ] = {}  # shard -> (epoch, cursor, blocks)
        self._inner: dict[int, tuple[tuple[int, int], np.ndarray]] = {}  # shard -> ((epoch, cursor), order)
        self._current: tuple[tuple[int, ...], np.ndarray, int] = ((), np.empty(0, np.int64), 0)  # key, body, block size
        self.read_docs: list[tuple[int, int]] = []  # (file, index) of the documents read since the last check

    def _plan(self, i: int) -> ShardPlan:
        plan = self._plans.get(i)
        if plan is None:
            plan = self._plans[i] = ShardPlan(self.ds, self.n_shards, self.shards[i], self.seed, self.ds_index)
        return plan

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

    def _block(self, i: int) -> tuple[int, int, int, int]:
        """(block id, file, first document, documents) of shard i's current block."""
        epoch, cursor = self.epoch[i], self.cursor[i]
        ahead = self._ahead.get(i)
        if ahead is None or ahead[0] != epoch or not ahead[1] <= cursor < ahead[1] + len(ahead[2]):
            plan = self._plan(i)
            positions = np.arange(cursor, min(plan.n_blocks, cursor + _LOOKAHEAD))
            ahead = (epoch, cursor, plan.blocks(plan.order(epoch, positions)))
            self._ahead[i] = ahead
        return ahead[2][cursor - ahead[1]]

    def _locate(self, i: int) -> tuple[int, int, int]:
        """(file, index in file, documents in its block) of shard i's current document."""
        block, file, first, size = self._block(i)
        if size == 1:
            return file, first, 1
        key = (self.epoch[i], self.cursor[i])
        cached = self._inner.get(i)
        if cached is None or cached[0] != key:
            cached = self._inner[i] = (key, self._plan(i).inner_order(key[0], block, size))
        return file, first + int(cached[1][self.inner[i]]), size

    def _body(self, i: int) -> np.ndarray:
        """Shard i's current document stripped of bos/eos/strip_tokens at both ends (a view)."""
        key = (i, self.epoch[i], self.cursor[i], self.inner[i])
        if self._current[0] != key:
            file, j, size = self._locate(i)
            self._current = (key, strip_ends(self.ds.read(file, j), self.packing.strip), size)
            self.read_docs.append((file, j))
        return self._current[1]

    def _finish_document(self, i: int) -> None:
        """Move shard i past its current document (the one _body(i) just returned)."""
        self.offset[i] = 0
        self.inner[i] += 1
        if self.inner[i] >= self._current[2]:
            self.inner[i] = 0
            self.cursor[i] += 1
            if self.cursor[i] >= self._plan(i).n_blocks:
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
                    raise DataError(
                        f"{self.ds.root / self.ds.name}: every document is empty once stripped of bos/eos/strip_tokens"
                    )
                self._finish_document(i)
                continue
            empty_in_a_row = 0
            o = self.offset[i]
            if o < first:
                out[filled] = bos
                filled, o = filled + 1, o + 1
            k = min(n - filled, len(body) + first - o)
            out[filled : filled + k] = body[o - first : o - first + k]
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
                    raise DataError(
                        f"{self.ds.path(file)}: document {j} has token id {int(doc.max())} >= vocab_size "
                        f"{self.packing.vocab_size}; set --vocab_size or fix the data"
                    )
            raise DataError(
                f"token id {int(tokens.max())} >= vocab_size {self.packing.vocab_size} in "
                f"--bos/eos/bol/eol tokens; set --vocab_size"
            )
        self.read_docs.clear()

    def state(self) -> dict[str, Any]:
        """Copies of the positions (lists: cheap enough to take at every batch)."""
        return {
            "epoch": self.epoch[:],
            "cursor": self.cursor[:],
            "inner": self.inner[:],
            "offset": self.offset[:],
            "next": self.next,
        }


class LineReader:
    """Lines of seq_length + 1 tokens for one reader (consumer) over all datasets."""

    def __init__(
        self,
        datasets: list[Dataset],
        weights: list[float],
        logical_shards: int,
        consumer: int,
        consumers: int,
        seed: int,
        packing: Packing,
        state: Optional[dict[str, Any]] = None,
    ):
        self.consumer, self.consumers, self.seed, self.packing = consumer, consumers, seed, packing
        self.names = [d.name for d in datasets]
        self.p = np.asarray(weights, dtype=np.float64) / sum(weights)
        self.lines = 0 if state is None else int(state["lines"])
        # lines taken from each dataset, for the metrics (a state without them: none yet)
        self.used = [0] * len(datasets) if state is None else [int(n) for n in state.get("used", [0] * len(datasets))]
        self.readers = []
        for k, ds in enumerate(datasets):
            n = n_logical_shards(logical_shards, ds.documents)
            ds_state = None if state is None else state["datasets"][ds.name]
            table = None if ds_state is None else shard_table(ds_state, consumer, consumers, n)
            self.readers.append(
                DatasetReader(
                    ds,
                    ds_index=k,
                    n_shards=n,
                    consumer=consumer,
                    consumers=consumers,
                    seed=seed,
                    packing=packing,
                    table=table,
                    next_shard=0 if ds_state is None else ds_state["next"],
                )
            )
        self._choices: tuple[int, np.ndarray] = (-1, np.empty(0, np.int64))

    def set_weights(self, weights: tuple[float, ...]) -> None:
        """The weights of the lines from here on (--weights_schedule): the same draws for a line, given
        the weights, so a resume anywhere repeats them."""
        p = np.asarray(weights, dtype=np.float64) / sum(weights)
        if not np.array_equal(p, self.p):
            self.p, self._choices = p, (-1, self._choices[1])

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
        k = self._dataset_for_line(self.lines)
        reader = self.readers[k]
        reader.fill(line[start:stop])
        reader.check_vocab(line)
        self.lines += 1
        self.used[k] += 1

    def state(self) -> dict[str, Any]:
        return {
            "consumer": self.consumer,
            "consumers": self.consumers,
            "lines": self.lines,
            "used": self.used[:],
            "datasets": {name: r.state() for name, r in zip(self.names, self.readers)},
        }
