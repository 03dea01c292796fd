"""Shard files on disk: discovery, validation, document counts (meta/*counts*.csv, computed and cached
once when absent) and zero-copy random access to documents.

Two layouts are read, in Arrow IPC files and Parquet:
- fms-fsdp's: one record batch per document, one token per row in an integer column (Arrow only);
- one row per document, a list-of-integers column (what Hugging Face datasets and pyarrow write).
Arrow files are memory-mapped: a document is a view of the file's pages, never a copy. With
--tokenizer_path, raw text files (JSON lines, Parquet text columns) are read too: data/text.py.
"""

from __future__ import annotations

import csv
import io
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from fms_fsdp.atomic import write_text_atomic
from fms_fsdp.data.sources import Source, absolute, common_folder, matched_files
from fms_fsdp.data.text import JSONL, IndexCache, TextFile, TextIndex, TextSpec, is_jsonl
from fms_fsdp.errors import DataError, first_line
from fms_fsdp.storage import is_remote, location, open_random

EXTENSIONS = {"arrow": (".arrow",), "hf_parquet": (".parquet",), "auto": (".arrow", ".parquet")}
COUNTS_HEADER = ["dataset/filename", "documents", "tokens"]
CACHED_COUNTS = "counts_fms_fsdp_cache.csv"
TEXT_INDEX = "text_index_fms_fsdp_cache.json"
_OPEN_FILES = 128
# record batches / row groups kept at once: a reader reads one block per active shard at a time
DECODED_BLOCKS = 12


@dataclass(frozen=True)
class Layout:
    """Which files a dataset folder holds and how they are read: --file_type, --col_name and, for raw
    text, --tokenizer_path with --text_field (JSON-lines files, and Parquet files without --col_name)."""

    file_type: str
    col_name: str
    text: Optional[TextSpec] = None

    @property
    def extensions(self) -> tuple[str, ...]:
        return EXTENSIONS[self.file_type] + (JSONL if self.text is not None else ())


@dataclass
class FileEntry:
    path: str  # relative to data_path, with a leading slash: /dataset/sub/f.arrow
    documents: int
    tokens: int  # estimated for raw text
    text: Optional[TextIndex] = None  # raw text files: how they are read


