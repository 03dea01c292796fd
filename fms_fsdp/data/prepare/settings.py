"""--cache_dir's settings: what a run tokenizes before its first step, and on which Ray (cache_dir.py). A
leaf the loader's settings import without the preparation itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True, kw_only=True)
class RaySettings:
    """--ray_address, --ray_start_workers, --ray_auto_start_cluster (Levanter's names)."""

    address: Optional[str] = None
    start_workers: bool = False
    auto_start_cluster: bool = False


@dataclass(frozen=True, kw_only=True)
class CacheSettings:
    """--cache_dir, and how its raw text is tokenized: --tokenizer_path, --text_field, the Ray settings."""

    cache_dir: str
    tokenizer_path: str
    text_field: str = "text"
    ray: RaySettings = RaySettings()
