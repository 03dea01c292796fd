"""Megatron-LM's indexed datasets (also NeMo's and GPT-NeoX's), `<prefix>.bin` + `<prefix>.idx` as
Megatron's `tools/preprocess_data.py` writes them, read in place (data/file_reader.py's interface).

The `.idx` holds, little-endian: the magic `MMIDIDX\\0\\0`, a version (1), a dtype code, the number of
sequences S and of document indices D, then S int32 sequence lengths, S int64 byte pointers into the
`.bin`, and D int64 document indices (document d is sequences [idx[d], idx[d + 1]); with
--split-sentences a document has several). Both files are memory-mapped; a document is a zero-copy
view of the `.bin`, its sequences joined (they are contiguous).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Optional

import numpy as np

from fms_fsdp.data.file_reader import Bytes, Options, Reader
from fms_fsdp.errors import DataError, first_line

MAGIC = b"MMIDIDX\x00\x00"
# Megatron's DType codes, every one it writes
DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_HEADER = len(MAGIC) + 8 + 1 + 8 + 8
_CHECK_CHUNK = 1 << 22  # sequences whose offsets are checked at a time


def idx_path(bin_path: Path) -> Path:
    return bin_path.with_suffix(".idx")


class MegatronFile(Reader):
    """A `.bin`/`.idx` pair, named by its `.bin`."""

    kind = "Megatron indexed dataset"

    def __init__(self, path: Path, options: Options, index: Optional[np.ndarray] = None):
        self.path, idx = path, idx_path(path)
        for have, other in ((path, idx), (idx, path)):
            if not other.is_file():
                raise DataError(f"{have}: no {other.name} beside it (a Megatron dataset is a .bin and .idx pair)")
        try:
            self._idx, self._bin = Bytes(idx), Bytes(path)
        except OSError as e:
            raise DataError(f"{path}: cannot read it ({first_line(e)})") from None
        self._read_index(idx)
        self._check_bin()

    def _read_index(self, idx: Path) -> None:
        head = self._idx.head(_HEADER)
        if len(head) < _HEADER or head[: len(MAGIC)] != MAGIC:
            raise DataError(f"{idx}: not a Megatron index (no MMIDIDX header)")
        version, code, sequences, documents = struct.unpack("<QBQQ", head[len(MAGIC) :])
        if version != 1:
            raise DataError(f"{idx}: Megatron index version {version}, this reader knows version 1")
        if code not in DTYPES:
            known = ", ".join(f"{k} ({np.dtype(v).name})" for k, v in DTYPES.items())
            raise DataError(f"{idx}: unknown Megatron dtype code {code} (known: {known})")
        self.dtype = np.dtype(DTYPES[code])
        need = _HEADER + sequences * 12 + documents * 8
        if self._idx.size < need or documents < 1:
            raise DataError(f"{idx}: cut off: {self._idx.size} bytes, its header says {need}")
        self._lengths = self._idx.array(np.dtype("<i4"), _HEADER, sequences)
        self._pointers = self._idx.array(np.dtype("<i8"), _HEADER + sequences * 4, sequences)
        self._doc_index = self._idx.array(np.dtype("<i8"), _HEADER + sequences * 12, documents)
        self.sequences, self.documents = sequences, documents - 1

    def _span(self, j: int) -> tuple[int, int]:
        """(byte offset, tokens) of document j in the .bin."""
        first, end = int(self._doc_index[j]), int(self._doc_index[j + 1])
        if end <= first:
            return 0, 0
        last = end - 1
        stop = int(self._pointers[last]) + int(self._lengths[last]) * self.dtype.itemsize
        return int(self._pointers[first]), (stop - int(self._pointers[first])) // self.dtype.itemsize

    def _check_bin(self) -> None:
        if self.sequences == 0:
            return
        self._check_offsets()
        last = self.sequences - 1
        need = int(self._pointers[last]) + int(self._lengths[last]) * self.dtype.itemsize
        if self._bin.size < need:
            raise DataError(
                f"{self.path}: {self._bin.size} bytes, shorter than its .idx says ({need}); the .bin is cut off "
                "or belongs to another .idx"
            )

    def _check_offsets(self) -> None:
        """The .idx's byte offsets step by its dtype's size times each sequence's tokens (read a chunk at a
        time: an index may hold hundreds of millions of sequences); DataError where they do not."""
        for start in range(0, self.sequences - 1, _CHECK_CHUNK):
            end = min(start + _CHECK_CHUNK, self.sequences - 1)
            steps = np.diff(self._pointers[start : end + 1])
            tokens: np.ndarray = self._lengths[start:end].astype(np.int64)
            wrong = np.flatnonzero(steps != tokens * self.dtype.itemsize)
            if len(wrong):
                j = int(wrong[0])
                code = next(k for k, v in DTYPES.items() if np.dtype(v) == self.dtype)
                raise DataError(
                    f"{idx_path(self.path)}: its dtype is {self.dtype.name} (code {code}), but its documents' byte "
                    f"offsets step by {int(steps[j]) / max(int(tokens[j]), 1):g} bytes a token; the .idx does not "
                    "describe this .bin"
                )

    def document(self, j: int) -> np.ndarray:
        offset, count = self._span(j)
        return self._bin.array(self.dtype, offset, count)

    def count_tokens(self) -> int:
        return int(self._lengths.sum(dtype=np.int64))

    def close(self) -> None:
        self._idx.close()
        self._bin.close()
