"""The settings of the training data (built from the flags once, in fms_fsdp/settings.py; read by
get_data_loader, data/make_loader.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from fms_fsdp.data.mixture import MixtureSchedule
from fms_fsdp.data.prepare.settings import CacheSettings
from fms_fsdp.data.shards import Layout
from fms_fsdp.data.stream import Packing
from fms_fsdp.ramp import Ramp


@dataclass(frozen=True, kw_only=True)
class DataSettings:
    """Which lines the loader reads and in what order: synthetic ones (--use_dummy_dataset), or the
    datasets under --data_path, mixed by --weights or --weights_schedule (parsed once: `schedule`), read
    as `layout` says, framed as `packing` says (its seq_length and vocabulary are the run's), raw text
    tokenized into --cache_dir first where `cache` is set."""

    use_dummy_dataset: bool
    batch_size: int
    seed: int
    data_path: str
    datasets: Optional[list[str]]  # --datasets (None: every dataset folder under data_path)
    weights: Optional[list[float]]  # --weights (None: the natural mixture, or the schedule's)
    schedule: Optional[MixtureSchedule]  # --weights_schedule
    layout: Layout
    packing: Packing
    logical_shards: int
    num_workers: int
    grad_accum_steps: int
    cache: Optional[CacheSettings]  # --cache_dir (None: raw text is tokenized as it is read)
    ramp: Optional[Ramp] = None  # --batch_size_schedule, --seq_length_schedule (None: batch_size x seq_length)
