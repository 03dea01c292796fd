"""The files of a dataset folder: discovery, recognition of each file's layout, validation, document
counts (meta/*counts*.csv, computed and cached once when absent) and random access to documents.

Each layout is one small reader class with one interface (data/file_reader.py), recognised by the files'
names and first bytes, so a folder needs no flag and one run may mix layouts:
- Arrow (data/arrow.py): fms-fsdp's one record batch per document; one row per document with a
  list-of-integers column, in IPC files or in the stream files Hugging Face `datasets` writes
  (`save_to_disk` folders, cache files); Parquet, one row per document;
- Megatron's indexed datasets, `.bin` + `.idx` (data/megatron.py);
- OLMo's and Dolma's token arrays, `.npy` (data/token_arrays.py);
- with --tokenizer_path, raw text (data/text.py).
What a first start learns of each file is cached (data/data_cache_dir.py).
"""

from __future__ import annotations

import csv
import io
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from fms_fsdp.atomic import write_text_if_changed
from fms_fsdp.data.arrow import ArrowDocs, ArrowRows, ParquetRows, arrow_reader
from fms_fsdp.data.data_cache_dir import IN_DATA, Index, IndexStore, cache_folder, load_index, write_cached
from fms_fsdp.data.file_reader import Options, Reader
from fms_fsdp.data.megatron import MegatronFile, idx_path
from fms_fsdp.data.sources import Source, absolute, common_folder, matched_files
from fms_fsdp.data.text import JSONL, IndexCache, TextFile, TextIndex, TextSpec, is_jsonl
from fms_fsdp.data.token_arrays import TokenArray
from fms_fsdp.errors import DataError, first_line
from fms_fsdp.storage import is_remote, location, open_random

EXTENSIONS = {
    "arrow": (".arrow",),
    "hf_parquet": (".parquet",),
    "megatron": (".bin", ".idx"),
    "numpy": (".npy",),
}
EXTENSIONS["auto"] = tuple(e for k in ("arrow", "hf_parquet", "megatron", "numpy") for e in EXTENSIONS[k])
READERS: dict[str, type[Reader]] = {
    r.__name__: r for r in (ArrowDocs, ArrowRows, ParquetRows, MegatronFile, TokenArray, TextFile)
}
COUNTS_HEADER = ["dataset/filename", "documents", "tokens"]
CACHED_COUNTS = "counts_fms_fsdp_cache.csv"
TEXT_INDEX = "text_index_fms_fsdp_cache.json"
_OPEN_FILES = 128
# decoded blocks (Parquet row groups, text) kept at once: a reader reads one block per active shard at a time
DECODED_BLOCKS = 12


@dataclass(frozen=True)
class Layout:
    """How a run reads its dataset folders: --file_type (which files), the token files' options
    (--col_name, --token_dtype, --eos_token, the vocabulary), for raw text --tokenizer_path with
    --text_field (JSON-lines files, and Parquet files without the token column), and the cache folder
    (data/data_cache_dir.py; None: no cache)."""

    file_type: str
    options: Options = Options()
    text: Optional[TextSpec] = None
    cache_dir: Optional[str] = None

    @property
    def col_name(self) -> str:
        return self.options.col_name

    @property
    def extensions(self) -> tuple[str, ...]:
        return EXTENSIONS[self.file_type] + (JSONL if self.text is not None else ())


@dataclass
class FileEntry:
    path: str  # relative to data_path, with a leading slash as in counts CSVs: /dataset/sub/f.arrow
    documents: int
    tokens: int  # estimated for raw text
    text: Optional[TextIndex] = None  # raw text files: how they are read
    reader: str = ""  # the name of its reader class (READERS); empty: told from the file when opened
    index: Index = None  # its reader's index (data/data_cache_dir.py)


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


def reader_of(path: Path, options: Options) -> type[Reader]:
    """The reader class of a token file, by its name and, for Arrow, its first bytes and column."""
    suffix = path.suffix.lower()
    if suffix == ".arrow":
        return arrow_reader(path, options)
    if suffix == ".parquet":
        return ParquetRows
    if suffix in (".bin", ".idx"):
        return MegatronFile
    if suffix == ".npy":
        return TokenArray
    raise DataError(f"{path}: not a file this loader reads ({', '.join(EXTENSIONS['auto'])} or raw text)")


def open_shard(path: Path, entry: FileEntry, layout: Layout) -> Reader:
    """A file of a dataset, opened for reading its documents."""
    if entry.text is not None:
        assert layout.text is not None
        return TextFile(path, entry.text, layout.text)
    reader = READERS[entry.reader] if entry.reader else reader_of(path, layout.options)
    return reader(path, layout.options, load_index(entry.index))


