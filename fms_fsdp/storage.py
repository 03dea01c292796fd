"""Where data is read from: a local path, or a URL of object storage (s3://, gs://, az://, ...) read
through fsspec (universal_pathlib's UPath, a pathlib.Path for every fsspec filesystem). Remote files
are read by byte ranges as the loader needs them, never downloaded whole; credentials and endpoints
come from each filesystem's standard chain (for S3: AWS_* variables, ~/.aws, instance roles;
AWS_ENDPOINT_URL for S3-compatible servers) and never from this package's config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa

from fms_fsdp.errors import DataError, first_line


def is_remote(path: Any) -> bool:
    return "://" in str(path) and not str(path).startswith("file://")


def location(path: str, flag: str) -> Path:
    """The Path of a flag's local path or URL (a DataError naming the flag when the URL's filesystem is
    not installed, e.g. s3fs for s3://)."""
    if not is_remote(path):
        return Path(path)
    try:
        from upath import UPath

        return UPath(path)
    except ImportError as e:
        raise DataError(f"--{flag}={path}: reading object storage needs {e.name or 'universal_pathlib'}: "
                        "pip install 'fms-fsdp[storage]'", every_rank=True) from None
    except ValueError as e:  # no fsspec filesystem for this protocol
        raise DataError(f"--{flag}={path}: {first_line(e)}", every_rank=True) from None


def open_random(path: Path) -> Any:
    """A file for random reads: memory-mapped when local (its pages stay the kernel's file cache),
    read by ranges when remote."""
    return path.open("rb") if is_remote(path) else pa.memory_map(str(path))


def mtime_ns(path: Path) -> int:
    stat = path.stat()
    return getattr(stat, "st_mtime_ns", None) or int(stat.st_mtime * 1e9)
