"""Tokenize raw text into the Arrow shards the training loader reads (IBM fms-fsdp's layout).
Run as scripts/prepare_data.py or, installed, `fms-prepare-data`:

    python scripts/prepare_data.py --input=raw/ --output=/data/my_dataset --tokenizer=/models/llama3
    python scripts/prepare_data.py --input='s3://raw/*.jsonl.gz' --output=s3://data/web --tokenizer=byte \
        --engine=ray --ray_address=head:6379

The input is cut into pieces that depend on the files alone (data/prepare/pieces.py). Piece p of input file i
(in sorted order) becomes <output>/part-<i>-<p>-<j>.arrow, j = 0, 1, ...: Arrow IPC files with one
uint32 column `tokens` and one record batch per document. A piece's shards are written under temporary
names (locally; uploaded whole to object storage) and put in place when all are complete; then
<output>/.done/<i>-<p>.json marks the piece finished, so a re-run skips finished pieces and redoes the
others from scratch. Whatever ran them (one process pool, a Ray cluster, a Slurm array of any size),
the shards and counts are the same bytes. The counts, <data_path>/meta/counts_<dataset>.csv, are
written when every piece is finished: by the run or array task that finishes the last one, or by
--finalize=True. Bad records (invalid JSON or UTF-8, no text, empty text) are skipped, counted and
reported as file:line (the row number for Parquet); they never stop the run.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np
import pyarrow as pa
from tqdm import tqdm

from fms_fsdp.atomic import write_text_if_changed
from fms_fsdp.data.prepare.engines import ENGINES, run_local, run_ray
from fms_fsdp.data.prepare.pieces import EXTENSIONS, Piece, cut, is_splittable_jsonl, is_supported, records
from fms_fsdp.data.prepare.shard_writer import (
    ShardWriter,
    clear_piece,
    finished,
    input_id,
    ledger_path,
    marker_path,
    remove_stale,
    write_dataset_counts,
)
from fms_fsdp.data.sources import expand_braces
from fms_fsdp.data.text import encode, load_tokenizer, tokenizer_json
from fms_fsdp.errors import ConfigError, DataError
from fms_fsdp.storage import is_remote, location, mtime_ns

MAX_WARNINGS = 20
FIRST_FILES = 5  # files named, with their counts, when a dataset done before is reported again
FIRST_RECORDS = 3  # ... each with its first skipped records
SHARD_TOKENS = 100_000_000  # --shard_tokens's default (cli.py says it too)
PIECE_BYTES = 128 << 20  # --piece_bytes's


def as_count(flag: str, value: int) -> int:
    """A positive integer flag."""
    if value < 1:
        raise ConfigError(f"--{flag}={value}: expected a positive integer")
    return value


@dataclass(frozen=True)
class Share:
    """Which pieces this run does: task `index` of `count` (a Slurm array's), every count-th piece."""

    index: int = 0
    count: int = 1

    def holds(self, k: int) -> bool:
        return k % self.count == self.index


def share_of(num_tasks: Optional[int], task_index: Optional[int]) -> Share:
    """--num_tasks/--task_index, or Slurm's array variables when not given."""
    env = os.environ
    count = num_tasks if num_tasks is not None else int(env.get("SLURM_ARRAY_TASK_COUNT", 1))
    index = task_index if task_index is not None else int(env.get("SLURM_ARRAY_TASK_ID", 0))
    if env.get("SLURM_ARRAY_TASK_MIN") and task_index is None:
        index -= int(env["SLURM_ARRAY_TASK_MIN"])  # --array=1-8 numbers its tasks from 1
    as_count("num_tasks", count)
    if not 0 <= index < count:
        raise ConfigError(f"--task_index={index}: expected 0 .. {count - 1} (--num_tasks={count})")
    return Share(index, count)


# ---------------------------------------------------------------- inputs


def find_inputs(spec: str) -> list[Path]:
    """The input files named by --input (a file, a folder searched recursively, or a pattern with globs
    and braces, web-{000..127}.jsonl.gz; local or in object storage), sorted."""
    if not spec:
        raise ConfigError("--input is required: a file, folder or glob of .jsonl/.jsonl.gz/.json/.parquet/.txt/.md")
    found: set[Path] = set()
    for pattern in expand_braces(spec):
        glob_at = min((pattern.find(c) for c in "*?[" if c in pattern), default=-1)
        if glob_at < 0:
            path = location(pattern, "input")
            if path.is_file() and not is_supported(path):
                raise ConfigError(f"--input={spec}: unsupported file type (expected {', '.join(EXTENSIONS)})")
            found |= {path} if path.is_file() else set(_tree(path)) if path.is_dir() else set()
            continue
        folder, _, rest = pattern[:glob_at].rpartition("/")
        for match in location(folder or ".", "input").glob(rest + pattern[glob_at:]):
            found |= {match} if match.is_file() else set(_tree(match))
    found = {p for p in found if is_supported(p)}
    if not found:
        raise ConfigError(f"--input={spec}: no {', '.join(EXTENSIONS)} files found")
    return sorted(found, key=str)


def _tree(folder: Path) -> Iterator[Path]:
    """The files under a folder, hidden ones left out."""
    for p in folder.rglob("*"):
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts):
            yield p


