"""The interface every data file's reader implements, one small class per layout (data/arrow.py,
data/megatron.py, data/token_arrays.py, data/text.py), and what they share.

A reader gives the documents of one file by index, [0, documents):
- `document(j)`: its tokens, a read-only view of the file's pages where the layout allows;
- `blocks`: None when any document can be read at any time, else the first document of each block
  (and the end) of a layout that decodes a block at a time (Parquet row groups, text): the loader
  plans and caches whole blocks (`block(b)`, `row(block, r)`);
- `sequential`: blocks can only be read in file order (gzipped text);
- `chunks()`: consecutive (token values, document lengths) over the whole file, for counting and
  `fms-inspect-data`.

What a reader learns by reading a whole file once (an Arrow stream's record-batch offsets, a token
array's document boundaries) is its `index`: `index_of(path, options)` computes it (and checks the
file, raising DataError naming it), the loader caches it beside the counts (data/data_cache_dir.py), and the
reader is then built from it without reading the file again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Iterator, Optional

import numpy as np
import pyarrow as pa

from fms_fsdp.storage import is_remote, open_random

TOKEN_DTYPES = ("auto", "uint8", "uint16", "uint32", "uint64")


@dataclass(frozen=True)
class Options:
    """What the flags say about reading token files: --col_name, --token_dtype, --eos_token (where
    token arrays' documents end) and the vocabulary (ids are checked against it; it picks the dtype of
    headerless token arrays)."""

    col_name: str = "tokens"
    token_dtype: str = "auto"
    eos: int = 0
    vocab_size: Optional[int] = None


class Reader:
    """Random access to the documents of one file (see the module's docstring)."""

    kind: ClassVar[str] = ""  # the layout's name, as the docs and errors say it
    blocks: Optional[np.ndarray] = None
    sequential = False
    documents: int = 0
    picked: Optional[str] = None  # the column read when --col_name's was not there (said once at start-up)

    def __init__(self, path: Path, options: Options, index: Optional[np.ndarray] = None):
        """Open the file (its index: what index_of computed, or None to compute it now); DataError
        naming the file when it cannot be read as this layout."""
        self.path = path

    @classmethod
    def index_of(cls, path: Path, options: Options) -> Optional[np.ndarray]:
        """What reading the whole file once tells (None: the layout needs nothing beyond its own header)."""
        return None

    @classmethod
    def index_key(cls, options: Options) -> str:
        """What index_of's result depends on beyond the file itself."""
        return ""

    def document(self, j: int) -> np.ndarray:
        raise NotImplementedError

    def block(self, b: int) -> Any:  # layouts with blocks
        raise NotImplementedError

    def row(self, block: Any, r: int) -> np.ndarray:  # layouts with blocks
        raise NotImplementedError

    def block_of(self, j: int) -> tuple[int, int]:
        """(block, row in it) of document j (layouts with blocks)."""
        assert self.blocks is not None
        b = int(np.searchsorted(self.blocks, j, side="right") - 1)
        return b, j - int(self.blocks[b])

    def chunks(self, group: int = 1024) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(token values, document lengths) of consecutive documents, `group` at a time."""
        for start in range(0, self.documents, group):
            docs = [self.document(j) for j in range(start, min(self.documents, start + group))]
            yield (np.concatenate(docs) if docs else np.empty(0, np.int64)), np.array([len(d) for d in docs], np.int64)

    def count_tokens(self) -> int:
        return sum(int(lengths.sum()) for _, lengths in self.chunks())

    def close(self) -> None:
        """Release what the reader holds open (when it leaves the loader's open files)."""


class Bytes:
    """A file's bytes for random reads: memory-mapped when local (arrays are zero-copy views of the
    page cache), read by ranges when remote (object storage)."""

    def __init__(self, path: Path):
        self.path = path
        self._file = open_random(path)
        self.remote = is_remote(path)
        self.size = path.stat().st_size if not self.remote else self._file.size
        self._buffer = None if self.remote else self._file.read_buffer()

    def array(self, dtype: np.dtype, offset: int, count: int) -> np.ndarray:
        """`count` items of `dtype` from byte `offset` (read-only)."""
        if count <= 0:
            return np.empty(0, dtype)
        if self._buffer is not None:
            return np.frombuffer(self._buffer, dtype=dtype, count=count, offset=offset)
        self._file.seek(offset)
        return np.frombuffer(self._file.read(count * np.dtype(dtype).itemsize), dtype=dtype)

    def reader(self, offset: int = 0) -> "pa.NativeFile":
        """A pyarrow file positioned at byte `offset` (zero-copy slices of the mapping when local)."""
        if self._buffer is not None:
            return pa.BufferReader(self._buffer.slice(offset))
        self._file.seek(offset)
        return pa.PythonFile(self._file, mode="r")

    def head(self, n: int) -> bytes:
        return self.array(np.dtype(np.uint8), 0, min(n, self.size)).tobytes()

    def close(self) -> None:
        self._buffer = None
        self._file.close()
