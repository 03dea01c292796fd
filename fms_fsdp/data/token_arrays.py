"""OLMo's and Dolma's token arrays (data/file_reader.py's interface): `.npy` files holding every document's
tokens one after the other, as OLMo's numpy datasets read them.

- Dolma and OLMo write them as raw memory maps without a header (`np.memmap(..., mode="w+")`), named
  `.npy` all the same. Their dtype is not in the file: --token_dtype, or by OLMo's rule uint16 when the
  vocabulary fits (ids < 65536), else uint32.
- A real `.npy` (`np.save`, recognised by numpy's magic bytes) carries its dtype in its header.

A document ends at each --eos_token (which it includes; trailing tokens after the last make one more).
Where Dolma's metadata sits beside the array (`<name>.csv.gz`, one `start,end,...` row per document,
token offsets), its offsets are the documents instead. Finding the documents reads the file once; the
boundaries are the file's index, cached with the counts, and two dtype mistakes are refused on the
way: ids read at twice their width show as ids beyond the vocabulary, and ids read at half their
width (uint32 read as uint16, which OLMo's rule does for a vocabulary of up to 65,536) leave every
other token 0 (`halves_of_wider_ids`).
"""

from __future__ import annotations

import csv
import gzip
import io
from pathlib import Path
from typing import Optional

import numpy as np

from fms_fsdp.data.file_reader import Bytes, Options, Reader
from fms_fsdp.errors import DataError, first_line

NPY_MAGIC = b"\x93NUMPY"
_SCAN = 1 << 26  # tokens read at a time while finding documents
WIDER_MIN_TOKENS = 64  # below this many tokens a file is not judged for ids read at half their width


def olmo_dtype(options: Options) -> np.dtype:
    """--token_dtype, or OLMo's rule: uint16 when every id of the vocabulary fits, else uint32."""
    if options.token_dtype != "auto":
        return np.dtype(options.token_dtype)
    vocab = options.vocab_size or 0
    return np.dtype(np.uint16 if vocab <= 1 << 16 else np.uint32)


