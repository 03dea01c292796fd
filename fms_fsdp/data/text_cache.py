"""Raw text read while its --cache_dir is being built (--cache_build=beside or external): the loader reads
the text files in the order it reads raw text on the fly (data/text.py), and takes each block's tokens
from the cache where the build has finished the pieces that hold it, else tokenizes the block itself.
Both give the same tokens (the same tokenizer, the same documents: the build skips exactly the records
that read as empty documents here), so the batches are a function of the text and the seed alone,
never of how far the build is.

How a document is found in the cache: the build cuts file i into pieces (data/prepare/pieces.py) and
writes piece p's non-empty documents, in order, into part-<i>-<p>-<j>.arrow, one record batch each
(its marker, .done/<i>-<p>.json, lists the shards and their counts). Document d of the file is then
document d - (empty documents before d) - (non-empty documents before the piece) of the piece. A piece
whose count differs from what the text index expects (a text the tokenizer makes no tokens of) is
always tokenized here.
"""

from __future__ import annotations

import bisect
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import numpy as np
import pyarrow as pa

from fms_fsdp.data.prepare.pieces import Piece, cut
from fms_fsdp.data.prepare.shard_writer import finished, marker_path
from fms_fsdp.data.text import BLOCK_DOCS, TextFile, TextIndex, TextSpec

_OPEN_SHARDS = 8  # cache shards kept open (memory-mapped) per file
_UNUSABLE: np.ndarray = np.empty(0, np.int64)  # a finished piece whose count does not match: tokenized here


@dataclass(frozen=True)
class BuildingCache:
    """A raw-text dataset's cache folder while it is built: the build's input number of each of its
    files (by resolved path), the settings its pieces are made with (the build's recipe), and whether
    the cache was complete at the start."""

    folder: str
    inputs: dict[str, int]
    settings: dict
    complete: bool = False

    def open(self, path: Path, index: TextIndex, spec: TextSpec, read_from: Counter) -> "CachedTextFile":
        return CachedTextFile(path, index, spec, self, read_from)


@dataclass(frozen=True)
class CachedDocs:
    """A block's documents, read from the cache (an empty array for an empty document)."""

    docs: list[np.ndarray]


class CachedTextFile(TextFile):
    """A raw text file whose blocks come from its cache once built (counted in `read_from`: documents
    from the "cache", documents "tokenized" here)."""

    def __init__(self, path: Path, index: TextIndex, spec: TextSpec, cache: BuildingCache, read_from: Counter):
        super().__init__(path, index, spec)
        self.cache, self.read_from, self.output = cache, read_from, Path(cache.folder)
        number = cache.inputs[str(path.resolve())]
        self.pieces = cut(number, path, path.stat().st_size, cache.settings["piece_bytes"])
        self.empty = np.asarray(index.empty, np.int64)
        self.firsts = [self._first_document(p) for p in self.pieces] + [self.documents]
        self.first_ranks = self._non_empty_before(np.array(self.firsts, np.int64))  # non-empty ones before each
        self._ready: dict[int, np.ndarray] = {}  # piece -> its shards' first documents (and their end)
        self._shards: OrderedDict[str, pa.RecordBatchFileReader] = OrderedDict()

    def _first_document(self, piece: Piece) -> int:
        """The file's first document (line or row) in `piece`."""
        blocks = self.blocks
        assert blocks is not None  # a text file's blocks: 256 lines, or a Parquet row group
        if not self.jsonl:
            return int(blocks[piece.start]) if piece.end >= 0 else 0
        if piece.end < 0 or piece.start == 0:
            return 0
        k = max(0, bisect.bisect_left(self.offsets, piece.start) - 1)  # the last block begun before the piece
        line, position = k * BLOCK_DOCS, self.offsets[k]
        with self.path.open("rb") as f:
            f.seek(position)
            while position < piece.start:  # lines begun before the piece belong to the one before
                position += len(f.readline())
                line += 1
        return line

    def _non_empty_before(self, documents: np.ndarray) -> np.ndarray:
        return documents - np.searchsorted(self.empty, documents)

    def _shard_starts(self, q: int) -> Optional[np.ndarray]:
        """Piece q's shards' first documents in the piece (and the piece's count at the end), once it
        is finished; None while it is not (asked again next time); _UNUSABLE when its count differs."""
        known = self._ready.get(q)
        if known is not None:
            return known
        piece = self.pieces[q]
        if not marker_path(self.output, piece).exists():
            return None
        marker = finished(self.output, piece, self.cache.settings)  # a DataError: made from another input, recipe
        if marker is None:
            return None
        counts = [s["documents"] for s in marker["shards"]]
        starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self._ready[q] = starts if starts[-1] == self.first_ranks[q + 1] - self.first_ranks[q] else _UNUSABLE
        return self._ready[q]

    def _from_cache(self, lo: int, hi: int) -> Optional[CachedDocs]:
        """Documents [lo, hi) from the cache, when every piece holding them is finished."""
        first, last = (bisect.bisect_right(self.firsts, d) - 1 for d in (lo, hi - 1))
        starts = {q: self._shard_starts(q) for q in range(first, last + 1)}
        if any(s is None or s is _UNUSABLE for s in starts.values()):
            return None
        documents: np.ndarray = np.arange(lo, hi, dtype=np.int64)
        pieces = np.asarray(np.searchsorted(self.firsts, documents, side="right") - 1)
        ranks = self._non_empty_before(documents) - self.first_ranks[pieces]  # in its piece
        is_empty = np.isin(documents, self.empty)
        docs: list[np.ndarray] = []
        for q, k, empty in zip(pieces.tolist(), ranks.tolist(), is_empty.tolist()):
            if empty:
                docs.append(np.empty(0, np.int64))
                continue
            shard_starts = starts[q]
            assert shard_starts is not None
            j = int(np.searchsorted(shard_starts, k, side="right")) - 1
            docs.append(self._document(self.pieces[q], j, k - int(shard_starts[j])))
        return CachedDocs(docs)

    def _document(self, piece: Piece, shard: int, batch: int) -> np.ndarray:
        name = f"part-{piece.name}-{shard:05d}.arrow"
        reader = self._shards.get(name)
        if reader is None:
            reader = pa.ipc.open_file(pa.memory_map(str(self.output / name)))
            if len(self._shards) >= _OPEN_SHARDS:
                self._shards.popitem(last=False)
            self._shards[name] = reader
        else:
            self._shards.move_to_end(name)
        return reader.get_batch(batch).column(0).to_numpy().astype(np.int64)

    def block(self, b: int) -> Union[list[bytes], pa.Array, CachedDocs]:  # type: ignore[override]
        """Block b's documents from the cache where it is built there, else its raw records."""
        assert self.blocks is not None
        cached = self._from_cache(int(self.blocks[b]), int(self.blocks[b + 1]))
        return cached if cached is not None else super().block(b)

    def row(self, block: Union[list[bytes], pa.Array, CachedDocs], r: int) -> np.ndarray:  # type: ignore[override]
        if isinstance(block, CachedDocs):
            self.read_from["cache"] += 1
            return block.docs[r]
        self.read_from["tokenized"] += 1
        return super().row(block, r)

    def close(self) -> None:
        super().close()
        self._shards.clear()