class ShardFile:
    """Random access to the documents of one shard file."""

    sequential = False  # blocks can be read in any order

    def __init__(self, path: Path, col_name: str):
        self.path, self.col = path, col_name
        try:
            if path.suffix == ".parquet":
                self._pq = pq.ParquetFile(open_random(path))
                schema = self._pq.schema_arrow
                rows = [self._pq.metadata.row_group(i).num_rows for i in range(self._pq.num_row_groups)]
            else:
                self._pq = None
                self._ipc = pa.ipc.open_file(open_random(path))
                schema = self._ipc.schema
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{path}: not a readable {path.suffix[1:]} shard ({first_line(e)})") from None
        if col_name not in schema.names:
            raise DataError(f"{path}: no column {col_name!r} (columns: {', '.join(schema.names)}); set --col_name")
        self._col_index = schema.get_field_index(col_name)
        ctype = schema.field(col_name).type
        if pa.types.is_integer(ctype) and self._pq is None:
            self.rows_layout = False
            self.documents = self._ipc.num_record_batches
        elif (pa.types.is_list(ctype) or pa.types.is_large_list(ctype)) and pa.types.is_integer(ctype.value_type):
            self.rows_layout = True
            if self._pq is None:
                rows = [self._ipc.get_batch(i).num_rows for i in range(self._ipc.num_record_batches)]
            self._starts = np.concatenate([[0], np.cumsum(rows, dtype=np.int64)])
            self.documents = int(self._starts[-1])
        else:
            raise DataError(
                f"{path}: column {col_name!r} has type {ctype}; expected integers (one record batch "
                "per document, Arrow) or a list of integers (one row per document)"
            )

    @property
    def row_groups(self) -> Optional[np.ndarray]:
        """First document of each Parquet row group (and the end), or None for Arrow files, whose
        documents are read one by one."""
        return self._starts if self._pq is not None else None

    def count_tokens(self) -> int:
        """Tokens in the file (reads every batch's or row group's offsets once)."""
        if not self.rows_layout:
            return sum(self._ipc.get_batch(i).num_rows for i in range(self.documents))
        return sum(int(offsets[-1] - offsets[0]) for _, offsets in map(self.block, range(len(self._starts) - 1)))

    def block_of(self, j: int) -> tuple[int, int]:
        """(record batch or row group, row in it) of document j (rows layout)."""
        block = int(np.searchsorted(self._starts, j, side="right") - 1)
        return block, j - int(self._starts[block])

    def block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(values, offsets) of record batch or row group b (rows layout): views for Arrow, decoded
        for Parquet."""
        if self._pq is not None:
            column = self._pq.read_row_group(b, columns=[self.col]).column(0).combine_chunks()
        else:
            column = self._ipc.get_batch(b).column(self._col_index)
        return column.values.to_numpy(zero_copy_only=False), column.offsets.to_numpy()

    @staticmethod
    def row(block: tuple[np.ndarray, np.ndarray], r: int) -> np.ndarray:
        """Tokens of row r of a block (rows layout)."""
        values, offsets = block
        return values[offsets[r] : offsets[r + 1]]

    def document(self, j: int) -> np.ndarray:
        """Tokens of document j, fms-fsdp's layout (a read-only view of the mapped file)."""
        return self._ipc.get_batch(j).column(self._col_index).to_numpy(zero_copy_only=False)

    def chunks(self, group: int = 1024) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(token values, document lengths) of consecutive documents, the whole file in order: a record
        batch or row group at a time (fms-fsdp's layout: `group` documents at a time)."""
        if self.rows_layout:
            for b in range(len(self._starts) - 1):
                values, offsets = self.block(b)
                yield values[offsets[0] : offsets[-1]], np.diff(offsets).astype(np.int64)
            return
        for start in range(0, self.documents, group):
            docs = [self.document(j) for j in range(start, min(self.documents, start + group))]
            yield np.concatenate(docs), np.array([len(d) for d in docs], dtype=np.int64)


def is_text(path: Path, layout: Layout) -> bool:
    """Whether a file holds raw text: JSON lines, or Parquet without the token column when reading text."""
    if is_jsonl(path):
        return True
    if layout.text is None or path.suffix != ".parquet":
        return False
    try:
        return layout.col_name not in pq.ParquetFile(open_random(path)).schema_arrow.names
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable parquet file ({first_line(e)})") from None


def open_shard(path: Path, entry: FileEntry, layout: Layout) -> Union[ShardFile, TextFile]:
    """A file of a dataset, opened for reading its documents."""
    if entry.text is not None:
        assert layout.text is not None
        return TextFile(path, entry.text, layout.text)
    return ShardFile(path, layout.col_name)


class Dataset:
    """The documents of one dataset folder, addressed by a global index [0, documents)."""

    def __init__(self, name: str, root: Path, entries: list[FileEntry], layout: Layout):
        self.name, self.root, self.entries, self.layout = name, root, entries, layout
        self.starts = np.concatenate([[0], np.cumsum([e.documents for e in entries], dtype=np.int64)])
        self.documents = int(self.starts[-1])
        self.tokens = sum(e.tokens for e in entries)
        self._open: OrderedDict[int, Union[ShardFile, TextFile]] = OrderedDict()
        self._blocks: OrderedDict[tuple[int, int], Any] = OrderedDict()

    def path(self, i: int) -> Path:
        """Where shard file number i is on disk."""
        return self.root / self.entries[i].path.lstrip("/")

    def file(self, i: int) -> Union[ShardFile, TextFile]:
        """Shard file number i, opened on first use (the most recently used stay open)."""
        f = self._open.get(i)
        if f is None:
            f = open_shard(self.path(i), self.entries[i], self.layout)
            if len(self._open) >= _OPEN_FILES:
                _, oldest = self._open.popitem(last=False)
                if isinstance(oldest, TextFile):
                    oldest.close()
            self._open[i] = f
        else:
            self._open.move_to_end(i)
        return f

    def read(self, file: int, j: int) -> np.ndarray:
        """Tokens of document j of file number `file` (a read-only view for Arrow files; tokenized now
        for raw text)."""
        f = self.file(file)
        if not f.rows_layout:
            return f.document(j)
        b, row = f.block_of(j)
        key = (file, b)
        block = self._blocks.get(key)
        if block is None:
            block = f.block(b)
            if len(self._blocks) >= DECODED_BLOCKS:
                self._blocks.popitem(last=False)
            self._blocks[key] = block
        else:
            self._blocks.move_to_end(key)
        return f.row(block, row)

    def __getstate__(self) -> dict:  # open files stay behind when sent to a worker process
        return {**self.__dict__, "_open": OrderedDict(), "_blocks": OrderedDict()}


def list_datasets(
    data_path: str, datasets: Optional[list[str]], flag: str = "data_path", datasets_flag: str = "datasets"
) -> list[str]:
    """The dataset folders to read: `datasets`, or every sub-folder of data_path but meta. Errors name
    the flags the user gave (--data_path and --datasets, or --eval_data_path and --eval_datasets)."""
    root = location(data_path, flag)
    try:  # listed first: object storage says here whether the bucket, the endpoint and the access are right
        found = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name != "meta" and not p.name.startswith("."))
    except (FileNotFoundError, NotADirectoryError):
        if not is_remote(root) and root.is_file():
            raise DataError(f"--{flag}: {data_path} is a file, not a folder of datasets", every_rank=True) from None
        raise DataError(f"--{flag}: folder not found: {data_path}", every_rank=True) from None
    except Exception as e:  # no endpoint, no access, ...
        raise DataError(
            f"--{flag}: cannot read {data_path} ({type(e).__name__}: {first_line(e)})", every_rank=True
        ) from None
    names = datasets or found
    if not names:
        raise DataError(f"--{flag}: {data_path} has no dataset sub-folders", every_rank=True)
    for name in names:
        if not (root / name).is_dir():
            raise DataError(f"--{datasets_flag}: no folder {name!r} in {data_path}", every_rank=True)
    return names


