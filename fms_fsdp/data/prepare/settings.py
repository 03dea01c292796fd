"""--cache_dir's settings: what a run tokenizes before its first step, and on which Ray (cache_dir.py). A
leaf the loader's settings import without the preparation itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from fms_fsdp.storage import is_remote


@dataclass(frozen=True, kw_only=True)
class RaySettings:
    """--ray_address, --ray_start_workers, --ray_auto_start_cluster (Levanter's names)."""

    address: Optional[str] = None
    start_workers: bool = False
    auto_start_cluster: bool = False


@dataclass(frozen=True, kw_only=True)
class CacheSettings:
    """--cache_dir, and how its raw text is tokenized: --tokenizer_path, --text_field, the Ray settings,
    and when (--cache_build: beside the training, first, or by another job: external), and by how many
    processes of rank 0's pool (--cache_workers; None: the node's spare CPUs)."""

    cache_dir: str
    tokenizer_path: str
    text_field: str = "text"
    build: str = "beside"
    workers: Optional[int] = None
    ray: RaySettings = RaySettings()

    @property
    def beside(self) -> bool:
        """Whether the run trains while the cache is built (a local cache not built on the job's own Ray)."""
        return self.build != "first" and not is_remote(self.cache_dir) and not self.ray.start_workers
