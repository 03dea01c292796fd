"""What fms-prepare-data writes in its output folder: a piece's shards (under temporary names until
all are complete), its marker (.done/<input>-<piece>.json), the dataset's counts and its ledger
(.done/complete.json, once every piece is finished), and what a re-run finds there."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Optional

import pyarrow as pa

from fms_fsdp.atomic import fsync_path
from fms_fsdp.data.prepare.pieces import Piece
from fms_fsdp.data.shards import FileEntry, write_counts
from fms_fsdp.errors import DataError
from fms_fsdp.storage import is_remote, mtime_ns, upload

SCHEMA = pa.schema([("tokens", pa.uint32())])
LEDGER = "complete.json"


def marker_path(output: Path, piece: Piece) -> Path:
    return output / ".done" / f"{piece.name}.json"


def shard_key(path: Path) -> tuple[int, int]:
    """(input, piece) of part-<i>-<p>-<j>.arrow or <i>-<p>.json; (-1, -1) for other names."""
    numbers = path.name.removeprefix("part-").removeprefix(".").split(".")[0].split("-")
    return (
        (int(numbers[0]), int(numbers[1])) if len(numbers) >= 2 and all(n.isdigit() for n in numbers[:2]) else (-1, -1)
    )


def remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


class ShardWriter:
    """The shards of one piece, closed once they hold shard_tokens tokens. They are written to local
    temporary files (in the output folder when it is local) until `finish` puts them all in place, so
    the dataset never holds part of a piece."""

    def __init__(self, output: Path, piece: Piece, shard_tokens: int, scratch: Path):
        self.output, self.piece, self.shard_tokens = output, piece, shard_tokens
        self.scratch = scratch
        self.shards: list[dict] = []
        self._writer: Optional[pa.ipc.RecordBatchFileWriter] = None
        self._run = uuid.uuid4().hex[:8]  # a killed run's orphan workers never write to this run's files

    def _tmp(self, name: str) -> Path:
        return self.scratch / f".{name}.{self._run}.tmp"

    def add(self, tokens: pa.Array) -> None:
        """Append one document as one record batch."""
        if self._writer is None:
            name = f"part-{self.piece.name}-{len(self.shards):05d}.arrow"
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
            if not is_remote(self.output):
                fsync_path(self._tmp(self.shards[-1]["name"]))
            self._writer = None

    def abandon(self) -> None:
        """Close and delete every shard written so far."""
        self._close()
        for shard in self.shards:
            remove(self._tmp(shard["name"]))

    def finish(self) -> list[dict]:
        """Close the last shard, put every shard in place; returns their names and counts."""
        self._close()
        for shard in self.shards:
            tmp, final = self._tmp(shard["name"]), self.output / shard["name"]
            if is_remote(final):
                upload(tmp, final)
                tmp.unlink()
            else:
                os.replace(tmp, final)
        return self.shards


def clear_piece(output: Path, piece: Piece) -> None:
    """Remove what an unfinished earlier run left of a piece: marker first, then shards and temp files
    (its shards', and its marker's of a worker killed as it wrote it)."""
    marker = marker_path(output, piece)
    remove(marker)
    patterns = [f"part-{piece.name}-*.arrow"]
    if not is_remote(output):
        patterns += [f".part-{piece.name}-*.tmp", f".done/.{marker.name}.tmp*"]
    for pattern in patterns:
        for path in output.glob(pattern):
            remove(path)


def input_id(path: Path) -> str:
    """How a marker names its input: the resolved local path, or the URL."""
    return str(path) if is_remote(path) else str(path.resolve())


def finished(output: Path, piece: Piece, settings: dict) -> Optional[dict]:
    """The marker of a piece when it is complete and current; None when it must be (re)done. Raises
    DataError when the output was made from another input or with other settings."""
    try:
        marker = json.loads(marker_path(output, piece).read_text())
        made_from, made_with = marker["input"], marker["settings"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if made_from != input_id(piece.path):
        raise DataError(
            f"--output={output} holds input {piece.index:05d} made from {made_from}, but input {piece.index:05d} is "
            f"now {piece.path}; use a new --output or empty this one"
        )
    for flag, value in settings.items():
        if made_with.get(flag) != value:
            raise DataError(
                f"--output={output} was made with --{flag}={made_with.get(flag)}, not {value}; use the same one or "
                "a new --output"
            )
    if (marker.get("size"), marker.get("mtime_ns"), marker.get("piece")) != (
        piece.path.stat().st_size,
        mtime_ns(piece.path),
        [piece.start, piece.end],
    ):
        return None  # the input changed since
    if not all((output / s["name"]).is_file() for s in marker.get("shards", [])):
        return None
    return marker


def remove_stale(output: Path, pieces: list[Piece]) -> None:
    """Refuse an output holding shards of more input files than --input matches now; remove the pieces
    an input no longer has (it shrank)."""
    planned = {(p.index, p.part) for p in pieces}
    n_inputs = 1 + max(p.index for p in pieces)
    for path in [*output.glob("part-*.arrow"), *(output / ".done").glob("*.json")]:
        index, part = shard_key(path)
        if index >= n_inputs:
            raise DataError(
                f"--output={output} holds {path.name} but --input matches only {n_inputs} files; "
                "use a new --output or empty this one"
            )
        if index >= 0 and (index, part) not in planned:
            remove(path)


def counts_path(output: Path) -> Path:
    """<data_path>/meta/counts_<dataset>.csv: the counts of every shard of the dataset."""
    return output.parent / "meta" / f"counts_{output.name}.csv"


def write_dataset_counts(output: Path, pieces: list[Piece], markers: dict[Piece, dict]) -> Path:
    entries = [
        FileEntry(f"/{output.name}/{s['name']}", s["documents"], s["tokens"])
        for p in pieces
        for s in markers[p]["shards"]
    ]
    path = counts_path(output)
    write_counts(path, entries)
    return path


def ledger_path(output: Path) -> Path:
    return output / ".done" / LEDGER


def read_ledger(output: Path) -> Optional[dict]:
    """What the output was made from, once complete (None: not complete, or unreadable)."""
    try:
        return json.loads(ledger_path(output).read_text())
    except (OSError, ValueError):
        return None
