"""The memory plan's settings: what it varies (the micro-batch, the activation checkpointing) and the
flags it reads; light to import (no model, no plan)."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

from fms_fsdp.model.lora import LoRASpec

# bytes an element of AdamW's state takes: fp32, or torchao's 8-bit states (a byte, and an fp32 scale per
# block of 256; tensors under 4096 elements stay fp32, a small share left out here)
STATE_BYTES = {"fp32": 4.0, "int8": 1 + 4 / 256}


def state_share(dtype: str) -> float:
    """AdamW's state in --optimizer_state_dtype=`dtype`, as a share of its bytes in fp32."""
    return STATE_BYTES[dtype] / STATE_BYTES["fp32"]


@dataclass(frozen=True, kw_only=True)
class Setting:
    """What the plan varies: the micro-batch and the activation checkpointing."""

    batch: int
    checkpointing: bool
    fraction: Fraction
    mode: str

    def flags(self) -> str:
        if not self.checkpointing or self.fraction == 0:
            return f"--batch_size={self.batch} --fsdp_activation_checkpointing=False"
        return (
            f"--batch_size={self.batch} --fsdp_activation_checkpointing=True "
            f"--selective_checkpointing={self.fraction} --ac_mode={self.mode}"
        )


@dataclass(frozen=True, kw_only=True)
class MemorySettings:
    """The flags the plan reads (built once: settings.py)."""

    setting: Setting  # the run's: --batch_size and its activation checkpointing (the fraction parsed once)
    variant: str
    vocab_size: Optional[int]  # --vocab_size, None for the variant's
    seq_length: int
    mixed_precision: bool
    device: str  # --device: a plan is for a GPU unless it is "cpu"
    compile: bool
    document_masking: bool
    cp_attention: str
    muon: bool  # --optimizer=muon
    lora: Optional[LoRASpec]
    device_gib: Optional[float]  # --plan_device_memory_gib
    cpu_offload: bool = False  # --cpu_offload: parameters, gradients and optimizer state on the host
    ema: bool = False  # --ema_decay: a weight average beside the optimizer's state
    ema_on_host: bool = False  # --ema_on_host: that average in host memory
    optimizer_state_dtype: str = "fp32"  # AdamW's state: fp32, or torchao's int8 (STATE_BYTES)
    skip_bad_steps: bool = False  # --skip_bad_steps: torch's fused AdamW (no 8-bit states suggested)
