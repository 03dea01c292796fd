"""The settings of checkpoints and exports (built from the flags once, in fms_fsdp/settings.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from fms_fsdp.checkpoint.policy import KeepPolicy
from fms_fsdp.model.lora import LoRASpec


@dataclass(frozen=True, kw_only=True)
class CheckpointSettings:
    """The flags of checkpoints: the keep policy, background saves, what a failed save does, and the
    weights a run starts from (--ckpt_load_path; with --lora_rank the base, loaded at every start)."""

    policy: KeepPolicy
    background: bool
    on_error: str
    load_path: Optional[str]
    lora: bool


@dataclass(frozen=True, kw_only=True)
class ExportSettings:
    """The flags of exports: --export_interval, --export_format, --export_keep; the tokenizer and the
    bos/eos tokens a Hugging Face folder records; a LoRA run's adapters and the base they adapt."""

    interval: int
    format: str
    keep: int
    tokenizer_path: Optional[str]
    bos: Optional[int]
    eos: Optional[int]
    lora: Optional[LoRASpec]
    base: Optional[str]
    ema: bool = False  # --export_ema: the weight average (weights/ema.py) is exported
