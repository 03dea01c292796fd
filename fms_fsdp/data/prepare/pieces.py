"""The input of `fms-prepare-data` cut into pieces, and the records of each.

A piece is a unit of work whose output depends on its bytes alone: a whole file, or a part of a large
one (a run of a Parquet file's row groups; a byte range of an uncompressed JSON-lines file, holding the
lines that begin in it). The cut depends only on the files and --piece_bytes, never on the engine or
the number of workers or tasks, so every engine writes the same shards. Gzipped and plain text files
cannot be cut: one piece each.
"""

from __future__ import annotations

import codecs
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from fms_fsdp.data.text import check_text, is_gzip, open_binary, parse_line, text_column
from fms_fsdp.errors import DataError, first_line
from fms_fsdp.storage import open_random

EXTENSIONS = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet", ".txt", ".md")
Record = tuple[int, Optional[str], Optional[str]]  # (line or row, text, reason it is skipped)


@dataclass(frozen=True)
class Piece:
    """Part `part` of input file `index`: bytes [start, end) of a JSON-lines file, row groups
    [start, end) of a Parquet file, or the whole file (end = -1); `size`: its input bytes."""

    index: int
    part: int
    path: Path
    start: int = 0
    end: int = -1
    size: int = 0

    @property
    def name(self) -> str:
        return f"{self.index:05d}-{self.part:05d}"


def is_supported(path: Path) -> bool:
    return path.name.lower().endswith(EXTENSIONS)


def is_parquet(path: Path) -> bool:
    return path.name.lower().endswith(".parquet")


def is_splittable_jsonl(path: Path) -> bool:
    return path.name.lower().endswith((".jsonl", ".json")) and not is_gzip(path)


def cut(index: int, path: Path, size: int, piece_bytes: int) -> list[Piece]:
    """The pieces of one input file of `size` bytes."""
    if is_parquet(path):
        return _cut_parquet(index, path, piece_bytes)
    if is_splittable_jsonl(path) and size > piece_bytes:
        n = -(-size // piece_bytes)
        ends = [(p * piece_bytes, min(size, (p + 1) * piece_bytes)) for p in range(n)]
        return [Piece(index, p, path, start, end, end - start) for p, (start, end) in enumerate(ends)]
    return [Piece(index, 0, path, size=size)]


def _cut_parquet(index: int, path: Path, piece_bytes: int) -> list[Piece]:
    """Runs of consecutive row groups of about piece_bytes (compressed) each."""
    try:
        meta = pq.ParquetFile(open_random(path)).metadata
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{path}: cannot read it as Parquet ({first_line(e)}); fix or remove this input file") from None
    pieces: list[Piece] = []
    start = size = 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        size += sum(group.column(c).total_compressed_size for c in range(group.num_columns))
        if size >= piece_bytes or g == meta.num_row_groups - 1:
            pieces.append(Piece(index, len(pieces), path, start, g + 1, size))
            start, size = g + 1, 0
    return pieces or [Piece(index, 0, path, 0, 0)]


# ---------------------------------------------------------------- records


def records(piece: Piece, text_field: str) -> Iterator[Record]:
    """(line or row, text, None) for each document of a piece, (line, None, reason) for a bad one; a
    file that cannot be read is a DataError naming it."""
    path = piece.path
    name = path.name.lower()
    try:
        if is_parquet(path):
            yield from _parquet(piece, text_field)
        elif name.endswith((".txt", ".md")):
            yield from _plain_text(path, text_field)
        elif piece.end >= 0:
            yield from _jsonl_range(piece, text_field)
        else:
            yield from _jsonl(path, text_field)
    except (OSError, EOFError, zlib.error, pa.ArrowException) as e:
        raise DataError(f"{path}: cannot read it ({first_line(e)}); fix or remove this input file") from None


def _jsonl(path: Path, text_field: str) -> Iterator[Record]:
    """Records of a whole JSON-lines file (gzipped or not); blank lines are ignored."""
    with open_binary(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                yield n, *parse_line(line, text_field)


def _jsonl_range(piece: Piece, text_field: str) -> Iterator[Record]:
    """The lines of a JSON-lines file that begin in bytes [start, end), numbered from 1 in the piece (the
    report adds the lines of the pieces before); a blank line is (n, None, None)."""
    with piece.path.open("rb") as f:
        position = piece.start
        if piece.start > 0:
            f.seek(piece.start - 1)
            position += len(f.readline()) - 1  # the rest of a line begun before the piece
        n = 0
        while position < piece.end:
            line = f.readline()
            if not line:
                return
            n += 1
            yield (n, *parse_line(line, text_field)) if line.strip() else (n, None, None)
            position += len(line)


def _parquet(piece: Piece, text_field: str) -> Iterator[Record]:
    """Records of the text_field column of the piece's row groups (numbered by row in the file)."""
    pf = pq.ParquetFile(open_random(piece.path))
    text_column(pf, piece.path, text_field)
    end = pf.num_row_groups if piece.end < 0 else piece.end
    n = sum(pf.metadata.row_group(g).num_rows for g in range(piece.start))
    for g in range(piece.start, end):
        for value in pf.read_row_group(g, columns=[text_field]).column(0).to_pylist():
            n += 1
            yield n, *check_text(value, text_field)


def _plain_text(path: Path, text_field: str) -> Iterator[Record]:
    """A plain text file: one document."""
    data = path.read_bytes().removeprefix(codecs.BOM_UTF8)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        yield data.count(b"\n", 0, e.start) + 1, None, "invalid UTF-8"
        return
    yield 1, *check_text(text, text_field)
