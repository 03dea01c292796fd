"""Tokenize raw text into the Arrow shards the training loader reads (IBM fms-fsdp's layout).
Run as scripts/prepare_data.py or, installed, `fms-prepare-data`:

    python scripts/prepare_data.py --input=raw/ --output=/data/my_dataset --tokenizer=/models/llama3
    python scripts/prepare_data.py --input='raw/*.jsonl.gz' --output=/data/web --tokenizer=byte \
        --text_field=content --shard_tokens=50_000_000 --workers=8

Input file i (in sorted order) becomes <output>/part-<i>-<j>.arrow, j = 0, 1, ...: Arrow IPC files with one
uint32 column `tokens` and one record batch per document. Every file is written under a temporary name and
renamed into place when complete; <output>/.done/<i>.json marks input i as finished, so a re-run skips
finished inputs and redoes the others from scratch. Bad records (invalid JSON or UTF-8, no text, empty
text) are skipped, counted and reported as file:line (the row number for Parquet); they never stop the run.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import json
import os
import sys
import zlib
from collections import Counter
from multiprocessing import Pool
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from fms_fsdp.atomic import fsync_path, write_text_atomic
from fms_fsdp.data.shards import FileEntry, write_counts
from fms_fsdp.data.text import (
    check_text,
    encode,
    load_tokenizer,
    open_binary,
    parse_line,
    text_column,
    tokenizer_json,
)
from fms_fsdp.errors import ConfigError, DataError, first_line

EXTENSIONS = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet", ".txt", ".md")
SCHEMA = pa.schema([("tokens", pa.uint32())])
MAX_WARNINGS = 20

Record = tuple[int, Optional[str], Optional[str]]  # (line or row, text, reason it is skipped)


def as_count(flag: str, value: int) -> int:
    """A positive integer flag."""
    if value < 1:
        raise ConfigError(f"--{flag}={value}: expected a positive integer")
    return value


# ---------------------------------------------------------------- inputs


def is_supported(path: Path) -> bool:
    return path.name.lower().endswith(EXTENSIONS)


def find_inputs(spec: str) -> list[Path]:
    """The input files named by --input (a file, a folder searched recursively, or a glob), sorted."""
    if not spec:
        raise ConfigError("--input is required: a file, folder or glob of .jsonl/.jsonl.gz/.json/.parquet/.txt/.md")
    path = Path(spec)
    if path.is_file():
        if not is_supported(path):
            raise ConfigError(f"--input={spec}: unsupported file type (expected {', '.join(EXTENSIONS)})")
        return [path]
    found: set[Path] = set()
    for match in [path] if path.is_dir() else map(Path, glob.glob(spec, recursive=True)):
        if match.is_dir():
            found.update(
                p
                for p in match.rglob("*")
                if p.is_file()
                and is_supported(p)
                and not any(part.startswith(".") for part in p.relative_to(match).parts)
            )
        elif match.is_file() and is_supported(match):
            found.add(match)
    if not found:
        raise ConfigError(f"--input={spec}: no {', '.join(EXTENSIONS)} files found")
    return sorted(found)


def read_jsonl(path: Path, text_field: str) -> Iterator[Record]:
    """Records of a JSON-lines file (gzipped or not); blank lines are ignored."""
    with open_binary(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                yield n, *parse_line(line, text_field)


def read_parquet(path: Path, text_field: str) -> Iterator[Record]:
    """Records of the text_field column of a Parquet file, read batch by batch."""
    pf = pq.ParquetFile(path)
    text_column(pf, path, text_field)
    n = 0
    for batch in pf.iter_batches(columns=[text_field]):
        for value in batch.column(0).to_pylist():
            n += 1
            yield n, *check_text(value, text_field)


def read_text(path: Path, text_field: str) -> Iterator[Record]:
    """A plain text file: one document."""
    data = path.read_bytes().removeprefix(codecs.BOM_UTF8)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        yield data.count(b"\n", 0, e.start) + 1, None, "invalid UTF-8"
        return
    yield 1, *check_text(text, text_field)


def records(path: Path, text_field: str) -> Iterator[Record]:
    """(line or row, text, None) for each document of an input file, (line, None, reason) for a bad one."""
    name = path.name.lower()
    reader = read_parquet if name.endswith(".parquet") else read_text if name.endswith((".txt", ".md")) else read_jsonl
    try:
        yield from reader(path, text_field)
    except (OSError, EOFError, zlib.error, pa.ArrowException) as e:
        why = first_line(e)
        raise DataError(f"{path}: cannot read it ({why}); fix or remove this input file") from None


# ---------------------------------------------------------------- tokenizer


def tokenizer_file(spec: str) -> Optional[Path]:
    """tokenizer.json of --tokenizer (None for the byte tokenizer)."""
    if not spec:
        raise ConfigError("--tokenizer is required: a folder holding tokenizer.json, or byte")
    return None if spec == "byte" else tokenizer_json(spec, "tokenizer")


def load_encoder(path: Optional[Path]) -> Callable[[str], pa.Array]:
    """The encoder of a tokenizer.json (None: the byte tokenizer): text -> uint32 token ids, without
    special tokens (the loader adds the separators)."""
    if path is None:
        return lambda text: pa.array(np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint32))
    tok = load_tokenizer(str(path), "tokenizer")
    return lambda text: pa.array(encode(tok, text), type=pa.uint32())


_encode: Callable[[str], pa.Array]


def init_worker(path: Optional[Path]) -> None:
    global _encode
    _encode = load_encoder(path)


# ---------------------------------------------------------------- output


def marker_path(output: Path, index: int) -> Path:
    return output / ".done" / f"{index:05d}.json"


def shard_index(path: Path) -> int:
    """The input index in part-<i>-<j>.arrow or <i>.json; -1 for other names."""
    stem = path.name.removeprefix("part-").split("-")[0].split(".")[0]
    return int(stem) if stem.isdigit() else -1


class ShardWriter:
    """The shards of one input, closed once they hold shard_tokens tokens. They stay under temporary names
    until `finish` renames them all into place, so the dataset never holds part of an input."""

    def __init__(self, output: Path, index: int, shard_tokens: int):
        self.output, self.index, self.shard_tokens = output, index, shard_tokens
        self.shards: list[dict] = []
        self._writer: Optional[pa.ipc.RecordBatchFileWriter] = None

    def _tmp(self, name: str) -> Path:
        return self.output / f".{name}.tmp"

    def add(self, tokens: pa.Array) -> None:
        """Append one document as one record batch."""
        if self._writer is None:
            name = f"part-{self.index:05d}-{len(self.shards):05d}.arrow"
            self.shards.append({"name": name, "documents": 0, "tokens": 0})
            self._sink = pa.OSFile(str(self._tmp(name)), "wb")
            self._writer = pa.ipc.new_file(self._sink, SCHEMA)
        self._writer.write_batch(pa.record_batch([tokens], schema=SCHEMA))
        shard = self.shards[-1]
        shard["documents"] += 1
        shard["tokens"] += len(tokens)
        if shard["tokens"] >= self.shard_tokens:
            self._close()

    def _close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._sink.close()
            fsync_path(self._tmp(self.shards[-1]["name"]))
            self._writer = None

    def abandon(self) -> None:
        """Close and delete every shard written so far."""
        self._close()
        for shard in self.shards:
            self._tmp(shard["name"]).unlink(missing_ok=True)

    def finish(self) -> list[dict]:
        """Close the last shard, rename every shard into place; returns their names and counts."""
        self._close()
        for shard in self.shards:
            os.replace(self._tmp(shard["name"]), self.output / shard["name"])
        return self.shards


def clear_input(output: Path, index: int) -> None:
    """Remove what an unfinished earlier run left of input `index`: marker first, then shards and temp files."""
    marker_path(output, index).unlink(missing_ok=True)
    for pattern in (f"part-{index:05d}-*.arrow", f".part-{index:05d}-*.arrow.tmp"):
        for path in output.glob(pattern):
            path.unlink()


def process_input(job: tuple[int, Path, Path, dict]) -> tuple[int, dict, list[str]]:
    """Tokenize one input file into its shards and mark it done; returns (index, marker, first warnings)."""
    index, path, output, settings = job
    clear_input(output, index)
    writer = ShardWriter(output, index, settings["shard_tokens"])
    skipped: Counter[str] = Counter()
    warnings: list[str] = []
    try:
        for line, text, reason in records(path, settings["text_field"]):
            tokens = _encode(text) if text is not None else None
            if tokens is not None and len(tokens) == 0:
                reason = "no tokens"
            if reason is not None:
                skipped[reason] += 1
                if len(warnings) < MAX_WARNINGS:
                    warnings.append(f"warning: {path}:{line}: {reason}")
                continue
            writer.add(tokens)
    except (DataError, OSError):
        writer.abandon()
        raise
    stat = path.stat()
    marker = {
        "input": str(path.resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "settings": settings,
        "shards": writer.finish(),
        "skipped": dict(sorted(skipped.items())),
    }
    write_text_atomic(marker_path(output, index), json.dumps(marker, indent=1) + "\n")
    return index, marker, warnings


def finished(output: Path, index: int, path: Path, settings: dict) -> Optional[dict]:
    """The marker of input `index` when it is complete and current; None when it must be (re)done.
    Raises DataError when the output was made from another input or with other settings."""
    try:
        marker = json.loads(marker_path(output, index).read_text())
        made_from, made_with = marker["input"], marker["settings"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if made_from != str(path.resolve()):
        raise DataError(
            f"--output={output} holds input {index:05d} made from {made_from}, but input {index:05d} is "
            f"now {path}; use a new --output or empty this one"
        )
    for flag, value in settings.items():
        if made_with.get(flag) != value:
            raise DataError(f"--output={output} was made with another --{flag}; use the same one or a new --output")
    stat = path.stat()
    if (marker.get("size"), marker.get("mtime_ns")) != (stat.st_size, stat.st_mtime_ns):
        return None  # the input changed since
    if not all((output / s["name"]).is_file() for s in marker.get("shards", [])):
        return None
    return marker


def check_no_stale(output: Path, n_inputs: int) -> None:
    """Refuse an output holding shards of more input files than --input matches now."""
    for path in [*output.glob("part-*.arrow"), *(output / ".done").glob("*.json")]:
        if shard_index(path) >= n_inputs:
            raise DataError(
                f"--output={output} holds {path.name} but --input matches only {n_inputs} files; "
                "use a new --output or empty this one"
            )


def counts_path(output: Path) -> Path:
    """<data_path>/meta/counts_<dataset>.csv: the counts of every shard of the dataset."""
    return output.parent / "meta" / f"counts_{output.name}.csv"


# ---------------------------------------------------------------- main


def tokenized(todo: list[tuple], tok_file: Optional[Path], workers: int) -> Iterator[tuple[int, dict, list[str]]]:
    """process_input over todo, in `workers` processes (in this one when 1), in order of completion."""
    if workers <= 1:
        init_worker(tok_file)
        yield from map(process_input, todo)
        return
    with Pool(workers, initializer=init_worker, initargs=(tok_file,)) as pool:
        yield from pool.imap_unordered(process_input, todo)


def run(inputs: list[Path], output: Path, tok_file: Optional[Path], settings: dict, workers: int) -> None:
    """Tokenize every unfinished input, write the counts CSV, report."""
    output.mkdir(parents=True, exist_ok=True)
    (output / ".done").mkdir(exist_ok=True)
    check_no_stale(output, len(inputs))
    markers: dict[int, dict] = {}
    for i, path in enumerate(inputs):
        if (marker := finished(output, i, path, settings)) is not None:
            markers[i] = marker
    todo = [(i, path, output, settings) for i, path in enumerate(inputs) if i not in markers]
    sizes = {i: path.stat().st_size for i, path, *_ in todo}
    warnings: dict[int, list[str]] = {}
    with tqdm(
        total=sum(sizes.values()), unit="B", unit_scale=True, desc="tokenizing", disable=None, file=sys.stderr
    ) as bar:
        for i, marker, warned in tokenized(todo, tok_file, min(workers, len(todo))):
            markers[i], warnings[i] = marker, warned
            bar.update(sizes[i])
    counts = counts_path(output)
    write_counts(
        counts,
        [
            FileEntry(f"/{output.name}/{s['name']}", s["documents"], s["tokens"])
            for i in sorted(markers)
            for s in markers[i]["shards"]
        ],
    )
    report(output, len(inputs), markers, {i: warnings[i] for i in sorted(warnings)}, counts)


def report(output: Path, n_inputs: int, markers: dict[int, dict], warnings: dict[int, list[str]], counts: Path) -> None:
    """The first MAX_WARNINGS warnings of this run on stderr, the summary of the dataset on stdout."""
    shown = [line for lines in warnings.values() for line in lines][:MAX_WARNINGS]
    for line in shown:
        print(line, file=sys.stderr)
    bad_now = sum(sum(markers[i]["skipped"].values()) for i in warnings)
    if bad_now > len(shown):
        print(f"warning: {bad_now - len(shown)} more skipped records not shown", file=sys.stderr)
    skipped: Counter[str] = Counter()
    for m in markers.values():
        skipped.update(m["skipped"])
    shards = [s for m in markers.values() for s in m["shards"]]
    print(
        f"{output}: {n_inputs} input files ({n_inputs - len(warnings)} done before), "
        f"{sum(s['documents'] for s in shards)} documents, {sum(s['tokens'] for s in shards)} tokens, "
        f"{len(shards)} shards"
    )
    if skipped:
        reasons = ", ".join(f"{why} {n}" for why, n in sorted(skipped.items()))
        print(f"skipped {sum(skipped.values())} records: {reasons}")
    print(f"counts: {counts}")


def prepare_data(
    input: str, output: str, tokenizer: str, text_field: str, shard_tokens: int, workers: Optional[int]
) -> None:
    """Tokenize --input into Arrow shards under --output (the flags: fms_fsdp/cli.py)."""
    inputs = find_inputs(input)
    if not output:
        raise ConfigError("--output is required: <data_path>/<dataset>")
    out = Path(output).resolve()
    if out.name == "meta" or out == out.parent:
        raise ConfigError(f"--output={output}: give <data_path>/<dataset> (meta is reserved for the counts files)")
    if out.is_file():
        raise ConfigError(f"--output={output} is a file; give a folder <data_path>/<dataset>")
    tok_file = tokenizer_file(tokenizer)
    load_encoder(tok_file)  # fail now, not in every worker
    fingerprint = "byte" if tok_file is None else "sha256:" + hashlib.sha256(tok_file.read_bytes()).hexdigest()
    settings = {
        "tokenizer": fingerprint,
        "text_field": text_field,
        "shard_tokens": as_count("shard_tokens", shard_tokens),
    }
    workers = as_count("workers", len(os.sched_getaffinity(0)) if workers is None else workers)
    run(inputs, out, tok_file, settings, workers)
