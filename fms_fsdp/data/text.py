"""Raw text read on the fly: JSON-lines files (.jsonl, .jsonl.gz, .json.gz) and Parquet text columns,
tokenized document by document in the loader workers with a Hugging Face tokenizer (`tokenizers`,
loaded offline, special tokens never added: the loader frames documents with --bos_token/--eos_token).

Rank 0 indexes each text file once at start-up (cached in the run's data cache: data/data_cache_dir.py, keyed by the file's size
and mtime, --text_field and the tokenizer): its documents (one per line or row), the byte offset of
every BLOCK_DOCS-th line of a plain .jsonl file, its bad records by reason, and its tokens, estimated
from its first documents. A block of a plain .jsonl file is read by seeking to its offset; a gzipped
file cannot seek, so its blocks are read in file order from streams that only move forward (a logical
shard holding one reads all its blocks in file order, and shuffles the documents inside each); a Parquet file's
blocks are its row groups. A bad record (not JSON, no text field, not UTF-8, empty) is an empty
document, which the loader skips.
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import json
import os
import zlib
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from fms_fsdp.data.data_cache_dir import write_cached
from fms_fsdp.data.file_reader import Reader
from fms_fsdp.errors import ConfigError, DataError, first_line
from fms_fsdp.storage import mtime_ns, open_random

JSONL = (".jsonl", ".jsonl.gz", ".json.gz")
BLOCK_DOCS = 256  # documents per block of a JSON-lines file
_SAMPLE_BYTES = 32768  # text tokenized per file (its first documents) to estimate its tokens
_STREAMS = 8  # open forward-only streams per gzipped file
INDEX_VERSION = 3


@dataclass(frozen=True)
class TextSpec:
    """How raw text becomes tokens: --tokenizer_path and --text_field."""

    tokenizer_path: str
    text_field: str


@dataclass
class TextIndex:
    """What rank 0 learned of a text file at start-up."""

    documents: int
    tokens: int  # estimated from the first documents
    offsets: list[int] = field(default_factory=list)  # byte offset of each block (plain .jsonl only)
    bad: dict[str, int] = field(default_factory=dict)  # skipped records by reason
    first_bad: dict[str, str] = field(default_factory=dict)  # where each reason's first one is ("line 12")
    empty: list[int] = field(default_factory=list)  # its empty documents (bad records, blank lines), in order


# ---------------------------------------------------------------- records


def check_text(text: object, text_field: str) -> tuple[Optional[str], Optional[str]]:
    """(text, None) for a usable string, else (None, why not)."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            return None, "invalid UTF-8"
    if text is None:
        return None, f"missing {text_field!r}"
    if not isinstance(text, str):
        return None, f"{text_field!r} is not a string"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a \ud800-style escape
        return None, "invalid UTF-8"
    return (text, None) if text else (None, "empty text")


def parse_line(line: bytes, text_field: str) -> tuple[Optional[str], Optional[str]]:
    """The text of one JSON line as (text, None), or (None, why it is skipped)."""
    try:
        record = json.loads(line.removeprefix(codecs.BOM_UTF8).decode("utf-8"))
    except UnicodeDecodeError:
        return None, "invalid UTF-8"
    except json.JSONDecodeError:
        return None, "invalid JSON"
    if not isinstance(record, dict):
        return None, "not a JSON object"
    return check_text(record.get(text_field), text_field)


def open_binary(path: Path) -> Any:
    """A JSON-lines file opened for reading bytes, gunzipped on the fly when its name ends in .gz."""
    raw = path.open("rb")
    if not is_gzip(path):
        return raw
    stream = gzip.GzipFile(fileobj=raw, mode="rb")
    stream.myfileobj = raw  # closed with the stream, as when gzip.open opens the file itself
    return stream


def is_gzip(path: Path) -> bool:
    """A gzipped file: read as a stream, it cannot seek."""
    return path.name.lower().endswith(".gz")


def is_jsonl(path: Union[Path, str]) -> bool:
    return str(path).lower().endswith(JSONL)


# ---------------------------------------------------------------- tokenizer


def tokenizer_json(spec: str, flag: str) -> Path:
    """The tokenizer.json named by a flag: the file itself or a folder holding one."""
    path = Path(spec)
    path = path if path.is_file() else path / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"--{flag}={spec}: no tokenizer.json there (give a Hugging Face tokenizer folder or file)")
    return path


@lru_cache(maxsize=4)
def load_tokenizer(spec: str, flag: str = "tokenizer_path") -> Any:
    """A `tokenizers.Tokenizer` (one per process and path). In the loader workers each tokenizes on one
    thread: parallelism comes from the workers (TOKENIZERS_PARALLELISM, when set, wins)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError(f"--{flag} needs the tokenizers package: pip install tokenizers") from None
    path = tokenizer_json(spec, flag)
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for a bad file
        raise ConfigError(f"--{flag}: cannot load {path} ({first_line(e)})") from None


def tokenizer_fingerprint(spec: str) -> str:
    return hashlib.sha256(tokenizer_json(spec, "tokenizer_path").read_bytes()).hexdigest()[:16]


def encode(tokenizer: Any, text: str) -> np.ndarray:
    """Token ids of a text, without the tokenizer's special tokens."""
    return np.array(tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)


