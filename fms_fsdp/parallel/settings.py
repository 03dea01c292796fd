"""The parallelism settings: the mesh's, `parallelize`'s, the model build's, the pipeline's and the attention's
flags, built once at start-up (settings.py); light to import (no model)."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple, Optional

from fms_fsdp.model.float8 import Float8Settings


@dataclass(frozen=True, kw_only=True)
class MeshSettings:
    """The flags that lay out the mesh and what tensor and context parallelism must divide or refuse
    (built once: settings.py)."""

    pp: int  # --pipeline_parallel_size
    tp: int  # --tensor_parallel_size
    cp: int  # --context_parallel_size
    ep: int = 1  # --expert_parallel_size
    sharding_strategy: str
    sharding_group_size: Optional[int]
    seq_length: int
    cp_attention: str
    document_masking: bool
    mixed_precision: bool
    compile: bool  # --use_torch_compile
    float8: bool
    lora: bool  # --lora_rank given


@dataclass(frozen=True, kw_only=True)
class ParallelSettings:
    """The flags `parallelize` reads: activation checkpointing (the fraction of blocks, None when off,
    and --ac_mode), compile, bf16, float8 (None when off), expert parallelism."""

    checkpointing: Optional[Fraction]
    ac_mode: str
    compile: bool
    mixed_precision: bool
    float8: Optional[Float8Settings]
    ep: int = 1  # --expert_parallel_size
    cpu_offload: bool = False  # --cpu_offload

    @property
    def per_op_checkpointing(self) -> bool:
        """Activation checkpointing on, per op (--ac_mode=op)."""
        return self.checkpointing is not None and self.ac_mode == "op"


@dataclass(frozen=True, kw_only=True)
class PipelineSettings:
    """The pipeline flags, and those it does not combine with yet (built once: settings.py)."""

    size: int  # --pipeline_parallel_size
    schedule: str
    stages_per_rank: int  # --pipeline_stages_per_rank (0: the schedule's default)
    microbatches: int  # --pipeline_microbatches (0: the fewest that serve)
    split: Optional[str]  # --pipeline_split
    batch_size: int
    variant: str  # --model_variant
    grad_accum_steps: int
    harness: bool  # --eval_harness_tasks given
    evaluates: bool  # --eval_interval > 0: held-out evaluation through the stages
    eval_batch_size: Optional[int]


@dataclass(frozen=True, kw_only=True)
class ModelSettings:
    """How a run builds its model (parallel/assemble.py): on the meta device first (--low_cpu_fsdp), its weights from --seed,
    the head's z-loss weight, a sparse model's routing."""

    low_cpu: bool  # --low_cpu_fsdp
    seed: int
    z_loss_weight: float
    moe_aux_loss_weight: float = 0.0
    moe_z_loss_weight: float = 0.0
    moe_capacity_factor: float = 0.0  # 0: dropless
    moe_kernel: str = "auto"  # the experts' matmuls: auto, grouped or loop


@dataclass(frozen=True, kw_only=True)
class AttentionSettings:
    """The attention flags (built once: settings.py)."""

    eos: Optional[int]  # --document_masking: documents end at --eos_token; None: lines are plain causal
    restart_positions: bool  # --document_positions=document
    compile: bool  # --use_torch_compile: FlexAttention's kernels are compiled
    ring: bool  # --cp_attention=ring


class MeshShape(NamedTuple):
    """Sizes of the mesh dimensions: pipeline parallel (pp, outermost), data parallel (replicate x
    shard), context parallel (cp) and tensor parallel (tp, innermost)."""

    replicate: int
    shard: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1  # experts spread over ep ranks of each shard group (not a mesh dimension: expert_mesh)

    @property
    def dp(self) -> int:
        return self.replicate * self.shard

    def dims(self) -> list[tuple[str, int]]:
        """The mesh's dimensions, outermost first: pp where used, replicate, shard, then cp and tp where
        used."""
        return (
            [("pp", self.pp)] * (self.pp > 1)
            + [("replicate", self.replicate), ("shard", self.shard)]
            + [("cp", self.cp)] * (self.cp > 1)
            + [("tp", self.tp)] * (self.tp > 1)
        )

    @property
    def whole(self) -> bool:
        """One rank per pipeline stage: the plain module (or stage) is trained, without FSDP."""
        return self.dp * self.tp * self.cp == 1