def dataset_sources(
    data_path: str, datasets: Optional[list[str]], flag: str = "data_path", datasets_flag: str = "datasets"
) -> list[Source]:
    """The datasets of --datasets in order (name=patterns: data/sources.py; or a folder under
    data_path, checked by list_datasets), or every sub-folder of data_path."""
    given = datasets or []
    folders = [d for d in given if "=" not in d]
    names = list_datasets(data_path, folders or None, flag, datasets_flag) if folders or not given else []
    result = {name: Source(name, data_path) for name in names}
    for entry in given:
        if "=" not in entry:
            continue
        name, _, text = entry.partition("=")
        name = name.strip()
        patterns = [absolute(p.strip()) for p in text.split("|") if p.strip()]
        if not name or not patterns:
            raise DataError(f"--{datasets_flag}: {entry!r} is not name=pattern|pattern...", every_rank=True)
        result[name] = Source(name, common_folder(patterns, name), tuple(patterns))
    order = [d.partition("=")[0].strip() for d in given] or names
    if len(set(order)) != len(order):
        twice = sorted({n for n in order if order.count(n) > 1})
        raise DataError(f"--{datasets_flag}: {', '.join(twice)} given twice: each dataset once", every_rank=True)
    return [result[name] for name in order]


def read_counts(data_path: str, flag: str = "data_path") -> dict[str, FileEntry]:
    """Entries of every meta/*counts*.csv under data_path (given as --`flag`), by relative path; the
    users' files win over this loader's own cache."""
    entries: dict[str, FileEntry] = {}
    meta = location(data_path, flag) / "meta"
    found = sorted(meta.glob("*counts*.csv") if meta.is_dir() else [], key=lambda p: (p.name == CACHED_COUNTS, p.name))
    for csv_path in found:
        rows = list(csv.reader(io.StringIO(csv_path.read_text())))
        if not rows or [h.strip() for h in rows[0]] != COUNTS_HEADER:
            raise DataError(f"{csv_path}: expected the header {','.join(COUNTS_HEADER)}")
        for row in rows[1:]:
            try:
                path = "/" + row[0].strip().lstrip("/")
                entries.setdefault(path, FileEntry(path, int(row[1]), int(row[2])))
            except (IndexError, ValueError):
                raise DataError(f"{csv_path}: bad row {','.join(row)!r}") from None
    return entries