def plan(inputs: list[Path], piece_bytes: int) -> list[Piece]:
    """Every input's pieces, in input order."""
    return [piece for i, path in enumerate(inputs) for piece in cut(i, path, path.stat().st_size, piece_bytes)]


# ---------------------------------------------------------------- tokenizer


def tokenizer_text(spec: str) -> Optional[str]:
    """--tokenizer's tokenizer.json as text (None for the byte tokenizer), checked to load."""
    if not spec:
        raise ConfigError("--tokenizer is required: a folder holding tokenizer.json, or byte")
    if spec == "byte":
        return None
    load_tokenizer(spec, "tokenizer")  # fail now, not in every worker
    return tokenizer_json(spec, "tokenizer").read_bytes().decode("utf-8")


def load_encoder(tokenizer: Optional[str]) -> Callable[[str], pa.Array]:
    """The encoder of a tokenizer.json's text (None: the byte tokenizer): text -> uint32 token ids,
    without special tokens (the loader adds the separators)."""
    if tokenizer is None:
        return lambda text: pa.array(np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint32))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer)
    return lambda text: pa.array(encode(tok, text), type=pa.uint32())


_encode: Callable[[str], pa.Array]


def init_worker(tokenizer: Optional[str]) -> None:
    global _encode
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _encode = load_encoder(tokenizer)


def process_piece(job: tuple[Piece, str, dict]) -> tuple[Piece, dict]:
    """Tokenize one piece into its shards and mark it done; returns (piece, marker). A piece already
    done (by a worker that died before its result came back: run again by the pool, or retried by Ray)
    is not done twice."""
    piece, out, settings = job
    output = location(out, "output")
    done = finished(output, piece, settings)
    if done is not None:
        return piece, done
    clear_piece(output, piece)
    if is_remote(output):
        import tempfile

        with tempfile.TemporaryDirectory(prefix="fms-fsdp-") as scratch:
            return piece, _tokenize(piece, output, settings, Path(scratch))
    return piece, _tokenize(piece, output, settings, output)


def process_piece_with(job: tuple[Piece, str, dict], tokenizer: Optional[str]) -> tuple[Piece, dict]:
    """process_piece in a worker that loads the tokenizer on its first piece (a Ray task)."""
    if "_encode" not in globals():
        init_worker(tokenizer)
    return process_piece(job)


def _tokenize(piece: Piece, output: Path, settings: dict, scratch: Path) -> dict:
    writer = ShardWriter(output, piece, settings["shard_tokens"], scratch)
    skipped: Counter[str] = Counter()
    warnings: list[list] = []
    lines = 0
    try:
        for line, text, reason in records(piece, settings["text_field"]):
            lines = line
            tokens = _encode(text) if text is not None else None
            if tokens is not None and len(tokens) == 0:
                reason = "no tokens"
            if reason is not None:
                skipped[reason] += 1
                if len(warnings) < MAX_WARNINGS:
                    warnings.append([line, reason])
            elif tokens is not None:
                writer.add(tokens)
    except (DataError, OSError):
        writer.abandon()
        raise
    marker = {
        "input": input_id(piece.path),
        "size": piece.path.stat().st_size,
        "mtime_ns": mtime_ns(piece.path),
        "piece": [piece.start, piece.end],
        "settings": settings,
        "shards": writer.finish(),
        "lines": lines,
        "skipped": dict(sorted(skipped.items())),
        "warnings": warnings,
    }
    write_text_if_changed(marker_path(output, piece), json.dumps(marker, indent=1) + "\n")
    return marker


# ---------------------------------------------------------------- main


@dataclass(frozen=True)
class Engine:
    """--engine, --workers and --ray_address."""

    name: str = "local"
    workers: int = 1
    ray_address: Optional[str] = None

    def __str__(self) -> str:
        """Where the pieces are tokenized, for the log."""
        if self.name == "local":
            return f"with {self.workers} processes"
        return (
            f"on the Ray cluster at {self.ray_address}" if self.ray_address else f"on a local Ray ({self.workers} CPUs)"
        )


