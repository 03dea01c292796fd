"""Where a run reads and writes: a local path, or a URL of object storage (s3://, gs://, az://, ...)
reached through fsspec (universal_pathlib's UPath, a pathlib.Path for every fsspec filesystem).
Remote files are read by byte ranges, never downloaded whole; credentials and endpoints come from each
filesystem's standard chain (for S3: AWS_* variables, ~/.aws, instance roles; AWS_ENDPOINT_URL for
S3-compatible servers) and never from this package's config.

Object storage has no rename, but an object appears whole or not at all: a file is published by one
upload, and a folder (a checkpoint, an export) is whole once its COMPLETE marker, uploaded last, is
there; it is unmarked first when replaced or deleted. Checkpoint discovery and the clean-ups of
checkpoints and exports go by the marker.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa

from fms_fsdp.config import is_object_storage
from fms_fsdp.errors import DataError, first_line

COMPLETE = "COMPLETE"
# the environment variables by which the filesystems' standard chains are set (S3, Google Cloud Storage,
# Azure, fsspec itself): what a process on another machine needs to reach the same storage
_SETTINGS = ("AWS_", "GOOGLE_", "GCS_", "AZURE_", "FSSPEC_")
# the client libraries of object storage raise their own errors (botocore's are not OSErrors)
_CLIENT_MODULES = ("botocore", "aiobotocore", "aiohttp", "s3fs", "gcsfs", "google", "adlfs", "azure", "fsspec")


def is_remote(path: Any) -> bool:
    """Whether a path (a str, a Path or a UPath) is in object storage (config.is_object_storage's rule)."""
    return is_object_storage(str(path))


def storage_error(error: BaseException) -> bool:
    """Whether an exception is a failure to read or write storage: an OSError, or an error of an object
    storage client (no endpoint, refused credentials, a throttled request)."""
    return isinstance(error, OSError) or type(error).__module__.split(".")[0] in _CLIENT_MODULES


def storage_settings() -> dict[str, str]:
    """This process's object-storage settings (AWS_*, GOOGLE_*, GCS_*, AZURE_*, FSSPEC_* variables), for
    workers started elsewhere (Ray's) to reach the storage as this process does."""
    return {k: v for k, v in os.environ.items() if k.startswith(_SETTINGS)}


def location(path: str, flag: str) -> Path:
    """The Path of a flag's local path or URL (a DataError naming the flag when the URL's filesystem is
    not installed, e.g. s3fs for s3://)."""
    if not is_remote(path):
        return Path(path.removeprefix("file://"))
    try:
        from upath import UPath

        # listings are never cached: other ranks and processes write the same folders (checkpoints)
        return UPath(path, use_listings_cache=False)
    except ImportError as e:
        raise DataError(
            f"--{flag}={path}: object storage needs {e.name or 'universal_pathlib'}: pip install 'fms-fsdp[storage]'",
            every_rank=True,
        ) from None
    except ValueError as e:  # no fsspec filesystem for this protocol
        raise DataError(f"--{flag}={path}: {first_line(e)}", every_rank=True) from None


def open_random(path: Path) -> Any:
    """A file for random reads: memory-mapped when local (its pages stay the kernel's file cache),
    read by ranges when remote."""
    return path.open("rb") if is_remote(path) else pa.memory_map(str(path))


def mtime_ns(path: Path) -> int:
    stat = path.stat()
    return getattr(stat, "st_mtime_ns", None) or int(stat.st_mtime * 1e9)


def remove_tree(path: Path) -> None:
    """Delete a file or folder with everything under it (in object storage its COMPLETE marker first);
    nothing there is fine."""
    if is_remote(path):
        for doomed in (path / COMPLETE, path):
            try:
                doomed.fs.rm(doomed.path, recursive=True)  # type: ignore[attr-defined]
            except FileNotFoundError:
                pass
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():  # unlink of a missing name fails on a read-only disk too
        path.unlink()


def make_folder(path: Path) -> None:
    """mkdir -p; object storage has no folders to make (a bucket must exist)."""
    if not is_remote(path):
        path.mkdir(parents=True, exist_ok=True)


@contextmanager
def publish(target: Path) -> Iterator[Path]:
    """A local path to write `target` (a file or a folder) at; when the block ends, `target` is it,
    whole, replacing what was there. Locally a temporary name beside the target, renamed; remotely a
    local temporary file or folder uploaded (a folder then gets its COMPLETE marker, last)."""
    if not is_remote(target):
        tmp = target.with_name(f".{target.name}.tmp")
        remove_tree(tmp)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            yield tmp
            for path in [tmp, *tmp.rglob("*")] if tmp.is_dir() else [tmp]:
                if path.is_file():  # some writers (safetensors) create their files 0600
                    os.chmod(path, 0o666 & ~umask())
            if target.is_dir():
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            remove_tree(tmp)
        return
    with tempfile.TemporaryDirectory(prefix="fms-fsdp-") as folder:
        tmp = Path(folder) / target.name
        yield tmp
        if not tmp.is_dir():
            upload(tmp, target)  # replaces an object there in one step
            return
        (target / COMPLETE).unlink(missing_ok=True)
        names = {p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file()}
        for name in sorted(names):
            upload(tmp / name, target / name)
        fs = target.fs  # type: ignore[attr-defined]
        for key in fs.find(target.path) if target.is_dir() else []:  # what an older export there had more
            if key.removeprefix(target.path.rstrip("/") + "/") not in names:
                fs.rm(key)
        (target / COMPLETE).write_text("ok\n")


def umask() -> int:
    """This process's umask (read without changing it, where Linux shows it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def upload(local: Path, target: Path) -> None:
    """One local file to object storage, in one (multipart) upload: whole or absent."""
    target.fs.put_file(str(local), target.path)  # type: ignore[attr-defined]


@contextmanager
def local_copy(path: Path) -> Iterator[Path]:
    """`path` itself when local; a remote file or folder downloaded to a temporary local one (for
    readers that need local files, e.g. safetensors' memory map)."""
    if not is_remote(path):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="fms-fsdp-") as folder:
        local = Path(folder) / path.name
        path.fs.get(path.path, str(local), recursive=path.is_dir())  # type: ignore[attr-defined]
        yield local