def added_tokens(tokenizer: Any) -> tuple[list[int], list[int]]:
    """(ids the tokenizer puts before a text, ids it appends) when asked for its special tokens, which
    the loader never asks for: it frames documents itself, with exactly one --eos_token each."""
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    full = tokenizer.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start], full[start + len(plain) :]
    return [], []


# ---------------------------------------------------------------- index


def index_file(path: Path, spec: TextSpec) -> TextIndex:
    """Read a text file once: documents, block offsets, bad records, estimated tokens. A file that cannot
    be read at all is a DataError naming it."""
    tokenizer = load_tokenizer(spec.tokenizer_path)
    try:
        return _index_jsonl(path, spec, tokenizer) if is_jsonl(path) else _index_parquet(path, spec, tokenizer)
    except (OSError, EOFError, zlib.error, pa.ArrowException) as e:
        raise DataError(f"{path}: cannot read it ({first_line(e)}); fix or remove this file") from None


class _Tally:
    """While a file is indexed: its bad records by reason, and the text its tokens are estimated from."""

    def __init__(self) -> None:
        self.bad: Counter[str] = Counter()
        self.first_bad: dict[str, str] = {}
        self.sample: list[str] = []
        self.sample_bytes = self.text_bytes = self.records = 0
        self.empty: list[int] = []

    def add(self, text: Optional[str], reason: Optional[str], size: int, where: str, document: int) -> None:
        self.records += 1
        if text is None:
            self.empty.append(document)
            assert reason is not None
            self.bad[reason] += 1
            self.first_bad.setdefault(reason, where)
            return
        self.text_bytes += size
        if self.sample_bytes < _SAMPLE_BYTES:
            self.sample.append(text)
            self.sample_bytes += size

    def index(self, path: Path, documents: int, offsets: list[int], spec: TextSpec, tokenizer: Any) -> TextIndex:
        """The file's index (documents: its lines or rows, blank lines included); a DataError when no
        record has text (often a wrong --text_field)."""
        if self.bad and sum(self.bad.values()) == self.records:
            reasons = ", ".join(f"{why} {n}" for why, n in self.bad.most_common())
            raise DataError(
                f"{path}: none of its {self.records} records has text ({reasons}); check --text_field "
                f"(now {spec.text_field!r}) and the file"
            )
        tokens = sum(len(t) for t in tokenizer.encode_batch(self.sample, add_special_tokens=False))
        estimate = round(tokens * self.text_bytes / self.sample_bytes) if self.sample_bytes else 0
        return TextIndex(documents, estimate, offsets, dict(self.bad), self.first_bad, self.empty)


def _index_jsonl(path: Path, spec: TextSpec, tokenizer: Any) -> TextIndex:
    offsets, tally, offset, documents = [], _Tally(), 0, 0
    with open_binary(path) as f:
        for line in f:
            if documents % BLOCK_DOCS == 0:
                offsets.append(offset)
            documents, offset = documents + 1, offset + len(line)
            if line.strip():  # blank lines are no records (but empty documents)
                tally.add(*parse_line(line, spec.text_field), len(line), f"line {documents}", documents - 1)
            else:
                tally.empty.append(documents - 1)
    return tally.index(path, documents, [] if is_gzip(path) else offsets, spec, tokenizer)


def text_column(pf: pq.ParquetFile, path: Path, text_field: str) -> None:
    """Refuse a Parquet file without a text column named --text_field."""
    schema = pf.schema_arrow
    if text_field not in schema.names:
        raise DataError(
            f"{path}: no column {text_field!r} (columns: {', '.join(schema.names)}); set --text_field "
            "(raw text) or --col_name (token ids)"
        )
    ctype = schema.field(text_field).type
    if not any(
        check(ctype)
        for check in (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary, pa.types.is_large_binary)
    ):
        raise DataError(f"{path}: column {text_field!r} has type {ctype}, not text; set --text_field")


def _index_parquet(path: Path, spec: TextSpec, tokenizer: Any) -> TextIndex:
    pf = pq.ParquetFile(open_random(path))
    text_column(pf, path, spec.text_field)
    tally, row = _Tally(), 0
    for g in range(pf.num_row_groups):
        for value in pf.read_row_group(g, columns=[spec.text_field]).column(0).to_pylist():
            text, reason = check_text(value, spec.text_field)
            tally.add(text, reason, len(text or ""), f"row {row}", row)
            row += 1
    return tally.index(path, pf.metadata.num_rows, [], spec, tokenizer)


