"""The settings of held-out evaluation (built from the flags once, in fms_fsdp/settings.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from fms_fsdp.data.shards import Layout
from fms_fsdp.data.stream import Packing


@dataclass(frozen=True, kw_only=True)
class EvalSettings:
    """--eval_data_path's evaluation: when (--eval_interval, and the last step), which datasets, how
    their documents become lines (as training frames them) and how many are scored."""

    interval: int  # --eval_interval (0: none)
    num_steps: int
    data_path: Optional[str]
    datasets: Optional[list[str]]  # --eval_datasets
    batch: int  # --eval_batch_size, else --batch_size (a pipeline's stages take batches of one shape)
    batches: int  # --eval_batches (0: every line)
    pipelined: bool  # --pipeline_parallel_size > 1
    layout: Optional[Layout]  # which files the datasets hold and how they are read (None: no evaluation)
    packing: Packing


@dataclass(frozen=True, kw_only=True)
class CheckpointEvalSettings:
    """What `fms-evaluate` evaluates: --ckpt_load_path's model on --eval_data_path and --eval_harness_tasks."""

    load_path: Optional[str]
    data: bool  # --eval_data_path given
    tasks: bool  # --eval_harness_tasks given
    pipeline_parallel_size: int
    lora: bool  # --lora_rank given
