"""Where the loader keeps what it learns of the data files at start-up, so that a later start does not
read them again: document counts, the readers' indexes (an Arrow stream's record-batch offsets, a
token array's document boundaries) and raw-text indexes.

The cache belongs to the run, not to the data: by default `<ckpt_save_path>/data_cache/`, or
--data_cache_dir (a folder several runs share builds them once for all), one sub-folder per data
folder (`<name>-<hash of its path>`). --data_cache_dir=meta keeps them in each data folder's own
`meta/`, fms-fsdp's place (skipped where that folder is read-only). Caches are local files: none is
written to object storage. Counts a user or `fms-prepare-data` wrote in a data folder's `meta/` are
read in every case.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Optional, Union

import numpy as np

from fms_fsdp.data.reader import Options, Reader
from fms_fsdp.storage import is_remote, location, mtime_ns

IN_DATA = "meta"  # --data_cache_dir's value for the data folders' own meta/
Index = Union[None, str, np.ndarray]  # a reader's index: none, the cached .npy's path, or the array itself


def cache_folder(data_root: str, cache_dir: Optional[str]) -> Optional[Path]:
    """The folder caching what is learned of the files under data_root (None: no cache)."""
    if cache_dir is None:
        return None
    if cache_dir == IN_DATA:
        folder = location(data_root, "data_path") / "meta"
    else:
        name = data_root.rstrip("/").rsplit("/", 1)[-1] or "root"
        folder = Path(cache_dir) / f"{name}-{hashlib.sha1(data_root.encode()).hexdigest()[:12]}"
    return None if is_remote(folder) or is_remote(cache_dir) else folder


class IndexStore:
    """Readers' indexes, one .npy each under <cache folder>/index/, named by the file (its path under
    the data folder, size and mtime), the layout and the options its index depends on."""

    def __init__(self, folder: Optional[Path]):
        self.folder = None if folder is None else folder / "index"

    def get(self, rel: str, path: Path, reader: type[Reader], options: Options) -> Index:
        """The file's index: from the cache, or computed now (and cached where the folder is writable)."""
        stat = f"{path.stat().st_size}|{mtime_ns(path)}"
        key = hashlib.sha1(f"{rel}|{stat}|{reader.__name__}|{reader.index_key(options)}".encode()).hexdigest()
        cached = None if self.folder is None else self.folder / f"{key}.npy"
        if cached is not None and cached.is_file():
            return str(cached)
        index = reader.index_of(path, options)
        if index is None or cached is None:
            return index
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_name(f".{cached.name}.tmp{os.getpid()}")
            with tmp.open("wb") as f:
                np.save(f, index)
            os.replace(tmp, cached)
            return str(cached)
        except OSError:  # a read-only folder: the index travels with the file's entry instead
            return index


def load_index(index: Index) -> Optional[np.ndarray]:
    """A reader's index from its entry (a cached file is memory-mapped; one this machine cannot see,
    as when the cache folder is not shared between nodes: None, and the reader computes it)."""
    if isinstance(index, str):
        return np.load(index, mmap_mode="r") if os.path.isfile(index) else None
    return index
