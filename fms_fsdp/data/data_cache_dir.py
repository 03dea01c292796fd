"""Where the loader keeps what it learns of the data files at start-up, so that a later start does not
read them again: document counts, the readers' indexes (an Arrow stream's record-batch offsets, a
token array's document boundaries) and raw-text indexes.

The cache belongs to the run, not to the data: by default `<ckpt_save_path>/data_cache/`, or
--data_cache_dir (a folder several runs share builds them once for all), one sub-folder per data
folder (`<name>-<hash of its path>`). --data_cache_dir=meta keeps them in each data folder's own
`meta/`, fms-fsdp's place (skipped where that folder is read-only). A cache in object storage (a run
saving to s3://, or --data_cache_dir=s3://...) is kept there, each file one upload, so a later start over
remote data reads no footers either. Counts a user or `fms-prepare-data` wrote in a data folder's
`meta/` are read in every case. A cached file that cannot be read is computed again and replaced.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import BinaryIO, Callable, Optional, Union

import numpy as np

from fms_fsdp.atomic import write_local_atomic
from fms_fsdp.data.file_reader import Options, Reader
from fms_fsdp.data.token_arrays import TokenArray, metadata_path
from fms_fsdp.errors import first_line
from fms_fsdp.storage import is_remote, location, mtime_ns, storage_error

IN_DATA = "meta"  # --data_cache_dir's value for the data folders' own meta/
# what an index is and which checks made it: a new value computes every index again (an index cached before a
# check was added would let the file it checks pass unchecked)
INDEX_VERSION = 2
Index = Union[None, str, np.ndarray]  # a reader's index: none, the cached .npy's path, or the array itself


def cache_folder(data_root: str, cache_dir: Optional[str]) -> Optional[Path]:
    """The folder caching what is learned of the files under data_root (None: no cache)."""
    if cache_dir is None:
        return None
    if cache_dir == IN_DATA:
        return location(data_root, "data_path") / "meta"
    name = data_root.rstrip("/").rsplit("/", 1)[-1] or "root"
    return location(cache_dir, "data_cache_dir") / f"{name}-{hashlib.sha1(data_root.encode()).hexdigest()[:12]}"


def write_cached(path: Path, save: Callable[[BinaryIO], object]) -> Optional[str]:
    """Write a cache file whole or not at all (atomic.write_local_atomic; a cache is made again when
    lost, so not flushed to disk; in object storage one upload); None, or why it could not be written."""
    try:
        if is_remote(path):
            buffer = io.BytesIO()
            save(buffer)
            path.write_bytes(buffer.getvalue())
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        write_local_atomic(path, save, durable=False)
        return None
    except Exception as e:  # an OSError, or an object storage client's own error
        if not storage_error(e):
            raise
        return getattr(e, "strerror", None) or first_line(e)


def _stamp(path: Path) -> str:
    """A file's size and mtime, or its absence."""
    return f"{path.stat().st_size}|{mtime_ns(path)}" if path.is_file() else "absent"


class IndexStore:
    """Readers' indexes, one .npy each under <cache folder>/index/, named by the file (its path under
    the data folder, size and mtime; a token array's Dolma metadata's too), the layout and the options
    its index depends on. `failure`: why one could not be written (None: all were). A local one is
    memory-mapped by the loader workers; one in object storage is read here and travels with the
    file's entry."""

    def __init__(self, folder: Optional[Path]):
        self.folder = None if folder is None else folder / "index"
        self.failure: Optional[str] = None

    def get(self, rel: str, path: Path, reader: type[Reader], options: Options) -> Index:
        """The file's index: from the cache, or computed now (and cached where the folder is writable)."""
        stamps = [_stamp(path)] + ([_stamp(metadata_path(path))] if reader is TokenArray else [])
        named = f"{INDEX_VERSION}|{rel}|{'|'.join(stamps)}|{reader.__name__}|{reader.index_key(options)}"
        key = hashlib.sha1(named.encode())
        cached = None if self.folder is None else self.folder / f"{key.hexdigest()}.npy"
        if cached is not None and is_remote(cached) and (known := _download(cached)) is not None:
            return known
        if cached is not None and not is_remote(cached) and load_index(str(cached)) is not None:
            return str(cached)
        index = reader.index_of(path, options)
        if index is None or cached is None:
            return index
        failure = write_cached(cached, lambda f: np.save(f, index))
        if failure is None:
            return index if is_remote(cached) else str(cached)
        self.failure = self.failure or failure
        return index  # the index travels with the file's entry instead


def _download(path: Path) -> Optional[np.ndarray]:
    """An index cached in object storage (None: absent or unreadable)."""
    try:
        return np.load(io.BytesIO(path.read_bytes()))
    except Exception as e:  # absent, damaged, or refused by the client
        if storage_error(e) or isinstance(e, (ValueError, EOFError)):
            return None
        raise


def load_index(index: Index) -> Optional[np.ndarray]:
    """A reader's index from its entry (a cached file is memory-mapped; one this machine cannot see or
    read, as when the cache folder is not shared between nodes or the file is damaged: None, and the
    reader computes it)."""
    if isinstance(index, str):
        try:
            return np.load(index, mmap_mode="r")
        except (OSError, ValueError, EOFError):
            return None
    return index