class Dataset:
    """The documents of one dataset folder, addressed by a global index [0, documents). Raw text whose
    --cache_dir is being built (`building`, data/text_cache.py) is read from the cache where it is built,
    counted in `read_from`."""

    def __init__(self, name: str, root: Path, entries: list[FileEntry], layout: Layout, building: Optional[Any] = None):
        self.name, self.root, self.entries, self.layout = name, root, entries, layout
        self.building = building  # a data.text_cache.BuildingCache
        self.read_from: Counter[str] = Counter()
        self.starts = np.concatenate([[0], np.cumsum([e.documents for e in entries], dtype=np.int64)])
        self.documents = int(self.starts[-1])
        self.tokens = sum(e.tokens for e in entries)
        self._open: OrderedDict[int, Reader] = OrderedDict()
        self._blocks: OrderedDict[tuple[int, int], Any] = OrderedDict()

    def path(self, i: int) -> Path:
        """Where shard file number i is on disk."""
        return self.root / self.entries[i].path.lstrip("/")

    def file(self, i: int) -> Reader:
        """Shard file number i, opened on first use (the most recently used stay open)."""
        f = self._open.get(i)
        if f is None:
            entry = self.entries[i]
            if self.building is not None and entry.text is not None and self.layout.text is not None:
                f = self.building.open(self.path(i), entry.text, self.layout.text, self.read_from)
            else:
                f = open_shard(self.path(i), entry, self.layout)
            if len(self._open) >= _OPEN_FILES:
                self._open.popitem(last=False)[1].close()
            self._open[i] = f
        else:
            self._open.move_to_end(i)
        return f

    def read(self, file: int, j: int) -> np.ndarray:
        """Tokens of document j of file number `file` (a read-only view where the layout allows; decoded
        by block for Parquet, tokenized now for raw text)."""
        f = self.file(file)
        if f.blocks is None:
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


def read_counts(data_path: str, flag: str = "data_path", cache: Optional[Path] = None) -> dict[str, FileEntry]:
    """Entries of every meta/*counts*.csv under data_path (given as --`flag`), by relative path; the
    users' files win over this loader's own caches (there and in the `cache` folder)."""
    entries: dict[str, FileEntry] = {}
    meta = location(data_path, flag) / "meta"
    found = sorted(meta.glob("*counts*.csv") if meta.is_dir() else [], key=lambda p: (p.name == CACHED_COUNTS, p.name))
    if cache is not None and (cache / CACHED_COUNTS).is_file():
        found.append(cache / CACHED_COUNTS)
    for csv_path in found:
        try:
            for entry in _counts_of(csv_path):
                entries.setdefault(entry.path, entry)
        except DataError:
            if csv_path.name != CACHED_COUNTS:  # the loader's own, damaged, is counted again and rewritten
                raise
    return entries


def _counts_of(csv_path: Path) -> list[FileEntry]:
    """The entries of one counts CSV (a DataError naming it when it is not one)."""
    try:
        rows = list(csv.reader(io.StringIO(csv_path.read_text())))
    except UnicodeDecodeError:
        rows = []
    if not rows or [h.strip() for h in rows[0]] != COUNTS_HEADER:
        raise DataError(f"{csv_path}: expected the header {','.join(COUNTS_HEADER)}")
    result = []
    for row in rows[1:]:
        try:
            path = "/" + row[0].strip().lstrip("/")
            result.append(FileEntry(path, int(row[1]), int(row[2])))
        except (IndexError, ValueError):
            raise DataError(f"{csv_path}: bad row {','.join(row)!r}") from None
    return result


def counts_text(entries: list[FileEntry]) -> str:
    """A counts CSV of the entries."""
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(COUNTS_HEADER)
    writer.writerows([e.path, e.documents, e.tokens] for e in entries)
    return text.getvalue()


def write_counts(path: Path, entries: list[FileEntry]) -> None:
    """Write a counts CSV whole or not at all (renamed into place; in object storage one upload); one
    that already says the same is left untouched."""
    if not is_remote(path):
        path.parent.mkdir(parents=True, exist_ok=True)
    write_text_if_changed(path, counts_text(entries))


def pair_megatron(files: list[Path]) -> list[Path]:
    """A dataset's files with each Megatron .bin/.idx pair as its .bin; a lone .idx or .bin is a
    DataError naming it."""
    names = set(files)
    for f in files:
        other = idx_path(f) if f.suffix == ".bin" else f.with_suffix(".bin") if f.suffix == ".idx" else None
        if other is not None and other not in names:
            raise DataError(
                f"{f}: no {other.name} beside it (a Megatron dataset is a .bin and .idx pair)", every_rank=True
            )
    return [f for f in files if f.suffix != ".idx"]


def shard_paths(folder: Path, file_type: str, extensions: Optional[tuple[str, ...]] = None) -> list[Path]:
    """The shard files under a dataset folder, sorted (a Megatron pair as its .bin); hidden files and
    folders (temporary files of a preparation in progress) are not shards."""
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
    return pair_megatron(files)