def write_counts(path: Path, entries: list[FileEntry]) -> None:
    """Write a counts CSV atomically; one that already says the same is left untouched (and none to
    object storage: caches are local only)."""
    if is_remote(path):
        return
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(COUNTS_HEADER)
    writer.writerows([e.path, e.documents, e.tokens] for e in entries)
    if path.is_file() and path.read_text() == text.getvalue():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text.getvalue())


def shard_paths(folder: Path, file_type: str, extensions: Optional[tuple[str, ...]] = None) -> list[Path]:
    """The shard files under a dataset folder, sorted; hidden files and folders (temporary files of a
    preparation in progress) are not shards."""
    extensions = extensions or EXTENSIONS[file_type]
    files = sorted(
        {
            p
            for ext in extensions
            for p in folder.rglob(f"*{ext}")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
        }
    )
    if not files:
        hint = "" if JSONL[0] in extensions else "; raw text (.jsonl, .jsonl.gz, .json.gz) needs --tokenizer_path"
        raise DataError(
            f"{folder}: no {' or '.join(extensions)} files (--file_type={file_type}){hint}", every_rank=True
        )
    return files


def scan(
    sources: list[Source], layout: Layout, flag: str = "data_path", datasets_flag: str = "datasets"
) -> dict[str, list[FileEntry]]:
    """Every shard of every dataset (a folder under --`flag`, or the files of its patterns) with its
    counts: validated by opening each file; counts from <root>/meta/*counts*.csv where listed and right,
    computed otherwise and cached in meta/. Raw text files are indexed (cached in meta/ too); their bad
    records are reported, by file."""
    result: dict[str, list[FileEntry]] = {}
    roots = {s.root for s in sources}
    for data_path in sorted(roots):
        result.update(_scan_root(data_path, [s for s in sources if s.root == data_path], layout, flag, datasets_flag))
    return result


def _scan_root(
    data_path: str, sources: list[Source], layout: Layout, flag: str, datasets_flag: str
) -> dict[str, list[FileEntry]]:
    """scan() of the datasets whose files are under one root (its counts and text indexes are there)."""
    root = location(data_path, flag)
    known = read_counts(data_path, flag)
    texts = None if layout.text is None else IndexCache(root / "meta" / TEXT_INDEX, layout.text)
    result: dict[str, list[FileEntry]] = {}
    computed = False
    for source in sources:
        name = source.name
        if source.patterns:
            files = matched_files(source, layout.extensions, datasets_flag)
        else:
            files = shard_paths(root / name, layout.file_type, layout.extensions)
        entries = []
        for path in files:
            rel = "/" + path.relative_to(root).as_posix()
            if is_text(path, layout):
                if texts is None:
                    raise DataError(f"{path}: raw text needs --tokenizer_path (a Hugging Face tokenizer)")
                index = texts.get(rel, path)
                entries.append(FileEntry(rel, index.documents, index.tokens, index))
                if index.bad:
                    reasons = ", ".join(
                        f"{why} {n}" + (f", first at {index.first_bad[why]}" if why in index.first_bad else "")
                        for why, n in sorted(index.bad.items())
                    )
                    print(f"note: {path}: {sum(index.bad.values())} bad records skipped ({reasons})", flush=True)
                continue
            shard = ShardFile(path, layout.col_name)
            entry = known.get(rel)
            if entry is None or entry.documents != shard.documents:
                entry, computed = FileEntry(rel, shard.documents, shard.count_tokens()), True
            entries.append(entry)
        if sum(e.documents for e in entries) == 0:
            raise DataError(f"{root / name if not source.patterns else name}: the dataset has no documents")
        result[name] = entries
    if texts is not None:
        texts.save()
    if computed:
        try:
            write_counts(root / "meta" / CACHED_COUNTS, [e for es in result.values() for e in es if e.text is None])
        except OSError:
            pass  # a read-only data folder: counts are recomputed next time
    return result