@dataclass(frozen=True)
class Recipe:
    """What the shards depend on: the tokenizer (--tokenizer as given, and its tokenizer.json's text;
    None: the byte tokenizer), --text_field, --shard_tokens and --piece_bytes."""

    tokenizer: str
    tokenizer_text: Optional[str]
    text_field: str = "text"
    shard_tokens: int = SHARD_TOKENS
    piece_bytes: int = PIECE_BYTES

    def settings(self) -> dict:
        """What every piece's marker records, and a re-run must match."""
        text = self.tokenizer_text
        return {
            "tokenizer": "byte" if text is None else "sha256:" + hashlib.sha256(text.encode()).hexdigest(),
            "text_field": self.text_field,
            "shard_tokens": as_count("shard_tokens", self.shard_tokens),
            "piece_bytes": as_count("piece_bytes", self.piece_bytes),
        }


def recipe_of(
    tokenizer: str, text_field: str, shard_tokens: int = SHARD_TOKENS, piece_bytes: int = PIECE_BYTES
) -> Recipe:
    """The recipe of the flags, its tokenizer loaded once to check it."""
    recipe = Recipe(
        tokenizer=tokenizer,
        tokenizer_text=tokenizer_text(tokenizer),
        text_field=text_field,
        shard_tokens=shard_tokens,
        piece_bytes=piece_bytes,
    )
    recipe.settings()
    return recipe


def tokenized(jobs: list, tokenizer: Optional[str], engine: Engine) -> Iterator[tuple[Piece, dict]]:
    if engine.name == "ray":
        return run_ray(process_piece_with, jobs, tokenizer, engine.ray_address, engine.workers)
    return run_local(process_piece, init_worker, jobs, tokenizer, min(engine.workers, len(jobs)))


