"""Which documents a data loader has consumed, worked out exactly from its saved position: the ledger of
a checkpoint (fms-inspect-data --ledger).

A reader's position in a logical shard is (epoch, blocks done, documents done in the current block,
tokens read of the current document), and the order of a shard's blocks and documents in each epoch is
a function of the seed alone (stream.py). So every rank's loader state, which each checkpoint holds,
names each document read: the shard's whole documents once per finished epoch, then those before the
position in the current epoch's order, and the current document in part. Nothing is added to the
checkpoint or to a step for it; working it out reads each touched document's length once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from fms_fsdp.data.order import shard_bounds
from fms_fsdp.data.shards import Dataset
from fms_fsdp.data.stream import Packing, ShardPlan, n_logical_shards, shard_table, strip_ends
from fms_fsdp.errors import DataError


@dataclass
class DatasetLedger:
    """What the loader consumed of one dataset, per document (its global index, in file order)."""

    name: str
    files: list[str]  # the dataset's files, in order
    starts: np.ndarray  # the global index of each file's first document, then the number of documents
    seen: np.ndarray = field(init=False)  # times each document was begun (once per epoch that reached it)
    tokens: np.ndarray = field(init=False)  # each document's own tokens read (without bos/eos), every epoch
    framed: int = 0  # tokens read with their bos and eos: what the lines hold of this dataset

    def __post_init__(self) -> None:
        self.seen = np.zeros(int(self.starts[-1]), np.int64)
        self.tokens = np.zeros(int(self.starts[-1]), np.int64)

    @property
    def documents(self) -> int:
        return len(self.seen)

    def where(self, doc: int) -> str:
        """A document as `file:index in the file`."""
        f = int(np.searchsorted(self.starts, doc, side="right") - 1)
        return f"{self.files[f]}:{doc - int(self.starts[f])}"


def readers_of(states: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The reader states (one per worker that delivered a batch) in every rank's loader state."""
    return (r for s in states for r in s["readers"] if r is not None)


def check_one_run(states: list[dict[str, Any]]) -> tuple[int, int]:
    """(ranks held, the run's ranks) of loader states of one run's ranks (DataError otherwise)."""
    sizes = {int(s["world_size"]) for s in states}
    ranks = [int(s["rank"]) for s in states]
    if len(sizes) != 1 or len(set(ranks)) != len(ranks):
        raise DataError(
            f"the loader states are not one run's ranks: ranks {sorted(ranks)} of world sizes {sorted(sizes)}"
        )
    return len(ranks), sizes.pop()


def _check_same_data(states: list[dict[str, Any]], datasets: list[Dataset], seed: int, logical_shards: int) -> None:
    """DataError when the states were saved over other data (document counts), another seed or another
    --logical_shards: their positions would name other documents."""
    now = {"seed": seed, "logical_shards": logical_shards, "documents": {d.name: d.documents for d in datasets}}
    for key, value in now.items():
        was = states[0][key]
        if was != value:
            raise DataError(f"the data changed since this checkpoint: {key} was {was}, is {value}")


class Lengths:
    """Each document's length once stripped (what the loader frames), read on first need."""

    def __init__(self, ds: Dataset, packing: Packing):
        self.ds, self.packing = ds, packing
        self.known: np.ndarray = np.full(ds.documents, -1, np.int64)

    def of(self, docs: np.ndarray) -> np.ndarray:
        todo = docs[self.known[docs] < 0]
        for doc in todo.tolist():
            f = int(np.searchsorted(self.ds.starts, doc, side="right") - 1)
            body = strip_ends(self.ds.read(f, doc - int(self.ds.starts[f])), self.packing.strip)
            self.known[doc] = len(body)
        return self.known[docs]


def ledger_of(
    states: list[dict[str, Any]], datasets: list[Dataset], seed: int, logical_shards: int, packing: Packing
) -> list[DatasetLedger]:
    """The documents that the loader states `states` (every rank's, of one run) have consumed, per
    dataset, read with the run's seed, --logical_shards and framing."""
    check_one_run(states)
    _check_same_data(states, datasets, seed, logical_shards)
    first = int(packing.bos is not None)
    ledgers = []
    for k, ds in enumerate(datasets):
        ledger = DatasetLedger(ds.name, files=[e.path.lstrip("/") for e in ds.entries], starts=ds.starts)
        lengths, n = Lengths(ds, packing), n_logical_shards(logical_shards, ds.documents)
        for reader in readers_of(states):
            table = shard_table(reader["datasets"][ds.name], reader["consumer"], reader["consumers"], n)
            for shard, position in table.items():
                _add_shard(ledger, ShardPlan(ds, n, shard, seed, k), n, lengths, position, first)
        ledgers.append(ledger)
    return ledgers


def _add_shard(
    ledger: DatasetLedger, plan: ShardPlan, n_shards: int, lengths: Lengths, position: tuple, first: int
) -> None:
    """Add what one logical shard (of `n_shards`) has read at `position`: its whole documents once per
    finished epoch, then the current epoch's documents before the position, and the current document's
    tokens read (`first`: 1 where a bos token begins each document)."""
    epoch, cursor, inner, offset = position
    if epoch:
        lo, hi = shard_bounds(ledger.documents, n_shards, plan.shard)
        _read_whole(ledger, np.arange(lo, hi), lengths, first, times=epoch)
    if cursor == 0 and inner == 0 and offset == 0:
        return
    ids = plan.order(epoch, np.arange(min(cursor + 1, plan.n_blocks)))
    for b, (block, file, first_doc, size) in enumerate(plan.blocks(ids)):
        base = int(ledger.starts[file])
        if b < cursor:
            _read_whole(ledger, base + first_doc + np.arange(size), lengths, first)
            continue
        order: np.ndarray = base + first_doc + plan.inner_order(epoch, block, size)
        _read_whole(ledger, order[:inner], lengths, first)
        if offset > 0:
            current = order[inner : inner + 1]
            ledger.seen[current] += 1
            ledger.tokens[current] += min(max(offset - first, 0), int(lengths.of(current)[0]))
            ledger.framed += offset


def _read_whole(ledger: DatasetLedger, docs: np.ndarray, lengths: Lengths, first: int, times: int = 1) -> None:
    """Documents read whole `times` times: an empty one (once stripped) is passed over, unframed."""
    if len(docs) == 0:
        return
    sizes = lengths.of(docs)
    ledger.seen[docs] += times
    ledger.tokens[docs] += times * sizes
    ledger.framed += times * int(np.sum(sizes[sizes > 0] + first + 1))
