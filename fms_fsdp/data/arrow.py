"""Arrow and Parquet shards (data/file_reader.py's interface):
- `ArrowDocs`: fms-fsdp's layout, one record batch per document, one token per row of an integer column;
- `ArrowRows`: one row per document, a list-of-integers column (Hugging Face `datasets`, pyarrow);
- `ParquetRows`: the same in Parquet, read a row group at a time.

Arrow files come in two formats, told apart by their first bytes: the IPC *file* format (`ARROW1`,
a footer lists the record batches) and the *stream* format, which `datasets` writes (`save_to_disk`
folders, cache files) and which has no footer. A stream is read with random access all the same: its
messages are walked once (`index_of`), and the byte offset and rows of every record batch are cached
with the counts; a batch is then parsed in place from the memory-mapped file, zero-copy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from fms_fsdp.data.file_reader import Bytes, Options, Reader
from fms_fsdp.errors import DataError, first_line
from fms_fsdp.storage import open_random

FILE_MAGIC = b"ARROW1"
_STREAM_END = b"\xff\xff\xff\xff\x00\x00\x00\x00"
_BATCHES_KEPT = 4  # record batches of a file kept parsed at once (views: no copy)


def _is_token_list(t: pa.DataType) -> bool:
    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type)


def pick_column(schema: pa.Schema, options: Options, path: Path) -> tuple[str, Optional[str]]:
    """(column to read, the column picked when --col_name's default `tokens` is absent): `input_ids`
    (what `datasets` tokenizers write, beside `attention_mask`), else the only list-of-integers column;
    a DataError naming the file otherwise."""
    if options.col_name in schema.names:
        return options.col_name, None
    lists = [f.name for f in schema if _is_token_list(f.type)]
    if options.col_name == "tokens" and lists:
        if "input_ids" in lists:
            return "input_ids", "input_ids"
        if len(lists) == 1:
            return lists[0], lists[0]
    raise DataError(f"{path}: no column {options.col_name!r} (columns: {', '.join(schema.names)}); set --col_name")


class _Batches:
    """The record batches of an Arrow IPC file or stream, by number, parsed from the mapped file."""

    def __init__(self, path: Path, index: Optional[np.ndarray]):
        self.path = path
        try:
            self._bytes = Bytes(path)
            self._file = None
            if self._bytes.head(len(FILE_MAGIC)) == FILE_MAGIC:
                self._file = open_random(path)
                self._ipc: Optional[pa.ipc.RecordBatchFileReader] = pa.ipc.open_file(self._file)
                self.schema, self.count = self._ipc.schema, self._ipc.num_record_batches
            else:
                self._ipc = None
                self.schema = pa.ipc.read_schema(self._message(0))
                self.offsets = stream_index(path)[:, 0] if index is None else index[:, 0]
                self.count = len(self.offsets)
        except (pa.ArrowException, OSError, EOFError) as e:  # EOFError: an empty or cut-off stream
            raise DataError(f"{path}: not a readable arrow shard ({first_line(e)})") from None

    def _message(self, offset: int) -> pa.ipc.Message:
        return pa.ipc.read_message(self._bytes.reader(offset))

    def get(self, b: int) -> pa.RecordBatch:
        if self._ipc is not None:
            return self._ipc.get_batch(b)
        return pa.ipc.read_record_batch(self._message(int(self.offsets[b])), self.schema)

    def close(self) -> None:
        """Release the mapping and the IPC reader's file (batches already read stay valid)."""
        self._ipc = None
        if self._file is not None:
            self._file.close()
        self._bytes.close()


def stream_index(path: Path) -> np.ndarray:
    """[byte offset, rows] of every record batch of an Arrow stream (or [-1, rows] of an IPC file's),
    read once; a stream cut off midway is a DataError naming the file."""
    source = Bytes(path)
    rows: list[list[int]] = []
    try:
        if source.head(len(FILE_MAGIC)) == FILE_MAGIC:
            with open_random(path) as f:
                reader = pa.ipc.open_file(f)
                rows = [[-1, reader.get_batch(b).num_rows] for b in range(reader.num_record_batches)]
            return np.array(rows, np.int64).reshape(-1, 2)
        stream = source.reader()
        messages = pa.ipc.MessageReader.open_stream(stream)
        schema = pa.ipc.read_schema(messages.read_next_message())
        while True:
            at = stream.tell()
            try:
                message = messages.read_next_message()
            except StopIteration:
                break
            except (pa.ArrowException, OSError):  # a message whose body the file does not hold
                break
            if message.type == "record batch":
                rows.append([at, pa.ipc.read_record_batch(message, schema).num_rows])
        end, ended = stream.tell(), source.size >= 8 and source.array(np.dtype(np.uint8), source.size - 8, 8).tobytes()
    except (pa.ArrowException, OSError, StopIteration) as e:
        raise DataError(f"{path}: not a readable arrow shard ({first_line(e) or 'no schema'})") from None
    finally:
        source.close()
    if end != source.size or ended != _STREAM_END:
        raise DataError(
            f"{path}: the Arrow stream is cut off midway (after {len(rows)} complete record batches, at byte "
            f"{end} of {source.size}); write the file again"
        )
    return np.array(rows, np.int64).reshape(-1, 2)


class ArrowDocs(Reader):
    """fms-fsdp's layout: document j is record batch j's integer column (a view of the mapped file)."""

    kind = "Arrow, one record batch per document"

    def __init__(self, path: Path, options: Options, index: Optional[np.ndarray] = None):
        self.path, self._batches = path, _Batches(path, index)
        self._col = self._batches.schema.get_field_index(pick_column(self._batches.schema, options, path)[0])
        self.documents = self._batches.count
        self._rows = None if index is None else index[:, 1]

    @classmethod
    def index_of(cls, path: Path, options: Options) -> Optional[np.ndarray]:
        """A stream's batch offsets (an IPC file lists its batches itself)."""
        with path.open("rb") as f:
            if f.read(len(FILE_MAGIC)) == FILE_MAGIC:
                return None
        return stream_index(path)

    def document(self, j: int) -> np.ndarray:
        return self._batches.get(j).column(self._col).to_numpy(zero_copy_only=False)

    def count_tokens(self) -> int:
        if self._rows is not None:
            return int(self._rows.sum())
        return sum(self._batches.get(b).num_rows for b in range(self.documents))

    def close(self) -> None:
        self._batches.close()


class ArrowRows(Reader):
    """One row per document, a list-of-integers column, in an Arrow IPC file or stream: document j is a
    slice of its record batch's values (a view of the mapped file)."""

    kind = "Arrow, one row per document"

    def __init__(self, path: Path, options: Options, index: Optional[np.ndarray] = None):
        self.path = path
        index = stream_index(path) if index is None else index
        self._batches = _Batches(path, index)
        name, self.picked = pick_column(self._batches.schema, options, path)
        self._col = self._batches.schema.get_field_index(name)
        self._starts = np.concatenate([[0], np.cumsum(index[:, 1])]).astype(np.int64)
        self.documents = int(self._starts[-1])
        self._kept: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    @classmethod
    def index_of(cls, path: Path, options: Options) -> Optional[np.ndarray]:
        return stream_index(path)

    def _batch(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        kept = self._kept.get(b)
        if kept is None:
            column = self._batches.get(b).column(self._col)
            kept = column.values.to_numpy(zero_copy_only=False), column.offsets.to_numpy()
            if len(self._kept) >= _BATCHES_KEPT:
                self._kept.pop(next(iter(self._kept)))
            self._kept[b] = kept
        return kept

    def document(self, j: int) -> np.ndarray:
        b = int(np.searchsorted(self._starts, j, side="right") - 1)
        values, offsets = self._batch(b)
        r = j - int(self._starts[b])
        return values[offsets[r] : offsets[r + 1]]

    def chunks(self, group: int = 1024) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for b in range(len(self._starts) - 1):
            values, offsets = self._batch(b)
            yield values[offsets[0] : offsets[-1]], np.diff(offsets).astype(np.int64)

    def close(self) -> None:
        self._kept.clear()
        self._batches.close()


class ParquetRows(Reader):
    """One row per document, a list-of-integers column, in Parquet: read a row group (block) at a time."""

    kind = "Parquet, one row per document"

    def __init__(self, path: Path, options: Options, index: Optional[np.ndarray] = None):
        self.path = path
        try:
            self._pq = pq.ParquetFile(open_random(path))
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{path}: not a readable parquet shard ({first_line(e)})") from None
        schema = self._pq.schema_arrow
        self.col, self.picked = pick_column(schema, options, path)
        if not _is_token_list(schema.field(self.col).type):
            raise DataError(
                f"{path}: column {self.col!r} has type {schema.field(self.col).type}; expected a list of integers "
                "(one row per document)"
            )
        rows = [self._pq.metadata.row_group(i).num_rows for i in range(self._pq.num_row_groups)]
        self.groups = np.concatenate([[0], np.cumsum(rows, dtype=np.int64)]).astype(np.int64)
        self.blocks, self.documents = self.groups, int(self.groups[-1])

    def block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(values, offsets) of row group b, decoded."""
        column = self._pq.read_row_group(b, columns=[self.col]).column(0).combine_chunks()
        return column.values.to_numpy(zero_copy_only=False), column.offsets.to_numpy()

    def row(self, block: tuple[np.ndarray, np.ndarray], r: int) -> np.ndarray:
        values, offsets = block
        return values[offsets[r] : offsets[r + 1]]

    def chunks(self, group: int = 1024) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for b in range(len(self.groups) - 1):
            values, offsets = self.block(b)
            yield values[offsets[0] : offsets[-1]], np.diff(offsets).astype(np.int64)


def arrow_reader(path: Path, options: Options) -> type[Reader]:
    """Which of the two Arrow layouts a file holds, by its column's type (a DataError otherwise)."""
    batches = _Batches(path, np.zeros((0, 2), np.int64))
    schema = batches.schema
    batches.close()
    name, _ = pick_column(schema, options, path)
    ctype = schema.field(name).type
    if pa.types.is_integer(ctype):
        return ArrowDocs
    if _is_token_list(ctype):
        return ArrowRows
    raise DataError(
        f"{path}: column {name!r} has type {ctype}; expected integers (one record batch per document) or a "
        "list of integers (one row per document)"
    )