def dataset_files(
    source: Source, layout: Layout, flag: str = "data_path", datasets_flag: str = "datasets"
) -> list[Path]:
    """The files of a dataset: its folder's, or those its patterns match."""
    if source.patterns:
        return pair_megatron(matched_files(source, layout.extensions, datasets_flag))
    return shard_paths(location(source.root, flag) / source.name, layout.file_type, layout.extensions)


def scan(
    sources: list[Source], layout: Layout, flag: str = "data_path", datasets_flag: str = "datasets"
) -> dict[str, list[FileEntry]]:
    """Every shard of every dataset (a folder under --`flag`, or the files of its patterns) with its
    counts: validated by opening each file; counts from <root>/meta/*counts*.csv where listed and right,
    computed otherwise and cached (data/data_cache_dir.py), as are the readers' indexes. Raw text files are
    indexed (cached too); their bad records are reported, by file."""
    result: dict[str, list[FileEntry]] = {}
    roots = {s.root for s in sources}
    for data_path in sorted(roots):
        result.update(_scan_root(data_path, [s for s in sources if s.root == data_path], layout, flag, datasets_flag))
    return result


class _RootScan:
    """scan() of the datasets whose files are under one root: its counts, indexes and notes."""

    def __init__(self, data_path: str, layout: Layout, flag: str):
        self.root, self.layout = location(data_path, flag), layout
        self.cache = cache_folder(data_path, layout.cache_dir)
        self.known = read_counts(data_path, flag, self.cache)
        self.indexes = IndexStore(self.cache)
        self.texts = None
        if layout.text is not None:
            self.texts = IndexCache(None if self.cache is None else self.cache / TEXT_INDEX, layout.text)
        self.computed = False
        self.said: set[tuple[str, str]] = set()

    def text_entry(self, path: Path, rel: str) -> FileEntry:
        if self.texts is None:
            raise DataError(f"{path}: raw text needs --tokenizer_path (a Hugging Face tokenizer)")
        index = self.texts.get(rel, path)
        if index.bad:
            reasons = ", ".join(
                f"{why} {n}" + (f", first at {index.first_bad[why]}" if why in index.first_bad else "")
                for why, n in sorted(index.bad.items())
            )
            print(f"note: {path}: {sum(index.bad.values())} bad records skipped ({reasons})", flush=True)
        return FileEntry(rel, index.documents, index.tokens, index, TextFile.__name__)

    def entry(self, path: Path, rel: str, dataset: str) -> FileEntry:
        """A token file's entry: its reader, its index (cached), its counts (listed or computed)."""
        options = self.layout.options
        kind = reader_of(path, options)
        index = self.indexes.get(rel, path, kind, options)
        shard = kind(path, options, load_index(index))
        if shard.picked is not None and (dataset, shard.picked) not in self.said:
            self.said.add((dataset, shard.picked))
            print(
                f"note: {dataset}: no {options.col_name!r} column; reading its list-of-integers column "
                f"{shard.picked!r} (set --col_name to choose another)",
                flush=True,
            )
        entry = self.known.get(rel)
        if entry is None or entry.documents != shard.documents:
            entry, self.computed = FileEntry(rel, shard.documents, shard.count_tokens()), True
        shard.close()
        return FileEntry(rel, entry.documents, entry.tokens, None, kind.__name__, index)

    def save(self, result: dict[str, list[FileEntry]]) -> None:
        failure = self.indexes.failure
        if self.texts is not None:
            failure = self.texts.save() or failure
        if self.computed and self.cache is not None:
            text = counts_text([e for es in result.values() for e in es if e.text is None]).encode()
            failure = write_cached(self.cache / CACHED_COUNTS, lambda f: f.write(text)) or failure
        if failure is not None and self.layout.cache_dir != IN_DATA:  # meta/ is skipped where read-only
            print(
                f"note: cannot write the data cache in {self.cache} ({failure}): the files are counted and "
                "indexed again at every start; set --data_cache_dir to a folder this run can write",
                flush=True,
            )


def _scan_root(
    data_path: str, sources: list[Source], layout: Layout, flag: str, datasets_flag: str
) -> dict[str, list[FileEntry]]:
    """scan() of the datasets whose files are under one root."""
    run = _RootScan(data_path, layout, flag)
    result: dict[str, list[FileEntry]] = {}
    for source in sources:
        name = source.name
        files = dataset_files(source, layout, flag, datasets_flag)
        entries = []
        for path in files:
            rel = "/" + path.relative_to(run.root).as_posix()
            entries.append(run.text_entry(path, rel) if is_text(path, layout) else run.entry(path, rel, name))
        if sum(e.documents for e in entries) == 0:
            raise DataError(f"{run.root / name if not source.patterns else name}: the dataset has no documents")
        result[name] = entries
    run.save(result)
    return result