def prepare_files(
    inputs: list[Path], output: Path, recipe: Recipe, engine: Engine, share: Share = Share(), finalize: bool = False
) -> bool:
    """Tokenize this share's unfinished pieces of `inputs` into `output`; when every piece is finished,
    write the counts and the ledger and report. Returns whether the dataset is complete."""
    settings, out = recipe.settings(), str(output)
    if not is_remote(output):
        (output / ".done").mkdir(parents=True, exist_ok=True)
    pieces = plan(inputs, settings["piece_bytes"])
    remove_stale(output, pieces)
    markers = {p: m for p in pieces if (m := finished(output, p, settings)) is not None}
    todo = [p for k, p in enumerate(pieces) if share.holds(k) and p not in markers and not finalize]
    before = len(markers)
    for piece, marker in with_progress(
        tokenized([(p, out, settings) for p in todo], recipe.tokenizer_text, engine), todo
    ):
        markers[piece] = marker
    for p in pieces:  # what other tasks finished meanwhile
        if p not in markers and (done := finished(output, p, settings)) is not None:
            markers[p] = done
    missing = [p for p in pieces if p not in markers]
    if missing and finalize:
        raise DataError(
            f"--output={out}: {len(missing)} of {len(pieces)} pieces are not finished (the first: {missing[0].path}, "
            f"piece {missing[0].part}); run the array's tasks again: each does only what is left"
        )
    if missing:
        print(
            f"{out}: task {share.index} of {share.count} did its {len(todo)} pieces; {len(missing)} of {len(pieces)} "
            "are left to other tasks (the one that finishes the last writes the counts)"
        )
        return False
    counts = write_dataset_counts(output, pieces, markers)
    shards = [s for p in pieces for s in markers[p]["shards"]]
    ledger = {
        **settings,
        "tokenizer": recipe.tokenizer,
        "tokenizer_sha": settings["tokenizer"],
        "inputs": len(inputs),
        "pieces": len(pieces),
        "documents": sum(s["documents"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
    }
    write_text_if_changed(ledger_path(output), json.dumps(ledger, indent=1) + "\n")
    report(out, len(inputs), pieces, markers, before, counts)
    return True


def with_progress(results: Iterator[tuple[Piece, dict]], todo: list[Piece]) -> Iterator[tuple[Piece, dict]]:
    """The results, with one progress line over every worker: input bytes, rate and ETA, documents, tokens."""
    with tqdm(
        total=sum(p.size for p in todo), unit="B", unit_scale=True, desc="tokenizing", disable=None, file=sys.stderr
    ) as bar:
        documents = tokens = 0
        for piece, marker in results:
            documents += sum(s["documents"] for s in marker["shards"])
            tokens += sum(s["tokens"] for s in marker["shards"])
            bar.set_postfix_str(f"{documents} documents, {tokens} tokens", refresh=False)
            bar.update(piece.size)
            yield piece, marker


def skipped_records(pieces: list[Piece], markers: dict[Piece, dict]) -> list[tuple[Path, int, str]]:
    """The skipped records whose place the pieces' markers kept: (file, line, reason), in input order."""
    found, lines_before = [], 0
    for p in pieces:
        marker = markers[p]
        lines_before = 0 if p.part == 0 else lines_before
        offset = lines_before if is_splittable_jsonl(p.path) and p.end >= 0 else 0
        found += [(p.path, line + offset, reason) for line, reason in marker["warnings"]]
        lines_before += marker["lines"]
    return found


def report(out: str, n_inputs: int, pieces: list[Piece], markers: dict[Piece, dict], before: int, counts: Path) -> None:
    """The dataset's skipped records on stderr, its summary on stdout. Where this process tokenized some
    pieces, the first MAX_WARNINGS records (file:line); where every piece was done before (--finalize,
    or a run again), whose tasks said each record already, a count per file with its first few records."""
    skipped: Counter[str] = Counter()
    per_file: Counter[Path] = Counter()
    for p in pieces:
        skipped.update(markers[p]["skipped"])
        per_file[p.path] += sum(markers[p]["skipped"].values())
    found = skipped_records(pieces, markers)
    if before == len(pieces):
        first: dict[Path, list[str]] = {}
        for path, line, reason in found:
            if len(first.setdefault(path, [])) < FIRST_RECORDS:
                first[path].append(f"line {line} ({reason})")
        files = [path for path in per_file if per_file[path]]
        for path in files[:FIRST_FILES]:
            n = per_file[path]
            shown = f", the first: {', '.join(first[path])}" if first.get(path) else ""
            print(f"warning: {path}: {n} skipped record{'s' * (n != 1)}{shown}", file=sys.stderr)
        if len(files) > FIRST_FILES:
            print(f"warning: {len(files) - FIRST_FILES} more files with skipped records", file=sys.stderr)
    else:
        for path, line, reason in found[:MAX_WARNINGS]:
            print(f"warning: {path}:{line}: {reason}", file=sys.stderr)
        if sum(skipped.values()) > min(len(found), MAX_WARNINGS):
            print(
                f"warning: {sum(skipped.values()) - min(len(found), MAX_WARNINGS)} more skipped records not shown",
                file=sys.stderr,
            )
    shards = [s for m in markers.values() for s in m["shards"]]
    print(
        f"{out}: {n_inputs} input files in {len(pieces)} pieces ({before} done before), "
        f"{sum(s['documents'] for s in shards)} documents, {sum(s['tokens'] for s in shards)} tokens, "
        f"{len(shards)} shards"
    )
    if skipped:
        reasons = ", ".join(f"{why} {n}" for why, n in sorted(skipped.items()))
        print(f"skipped {sum(skipped.values())} records: {reasons}")
    print(f"counts: {counts}")


def prepare_data(
    input: str,
    output: str,
    tokenizer: str,
    text_field: str,
    shard_tokens: int,
    workers: Optional[int],
    piece_bytes: int = PIECE_BYTES,
    engine: str = "local",
    ray_address: Optional[str] = None,
    num_tasks: Optional[int] = None,
    task_index: Optional[int] = None,
    finalize: bool = False,
) -> None:
    """Tokenize --input into Arrow shards under --output (the flags: fms_fsdp/cli.py)."""
    if engine not in ENGINES:
        raise ConfigError(f"--engine={engine}: expected one of {', '.join(ENGINES)}")
    inputs = find_inputs(input)
    if not output:
        raise ConfigError("--output is required: <data_path>/<dataset>")
    out_path = location(output, "output")
    out = out_path if is_remote(out_path) else out_path.resolve()
    if out.name == "meta" or out == out.parent:
        raise ConfigError(f"--output={output}: give <data_path>/<dataset> (meta is reserved for the counts files)")
    if out.is_file():
        raise ConfigError(f"--output={output} is a file; give a folder <data_path>/<dataset>")
    recipe = recipe_of(tokenizer, text_field, shard_tokens, piece_bytes)
    workers = as_count("workers", len(os.sched_getaffinity(0)) if workers is None else workers)
    share = share_of(num_tasks, task_index)
    prepare_files(inputs, out, recipe, Engine(engine, workers, ray_address), share, finalize)
