"""Durable, atomic writes: a file is either complete under its final name or absent (local or in
object storage)."""

from __future__ import annotations

import os
from pathlib import Path

from fms_fsdp.storage import is_remote


def fsync_path(path: Path) -> None:
    """Flush a file's or a folder's entries to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` under a temporary name (unique per process), flush it, rename it into place; in
    object storage, one upload (an object is whole or absent)."""
    if is_remote(path):
        path.write_text(text)
        return
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(path.parent)


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
