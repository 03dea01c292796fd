"""Durable, atomic writes: a file is either complete under its final name or absent (local or in
object storage)."""

from __future__ import annotations

import os
import uuid
from contextlib import suppress
from pathlib import Path
from typing import BinaryIO, Callable

from fms_fsdp.storage import is_remote


def fsync_path(path: Path) -> None:
    """Flush a file's or a folder's entries to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_local_atomic(path: Path, save: Callable[[BinaryIO], object], durable: bool = True) -> None:
    """`save` writes a local file's bytes under a temporary name (unique per process and call: writers on
    several machines may share a folder), which is renamed
    into place (with `durable`, flushed to disk first, and the folder's entry after); the temporary file
    never outlives a failure."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with tmp.open("wb") as f:
            save(f)
        if durable:
            fsync_path(tmp)
        os.replace(tmp, path)
    finally:
        with suppress(OSError):
            tmp.unlink(missing_ok=True)
    if durable:
        fsync_path(path.parent)


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` whole or not at all: locally through write_local_atomic; in object storage, one
    upload (an object is whole or absent)."""
    if is_remote(path):
        path.write_text(text)
        return
    write_local_atomic(path, lambda f: f.write(text.encode()))


def write_text_if_changed(path: Path, text: str) -> None:
    """write_text_atomic, unless the file already says the same: then it is left untouched (its
    modification time too, which caches and re-runs go by)."""
    if not (path.is_file() and path.read_text() == text):
        write_text_atomic(path, text)


def write_text_keeping_old(path: Path, text: str) -> None:
    """write_text_atomic, but a different file already there is kept as <stem>.<n><suffix> (the lowest
    free n), never overwritten; the same text leaves it as it is."""
    if path.exists():
        if path.read_text() == text:
            return
        n = 1
        while path.with_name(f"{path.stem}.{n}{path.suffix}").exists():
            n += 1
        path.rename(path.with_name(f"{path.stem}.{n}{path.suffix}"))
    write_text_atomic(path, text)