def halves_of_wider_ids(zeros: np.ndarray, tokens: int) -> bool:
    """Whether ids of twice the width were read as two tokens each: `zeros` counts the zero ids at
    even and at odd positions. Little-endian ids below 2**(8 x itemsize) read that way leave every
    high half 0, so the zeros of one parity are all its tokens while the other parity's are few. Real
    data with many separators (id 0) has zeros at both parities alike, and is not refused."""
    if tokens < WIDER_MIN_TOKENS:
        return False
    per_parity = np.array([(tokens + 1) // 2, tokens // 2])
    share = zeros / per_parity
    return bool(share.max() == 1.0 and share.min() < 0.5)


def metadata_path(path: Path) -> Path:
    """Dolma's per-array metadata: <name>.csv.gz beside <name>.npy."""
    return path.with_suffix(".csv.gz")


def _layout(data: Bytes, path: Path, options: Options) -> tuple[np.dtype, int, int, str]:
    """(dtype, first byte of the tokens, tokens, how the dtype was chosen) of an array file."""
    head = data.head(65536)
    if head.startswith(NPY_MAGIC):
        try:
            stream = io.BytesIO(head)
            version = np.lib.format.read_magic(stream)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _, dtype = read(stream)
        except ValueError as e:
            raise DataError(f"{path}: a .npy header numpy cannot read ({first_line(e)})") from None
        if len(shape) != 1 or dtype.kind not in "ui":
            raise DataError(f"{path}: a .npy of shape {shape} and dtype {dtype}; expected one row of integer token ids")
        return dtype, stream.tell(), int(shape[0]), f"{dtype.name} from its .npy header"
    dtype = olmo_dtype(options)
    how = "--token_dtype" if options.token_dtype != "auto" else f"OLMo's rule for --vocab_size={options.vocab_size}"
    if data.size % dtype.itemsize:
        raise DataError(
            f"{path}: {data.size} bytes is not a whole number of {dtype.name} tokens ({how}); set --token_dtype "
            "to the dtype the file was written with"
        )
    return dtype, 0, data.size // dtype.itemsize, f"{dtype.name} by {how}"


def _metadata_bounds(meta: Path, tokens: int) -> np.ndarray:
    """Document boundaries from Dolma's metadata rows (start,end,... token offsets)."""
    starts, ends = [], []
    try:
        with meta.open("rb") as raw, gzip.open(raw, "rt", newline="") as f:
            for row in csv.reader(f):
                if row and row[0].strip().isdigit():
                    starts.append(int(row[0]))
                    ends.append(int(row[1]))
    except (OSError, EOFError, ValueError, IndexError) as e:
        raise DataError(f"{meta}: cannot read Dolma's metadata ({first_line(e)})") from None
    bounds = np.array([0, *ends], np.int64)
    if (
        not starts
        or np.any(np.array(starts, np.int64) != bounds[:-1])
        or np.any(np.diff(bounds) < 0)
        or bounds[-1] != tokens
    ):
        raise DataError(
            f"{meta}: its document offsets do not tile the {tokens} tokens of {meta.name.removesuffix('.csv.gz')}.npy"
        )
    return bounds


class TokenArray(Reader):
    """A token array file; document j is tokens [bounds[j], bounds[j + 1]), a view of the mapped file."""

    kind = "token array (OLMo, Dolma)"

    def __init__(self, path: Path, options: Options, index: Optional[np.ndarray] = None):
        self.path = path
        try:
            self._data = Bytes(path)
        except OSError as e:
            raise DataError(f"{path}: cannot read it ({first_line(e)})") from None
        self.dtype, self._offset, self.tokens, self.how = _layout(self._data, path, options)
        bounds = self.index_of(path, options) if index is None else index
        assert bounds is not None
        self._bounds, self.documents = bounds, len(bounds) - 1

    @classmethod
    def index_key(cls, options: Options) -> str:
        return f"{options.token_dtype}|{options.eos}|{options.vocab_size}"

    @classmethod
    def index_of(cls, path: Path, options: Options) -> Optional[np.ndarray]:
        """The documents' boundaries (Dolma's metadata, else after every --eos_token); each id is checked
        against the vocabulary."""
        data = Bytes(path)
        try:
            dtype, offset, tokens, how = _layout(data, path, options)
            ends: list[np.ndarray] = []
            top = -1
            zeros: np.ndarray = np.zeros(2, np.int64)  # zero ids at even and at odd positions
            for start in range(0, tokens, _SCAN):  # _SCAN is even: a chunk's positions keep their parity
                chunk = data.array(dtype, offset + start * dtype.itemsize, min(_SCAN, tokens - start))
                ends.append(np.flatnonzero(chunk == options.eos) + start + 1)
                top = max(top, int(chunk.max()))
                zeros += [np.count_nonzero(chunk[0::2] == 0), np.count_nonzero(chunk[1::2] == 0)]
        finally:
            data.close()
        if options.vocab_size is not None and top >= options.vocab_size:
            raise DataError(
                f"{path}: token id {top} >= vocab_size {options.vocab_size} (read as {how}); the dtype is probably "
                "wrong: set --token_dtype, or --vocab_size"
            )
        if offset == 0 and dtype.itemsize < 8 and halves_of_wider_ids(zeros, tokens):  # not a .npy's own header
            wider = np.dtype(f"uint{dtype.itemsize * 16}")
            raise DataError(
                f"{path}: every other token is 0 read as {how}: these are {wider.name} ids read as {dtype.name}; "
                f"set --token_dtype={wider.name}"
            )
        meta = metadata_path(path)
        if meta.is_file():
            return _metadata_bounds(meta, tokens)
        found = np.concatenate([np.zeros(1, np.int64), *ends]).astype(np.int64)
        return found if found[-1] == tokens else np.append(found, tokens)

    def document(self, j: int) -> np.ndarray:
        lo, hi = int(self._bounds[j]), int(self._bounds[j + 1])
        return self._data.array(self.dtype, self._offset + lo * self.dtype.itemsize, hi - lo)

    def count_tokens(self) -> int:
        return self.tokens

    def close(self) -> None:
        self._data.close()