class IndexCache:
    """text_index_fms_fsdp_cache.json in the run's data cache (data/data_cache_dir.py; None: none): text indexes of
    earlier start-ups, valid while the file's size and mtime, --text_field and the tokenizer are the same."""

    def __init__(self, path: Optional[Path], spec: TextSpec):
        self.path, self.spec = path, spec
        self.key = {"text_field": spec.text_field, "tokenizer": tokenizer_fingerprint(spec.tokenizer_path)}
        try:
            data = json.loads(path.read_text()) if path is not None else {}
            self.files: dict[str, dict] = data["files"] if data.get("version") == INDEX_VERSION else {}
        except (OSError, ValueError, KeyError, TypeError):
            self.files = {}
        self.changed = False

    def get(self, rel: str, path: Path) -> TextIndex:
        """The index of file `path` (rel: its name under data_path), from the cache or read now."""
        key = {**self.key, "size": path.stat().st_size, "mtime_ns": mtime_ns(path)}
        known = self.files.get(rel)
        if known is not None and all(known.get(k) == v for k, v in key.items()):
            return TextIndex(
                known["documents"], known["tokens"], known["offsets"], known["bad"], known["first_bad"], known["empty"]
            )
        if not self.changed:
            where = f"once: cached in {self.path}" if self.path is not None else "not cached"
            print(f"note: indexing raw text files ({where})", flush=True)
        index = index_file(path, self.spec)
        self.files[rel] = {
            **key,
            "documents": index.documents,
            "tokens": index.tokens,
            "offsets": index.offsets,
            "bad": index.bad,
            "first_bad": index.first_bad,
            "empty": index.empty,
        }
        self.changed = True
        return index

    def save(self) -> Optional[str]:
        """Write the cache whole or not at all (data/data_cache_dir.py): None, or why it could not be written (the
        files are indexed again next time)."""
        if not self.changed or self.path is None:
            return None
        text = json.dumps({"version": INDEX_VERSION, "files": self.files})
        return write_cached(self.path, lambda f: f.write(text.encode()))


# ---------------------------------------------------------------- reading


class TextFile(Reader):
    """Random access, by blocks, to the documents of one text file, as token ids."""

    kind = "raw text"

    def __init__(self, path: Path, index: TextIndex, spec: TextSpec):
        self.path, self.spec, self.documents = path, spec, index.documents
        self.offsets = index.offsets
        self.jsonl = is_jsonl(path)
        self.sequential = is_gzip(path)
        if self.jsonl:
            self.blocks = np.append(np.arange(0, index.documents, BLOCK_DOCS), index.documents).astype(np.int64)
        else:
            self._pq = pq.ParquetFile(open_random(path))
            rows = [self._pq.metadata.row_group(i).num_rows for i in range(self._pq.num_row_groups)]
            self.blocks = np.concatenate([[0], np.cumsum(rows, dtype=np.int64)])
        self._streams: list[tuple[int, Any]] = []  # (next line, gzip stream), most recently used last
        self._tokenizer = load_tokenizer(spec.tokenizer_path)

    def block(self, b: int) -> Union[list[bytes], pa.Array]:
        """The raw records of block b: lines of a JSON-lines file, or a Parquet row group's text column."""
        if not self.jsonl:
            return self._pq.read_row_group(b, columns=[self.spec.text_field]).column(0).combine_chunks()
        first, n = int(self.blocks[b]), int(self.blocks[b + 1] - self.blocks[b])
        try:
            if self.sequential:
                return self._read_forward(first, n)
            with self.path.open("rb") as f:
                f.seek(self.offsets[b])
                return [f.readline() for _ in range(n)]
        except (OSError, EOFError, zlib.error) as e:
            raise DataError(f"{self.path}: cannot read it ({first_line(e)})") from None

    def _read_forward(self, first: int, n: int) -> list[bytes]:
        """n lines from line `first` of a gzipped file: from the open stream furthest along that has not
        passed it, or a new one."""
        behind = [k for k, (line, _) in enumerate(self._streams) if line <= first]
        if behind:
            line, stream = self._streams.pop(max(behind, key=lambda k: self._streams[k][0]))
        else:
            if len(self._streams) >= _STREAMS:
                self._streams.pop(0)[1].close()
            line, stream = 0, open_binary(self.path)
        try:
            for _ in range(first - line):
                stream.readline()
            lines = [stream.readline() for _ in range(n)]
        except BaseException:
            stream.close()
            raise
        self._streams.append((first + n, stream))
        return lines

    def close(self) -> None:
        """Close the gzip streams (when the file leaves the reader's open files)."""
        for _, stream in self._streams:
            stream.close()
        self._streams.clear()

    def row(self, block: Union[list[bytes], pa.Array], r: int) -> np.ndarray:
        """Token ids of record r of a block; none for a bad record or a blank line."""
        if self.jsonl:
            line = block[r]
            text = parse_line(line, self.spec.text_field)[0] if line.strip() else None
        else:
            text = check_text(block[r].as_py(), self.spec.text_field)[0]
        return encode(self._tokenizer, text) if text else np.empty(0, np.int64)
