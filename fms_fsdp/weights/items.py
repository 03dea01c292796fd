"""A checkpoint folder's tensors read a run of rows at a time, straight from the byte ranges of the data
files where DCP stored them: a reader holds the rows it asked for and nothing more (DCP's own read
loads a stored item whole, then copies it into its target: twice the item in memory).

DCP stores each chunk of a tensor (one per rank that saved a part of it) as a torch.save archive at a
byte range of a data file (.metadata's storage_data). The archive keeps the chunk's bytes uncompressed
and contiguous, so rows [a, b) of a chunk are one byte range of the file, found once per chunk from
the archive's zip directory. A chunk stored otherwise (another byte order, a strided layout) is loaded
whole, as DCP would; a folder whose items DCP transformed (compressed) is read by DCP (reader.py).
"""

from __future__ import annotations

import io
import math
import struct
import sys
import zipfile
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp

_LOCAL_HEADER = 30  # bytes of a zip entry's local header before its name and extra field


class ItemRows:
    """Rows of the tensors of one checkpoint folder (by their DCP names), read by byte ranges."""

    def __init__(self, folder: Path, checkpoint: dcp.Metadata):
        self.folder, self.storage, self.metadata = folder, checkpoint.storage_data, checkpoint.state_dict_metadata
        self.places: dict[tuple[str, tuple[int, ...]], Optional[int]] = {}

    def rows(self, name: str, a: int, b: int) -> torch.Tensor:
        """Rows [a, b) of tensor `name` (elements, for a 1-D tensor), from the chunks that hold them."""
        meta = self.metadata[name]
        size, dtype = tuple(meta.size), meta.properties.dtype
        if not size:
            return self._load(name, meta.chunks[0].offsets)
        out: Optional[torch.Tensor] = None
        for chunk in meta.chunks:
            start, sizes = chunk.offsets[0], tuple(chunk.sizes)
            lo, hi = max(a, start), min(b, start + sizes[0])
            if lo >= hi:
                continue
            part = self._chunk_rows(name, tuple(chunk.offsets), sizes, dtype, lo - start, hi - start)
            if lo == a and hi == b and sizes[1:] == size[1:]:
                return part  # one chunk holds every column of these rows
            if out is None:
                out = torch.empty((b - a, *size[1:]), dtype=dtype)
            columns = tuple(slice(o, o + n) for o, n in zip(chunk.offsets[1:], sizes[1:]))
            out[(slice(lo - a, hi - a), *columns)] = part
        assert out is not None, f"{name}: no chunk holds rows [{a}, {b})"
        return out

    def _chunk_rows(
        self, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...], dtype: torch.dtype, a: int, b: int
    ) -> torch.Tensor:
        """Rows [a, b) of one stored chunk: one byte range, or sliced from the chunk loaded whole."""
        at = self._place(name, offsets, sizes, dtype)
        if at is None:
            return self._load(name, offsets)[a:b]
        info = self.storage[dcp.metadata.MetadataIndex(name, offsets)]
        with (self.folder / info.relative_path).open("rb") as f:
            out = read_rows(f, at, sizes[1:], dtype, a, b)
        if out is None:
            raise EOFError(f"{self.folder / info.relative_path} ends inside {name}")
        return out

    def _place(self, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...], dtype: torch.dtype) -> Optional[int]:
        """Where a chunk's bytes start in its data file, when they are stored plainly (else None)."""
        key = (name, offsets)
        if key not in self.places:
            info = self.storage[dcp.metadata.MetadataIndex(name, offsets)]
            start = None
            if sys.byteorder == "little":  # the file's bytes are the tensor's as they are
                with (self.folder / info.relative_path).open("rb") as f:
                    start = _data_start(_Window(f, info.offset, info.length), sizes, dtype)
            self.places[key] = None if start is None else info.offset + start
        return self.places[key]

    def _load(self, name: str, offsets: tuple[int, ...]) -> torch.Tensor:
        info = self.storage[dcp.metadata.MetadataIndex(name, offsets)]
        with (self.folder / info.relative_path).open("rb") as f:
            return torch.load(_Window(f, info.offset, info.length), map_location="cpu", weights_only=True)


def read_rows(f: Any, start: int, row: tuple[int, ...], dtype: torch.dtype, a: int, b: int) -> Optional[torch.Tensor]:
    """Rows [a, b) of a row-major tensor whose bytes begin at `start` of the open file `f` (a local or an
    object-storage file), each row of shape `row`: one read into a fresh tensor; None when the file ends first."""
    out = torch.empty((b - a, *row), dtype=dtype)
    if out.numel():
        f.seek(start + a * math.prod(row) * dtype.itemsize)
        buffer = memoryview(out.view(-1).view(torch.uint8).numpy())
        if f.readinto(buffer) != len(buffer):
            return None
    return out


def _data_start(item: "_Window", sizes: tuple[int, ...], dtype: torch.dtype) -> Optional[int]:
    """The offset in `item` (one torch.save archive) of its tensor's bytes, when it holds one contiguous,
    little-endian tensor of `sizes` and `dtype` from its storage's first byte; else None."""
    with torch.serialization.skip_data():  # the tensor's layout, without reading its bytes
        layout = torch.load(item, map_location="meta", weights_only=True)
    if (
        not isinstance(layout, torch.Tensor)
        or tuple(layout.shape) != sizes
        or layout.dtype != dtype
        or layout.storage_offset() != 0
        or not layout.is_contiguous()
    ):
        return None
    item.seek(0)
    with zipfile.ZipFile(item) as archive:
        names = archive.namelist()
        storages = [n for n in names if n.split("/", 1)[-1].startswith("data/")]
        order = [n for n in names if n.endswith("/byteorder")]
        if len(storages) != 1 or (order and archive.read(order[0]) != b"little"):
            return None
        entry = archive.getinfo(storages[0])
    if entry.compress_type != zipfile.ZIP_STORED or entry.file_size != math.prod(sizes) * dtype.itemsize:
        return None
    item.seek(entry.header_offset)
    header = item.read(_LOCAL_HEADER)
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    return entry.header_offset + _LOCAL_HEADER + name_length + extra_length


class _Window(io.RawIOBase):
    """Bytes [start, start + length) of an open file, as a file of their own (one stored item)."""

    def __init__(self, f: Any, start: int, length: int):
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self.pos = pos + (0, self.pos, self.length)[whence]
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self.length - self.pos))
        self.f.seek(self.start + self.pos)
        got = self.f.readinto(memoryview(buffer).cast("B")[:n])
        self.pos += got
        return got
