"""How the model is parallelised: the DeviceMesh, tensor parallelism (with sequence and loss parallel),
float8 Linear layers (model/float8.py), selective activation checkpointing, per-block torch.compile (and the
compiled loss), FSDP2 (fully_shard) with bf16 mixed precision, and gradient sync under accumulation.
fsdp, hsdp and ddp are all FSDP2 over a (replicate, shard) mesh of different shapes; with
--tensor_parallel_size=T an innermost dimension 'tp' holds the T ranks (of one node) that split
every layer, and with --context_parallel_size=C a dimension 'cp' before it the C ranks that split
every line (parallel/attention.py); FSDP shards over shard x cp (flattened as 'shard_cp', as torchtitan does),
so the C ranks share the parameters' memory, and data parallelism runs over replicate x shard. With
--pipeline_parallel_size=P an outermost dimension 'pp' holds the pipeline's stages (parallel/pipeline.py): each
stage's world / P ranks are laid out as above, its modules wrapped as above with each stage an FSDP
root. A run of one rank (per stage) trains the plain module (as torchtitan does on one GPU): no FSDP
parameter copies in and out, bf16 through autocast over fp32 master weights.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from fms.models.llama import LLaMA
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Shard

from fms_fsdp.model.float8 import convert_to_float8
from fms_fsdp.model.loss import chunk_loss
from fms_fsdp.model.moe import MoEFeedForward
from fms_fsdp.parallel.activation_checkpointing import apply_activation_checkpointing
from fms_fsdp.parallel.expert_parallel import apply_expert_parallel, expert_mesh
from fms_fsdp.parallel.mesh import dp_mesh, sharded, stage_ranks
from fms_fsdp.parallel.pipeline import blocks_of
from fms_fsdp.parallel.settings import ParallelSettings
from fms_fsdp.parallel.tensor_parallel import apply_tensor_parallel


def apply_fsdp(
    model: LLaMA,
    mesh: DeviceMesh,
    mixed_precision: bool,
    roots: Optional[list[nn.Module]] = None,
    experts: Optional[DeviceMesh] = None,
    offload: bool = False,
) -> None:
    """FSDP units, each all-gathered just before use and freed after: the embedding, every block, the
    final norm with the head, and the roots (the model, or a pipeline rank's stages; left with nothing
    but buffers). The last block and the head are used again first thing in backward, so they stay
    gathered after forward. A model whose head shares the embedding's weight keeps both in the root.
    A sparse block's experts are sharded by their rows, not by expert; under expert parallelism
    (`experts`: expert_mesh) a unit of their own, over the ranks that hold the same experts. `offload`
    (--cpu_offload): every unit's shards, gradients and so the optimizer's state on the host."""
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision
        else MixedPrecisionPolicy()
    )
    # pinned host memory where the copies go to a GPU
    held = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if offload else OffloadPolicy()
    unit: dict[str, Any] = {"mp_policy": mp, "offload_policy": held}
    tied = model.config.tie_heads
    if not tied and model.base_model.embedding is not None:
        fully_shard(model.base_model.embedding, mesh=mesh, **unit)
    blocks = blocks_of(model)
    for i, block in enumerate(blocks):
        last = i == len(blocks) - 1
        if experts is not None:
            _shard_experts(block, experts, unit, reshard=not last)
        fully_shard(block, mesh=mesh, reshard_after_forward=not last, shard_placement_fn=_expert_rows, **unit)
    if not tied and model.head is not None:
        fully_shard([model.base_model.dec_norm, model.head], mesh=mesh, reshard_after_forward=False, **unit)
    for root in roots or [model]:
        fully_shard(root, mesh=mesh, **unit)


def _shard_experts(block: nn.Module, mesh: DeviceMesh, unit: dict[str, Any], reshard: bool) -> None:
    """A sparse block's experts (spread over mesh['ep']) sharded by rows over the ranks holding the same
    experts, mesh['replicate', 'efsdp'], which average their gradients."""
    for layer in block.modules():
        if isinstance(layer, MoEFeedForward):
            fully_shard(
                layer.cond_ffn,
                mesh=mesh["replicate", "efsdp"],
                reshard_after_forward=reshard,
                shard_placement_fn=_expert_rows,
                **unit,
            )


def _expert_rows(param: nn.Parameter) -> Optional[Shard]:
    """A sparse block's stacked expert weights [experts, rows, columns] are sharded by their rows: there
    are fewer experts than ranks. Every other parameter by its first dimension (FSDP's default)."""
    return Shard(1) if param.dim() == 3 else None


class Autocast(nn.Module):
    """Mixed into the model's class in place (apply_autocast) where no FSDP casts its parameters (one
    rank): its forward, the loss included, runs under bf16 autocast while the parameters stay fp32, the
    optimizer's master weights. Each weight's bf16 copy is made at its use and kept only where autograd
    saves it (no cast cache: a checkpointed block's copies are freed with its activations and made
    again in backward).

    Why a class swap (as Checkpointed and fully_shard do): a module wrapped around the model would
    prefix every parameter's name (checkpoint and export keys) and hide the model's type and the
    attributes the loop, checkpoints and exports read (config, base_model, head); a forward pre-hook
    and post-hook pair cannot hold the `with torch.autocast(...)` block (a forward that raises would
    leave autocast on). The model stays an instance of its class with the same state_dict; its forward
    is the class's, under autocast (tests/test_parallel.py)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        device = next(self.parameters()).device.type
        with torch.autocast(device, dtype=torch.bfloat16, cache_enabled=False):
            return super().forward(*args, **kwargs)


def apply_autocast(module: nn.Module) -> None:
    """bf16 compute for a model (or a pipeline stage) without FSDP (see Autocast)."""
    cls = type(module)
    module.__class__ = type(f"Autocast{cls.__name__}", (Autocast, cls), {})


def apply_compile(model: LLaMA) -> None:
    """torch.compile every block whole (fullgraph: a graph break is an error, not a slow step; a sparse
    block breaks its graph where the experts' sizes reach the host) and the loss's chunk function (its
    fp32 upcast, log-softmax and gradient fused)."""
    for block in blocks_of(model):
        block.compile(fullgraph=not isinstance(block.ff_sub_layer, MoEFeedForward))
    if model.head is not None:
        model.head.chunk_fn = torch.compile(chunk_loss, fullgraph=True)


class Parallelized(NamedTuple):
    checkpointed: Optional[int]  # blocks whose activations are checkpointed; None when off
    float8: int  # Linear layers converted to float8


def parallelize(
    model: LLaMA, settings: ParallelSettings, mesh: DeviceMesh, roots: Optional[list[nn.Module]] = None
) -> Parallelized:
    """Tensor parallelism, float8 conversion, activation checkpointing, then compile, then FSDP2, in
    torchtitan's order; on a mesh of one rank no FSDP, bf16 through autocast (`Autocast`). `roots` are
    the modules whose forward is called (the model, or a pipeline rank's stages)."""
    roots = roots or [model]
    if "tp" in (mesh.mesh_dim_names or ()):
        apply_tensor_parallel(model, mesh["tp"])
    experts = expert_mesh(mesh, settings.ep) if settings.ep > 1 else None
    if experts is not None:
        apply_expert_parallel(blocks_of(model), experts)
    n_float8 = 0
    if settings.float8 is not None:
        n_float8 = convert_to_float8(model, settings.float8, mesh.device_type, sharded(mesh))
    n_ckpt = None
    if settings.checkpointing is not None:
        n_ckpt = apply_activation_checkpointing(model, settings.checkpointing, settings.ac_mode)
    if settings.compile:
        apply_compile(model)
    if stage_ranks(mesh) > 1:
        apply_fsdp(model, dp_mesh(mesh), settings.mixed_precision, roots, experts, settings.cpu_offload)
    elif settings.mixed_precision:
        for root in roots:
            apply_autocast(root)
    return Parallelized(n_ckpt, n_float8)


def set_gradient_sync(model: nn.Module, last_micro_batch: bool) -> None:
    """Before each micro-batch's backward. Sharded gradients are reduce-scattered every micro-batch, so
    accumulation holds one micro-batch's unsharded gradients at a time; only HSDP's all-reduce across
    replicas waits for the last (the shards accumulate in FSDP's buffer meanwhile). Without sharding
    (ddp) the gradients are whole anyway: they accumulate locally and are all-reduced once. A model
    without FSDP (one rank) has nothing to sync."""
    if not isinstance(model, FSDPModule):
        return
    mesh = next(p for p in model.parameters()).device_mesh
    if mesh.size(1) == 1:  # (replicate, shard or shard_cp[, tp])
        model.set_requires_gradient_sync(last_micro_batch)
    elif mesh.size(0) > 1:
        model.set_requires_all_reduce(last_micro_batch)
