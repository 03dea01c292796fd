"""How the model is parallelised: the DeviceMesh, tensor parallelism (with sequence and loss parallel),
float8 Linear layers (float8.py), selective activation checkpointing, per-block torch.compile (and the
compiled loss), FSDP2 (fully_shard) with bf16 mixed precision, and gradient sync under accumulation.
fsdp, hsdp and ddp are all FSDP2 over a (replicate, shard) mesh of different shapes; with
--tensor_parallel_size=T an innermost dimension 'tp' holds the T ranks (of one node) that split
every layer, and with --context_parallel_size=C a dimension 'cp' before it the C ranks that split
every line (attention.py); FSDP shards over shard x cp (flattened as 'shard_cp', as torchtitan does),
so the C ranks share the parameters' memory, and data parallelism runs over replicate x shard. With
--pipeline_parallel_size=P an outermost dimension 'pp' holds the pipeline's stages (pipeline.py): each
stage's world / P ranks are laid out as above, its modules wrapped as above with each stage an FSDP
root. A run of one rank (per stage) trains the plain module (as torchtitan does on one GPU): no FSDP
parameter copies in and out, bf16 through autocast over fp32 master weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from functools import partial
from typing import Any, Callable, NamedTuple, Optional

import torch
from fms.models.llama import LLaMA, LLaMAConfig
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts, noop_context_fn

from fms_fsdp.compat import (
    context_parallel_compiles,
    flatten_mesh,
    matmul_and_attention_ops,
    reduce_scatter_op,
    set_group_timeout,
)
from fms_fsdp.config import parse_fraction, train_config
from fms_fsdp.context_parallel import RING_ATTENTION
from fms_fsdp.distributed import collective_timeout
from fms_fsdp.errors import ConfigError
from fms_fsdp.float8 import Float8Settings, convert_to_float8
from fms_fsdp.loss import chunk_loss
from fms_fsdp.models import hidden_dim


class MeshShape(NamedTuple):
    """Sizes of the mesh dimensions: pipeline parallel (pp, outermost), data parallel (replicate x
    shard), context parallel (cp) and tensor parallel (tp, innermost)."""

    replicate: int
    shard: int
    tp: int = 1
    cp: int = 1
    pp: int = 1

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


def mesh_shape(cfg: train_config, world_size: int, local_world_size: int) -> MeshShape:
    """The mesh for the sharding strategy and --tensor_parallel_size; ConfigError naming the numbers
    when they don't divide. HSDP's shard group (--sharding_group_size, default: the node) counts
    data-parallel ranks: with TP, a node holds ranks per node / T of them. Pipeline parallelism takes
    the outermost factor P of the world; the rest is laid out inside each stage's world / P ranks."""
    pp = cfg.pipeline_parallel_size
    if world_size % pp:
        raise ConfigError(f"--pipeline_parallel_size={pp} must divide the world size {world_size}")
    # each pipeline stage's ranks: what the rest is laid out over
    world = f"world size {world_size}" + (f" / --pipeline_parallel_size={pp}" if pp > 1 else "")
    world_size //= pp
    world += f" = {world_size}" if pp > 1 else ""
    tp, cp = cfg.tensor_parallel_size, cfg.context_parallel_size
    if tp > 1 and (local_world_size % tp or world_size % tp):
        raise ConfigError(
            f"--tensor_parallel_size={tp} must divide the ranks per node ({local_world_size}) and the "
            f"{world}: tensor parallelism stays inside a node"
        )
    if (world_size // tp) % cp:
        raise ConfigError(
            f"--context_parallel_size={cp} must divide the {world}"
            + (f" / --tensor_parallel_size={tp} = {world_size // tp}" if tp > 1 else "")
        )
    dp = world_size // (tp * cp)
    if cfg.sharding_strategy == "fsdp":
        return MeshShape(1, dp, tp, cp, pp)
    if cfg.sharding_strategy == "ddp":
        return MeshShape(dp, 1, tp, cp, pp)
    group = cfg.sharding_group_size or max(1, min(dp, local_world_size // (tp * cp)))  # a stage of a node
    if dp % group:
        raise ConfigError(
            f"--sharding_group_size={group} does not divide the {world}"
            + (f" / --tensor_parallel_size={tp} = {dp} data-parallel ranks" if tp > 1 else "")
            + "; pick a divisor (default: ranks per node"
            + (f" / {tp}" if tp > 1 else "")
            + ")"
        )
    return MeshShape(dp // group, group, tp, cp, pp)


def check_context_parallel(cfg: train_config, device: torch.device) -> None:
    """--context_parallel_size=C cuts every line into 2C equal chunks (and, under tensor parallelism,
    each rank's part again T ways): ConfigError naming the numbers, or a setting it does not serve."""
    cp, tp = cfg.context_parallel_size, cfg.tensor_parallel_size
    if cp == 1:
        return
    if cfg.cp_attention == "ring" and cfg.document_masking:
        raise ConfigError(
            "--cp_attention=ring passes keys and values round the ranks for causal lines only: "
            "--document_masking=True needs --cp_attention=allgather"
        )
    if cfg.cp_attention == "ring" and device.type == "cuda" and not cfg.mixed_precision:
        raise ConfigError(
            "--cp_attention=ring runs CUDA's flash attention, which takes bf16: set --mixed_precision=True "
            "or --cp_attention=allgather"
        )
    if cfg.seq_length % (2 * cp):
        raise ConfigError(
            f"--context_parallel_size={cp} cuts each line into 2 x {cp} = {2 * cp} chunks: --seq_length="
            f"{cfg.seq_length} must be a multiple of {2 * cp}"
        )
    if (cfg.seq_length // cp) % tp:
        raise ConfigError(
            f"--context_parallel_size={cp} x --tensor_parallel_size={tp}: each rank's {cfg.seq_length // cp} "
            f"tokens of a line must divide by {tp} (sequence parallel); pick a --seq_length that does"
        )
    if cfg.use_torch_compile and not context_parallel_compiles():
        raise ConfigError(
            f"--context_parallel_size={cp} with --use_torch_compile=True needs torch 2.13 or later (torch "
            f"{torch.__version__} computes wrong gradients there); set --use_torch_compile=False or upgrade torch"
        )


def check_tensor_parallel(cfg: train_config, model_config: LLaMAConfig) -> None:
    """--tensor_parallel_size=T splits heads, KV heads, the FFN width, the vocabulary and the sequence
    (sequence parallel) T ways: ConfigError naming the first that T does not divide, or a feature that
    does not combine with it yet."""
    tp = cfg.tensor_parallel_size
    if tp == 1:
        return
    for what, n in (
        ("attention heads", model_config.nheads),
        ("KV heads", model_config.kvheads),
        ("FFN width", hidden_dim(model_config)),
        ("vocabulary size", model_config.src_vocab_size),
        ("sequence length (--seq_length)", cfg.seq_length),
    ):
        if n % tp:
            raise ConfigError(f"--tensor_parallel_size={tp} must divide the model's {what}, {n}; pick a divisor")
    for flag, used in (
        ("--float8", cfg.float8),
        ("--lora_rank", cfg.lora_rank),
        ("a head tied to the embedding", model_config.tie_heads),
    ):
        if used:
            raise ConfigError(
                f"--tensor_parallel_size={tp} does not combine with {flag} yet; use "
                "--tensor_parallel_size=1 (FSDP/HSDP) for it"
            )


def build_mesh(shape: MeshShape, device: torch.device, timeout_minutes: Optional[float]) -> DeviceMesh:
    """The mesh ('pp' first under pipeline parallelism, then 'replicate', 'shard'), then 'cp' under
    context parallelism (with 'shard_cp' flattened from shard x cp for FSDP) and 'tp' innermost under
    tensor parallelism, whose groups fail a
    collective after --collective_timeout_minutes, as the default group does (torchtitan sets its
    groups' timeouts alike)."""
    dims = shape.dims()
    names = tuple(name for name, _ in dims)
    mesh = init_device_mesh(device.type, tuple(size for _, size in dims), mesh_dim_names=names)
    if shape.cp > 1:
        flatten_mesh(mesh, ("shard", "cp"), "shard_cp")
    timeout = collective_timeout(timeout_minutes)
    if timeout is not None:
        for dim in range(mesh.ndim):
            set_group_timeout(timeout, mesh.get_group(dim))
        if shape.cp > 1:  # the group FSDP gathers and reduces over
            set_group_timeout(timeout, mesh["shard_cp"].get_group())
    return mesh


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The (replicate, shard) mesh FSDP2 runs over, of this rank's pipeline stage: (replicate,
    shard_cp) under context parallelism."""
    names = mesh.mesh_dim_names or ()
    if "cp" in names:
        return mesh["replicate", "shard_cp"]
    return mesh["replicate", "shard"] if "tp" in names or "pp" in names else mesh


def stage_ranks(mesh: DeviceMesh) -> int:
    """The ranks of this rank's pipeline stage (the whole mesh without pipeline parallelism)."""
    names = mesh.mesh_dim_names or ()
    return mesh.size() // (mesh.size(names.index("pp")) if "pp" in names else 1)


def sharded(mesh: DeviceMesh) -> bool:
    """Whether FSDP shards the parameters (over more than one rank of a replica)."""
    return dp_mesh(mesh).size(1) > 1


# the Linear layers of a block that tensor parallelism splits by output features (the weight's rows:
# each rank its heads, its slice of the FFN width) and by input features (the weight's columns)
TP_COLWISE = ("attn.in_proj.query", "attn.in_proj.key", "attn.in_proj.value", "ff_sub_layer.wg", "ff_sub_layer.w1")
TP_ROWWISE = ("attn.dense", "ff_sub_layer.w2")


def apply_tensor_parallel(model: LLaMA, tp_mesh: DeviceMesh) -> None:
    """Split every layer over the `tp_mesh` ranks (Megatron's plan, as torchtitan writes it): q, k, v and
    the FFN's gate and up projections column-wise (each rank its heads, its slice of the width), the
    attention output and FFN down projection row-wise; the norms and the residual stream split over the
    sequence (sequence parallel: gathered before attention and the FFN, reduce-scattered after); the
    embedding and the head split over the vocabulary (the head's loss reduced over it: loss.py).
    The model must be built unfused (fms's fused_weights=False)."""
    tp = tp_mesh.size()
    if model.base_model.embedding is not None:  # (a later pipeline stage has none)
        parallelize_module(
            model.base_model.embedding, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
        )
    for block in blocks_of(model):
        parallelize_module(
            block,
            tp_mesh,
            {
                "ln": SequenceParallel(),
                "attn": PrepareModuleInput(
                    input_kwarg_layouts={"q": Shard(1)}, desired_input_kwarg_layouts={"q": Replicate()}
                ),
                "ff_ln": SequenceParallel(),
                "ff_sub_layer": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                **{name: ColwiseParallel() for name in TP_COLWISE},
                **{name: RowwiseParallel(output_layouts=Shard(1)) for name in TP_ROWWISE},
            },
        )
        block.attn.nheads //= tp  # fms shapes q, k, v by these: each rank computes its own heads
        block.attn.kvheads //= tp
    if model.head is not None:  # (nor does an earlier one a head)
        parallelize_module(model.base_model.dec_norm, tp_mesh, SequenceParallel())
        model.head.weight = nn.Parameter(distribute_tensor(model.head.weight.data, tp_mesh, [Shard(0)]))


def blocks_of(model: LLaMA) -> list[nn.Module]:
    """The model's blocks in order: all of them, or a pipeline rank's (pipeline.prune keeps them in a
    ModuleDict under their whole-model numbers)."""
    layers = model.base_model.layers
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


def checkpointed_blocks(n_blocks: int, fraction: Fraction) -> list[bool]:
    """fms-fsdp's selective pattern: block i (from 1) is checkpointed when i*p reaches a cut-off that
    starts at 1/2 and grows by 1 at each checkpointed block."""
    cutoff, chosen = Fraction(1, 2), []
    for i in range(1, n_blocks + 1):
        take = fraction > 0 and i * fraction >= cutoff
        cutoff += take
        chosen.append(take)
    return chosen


# kept by --ac_mode=op: the outputs of matmuls and attention (ring attention's op whole: its K/V
# exchanges are not redone either; and, under tensor parallelism, of the sequence-parallel
# reduce-scatters, as torchtitan keeps them: not redone in backward); everything else is recomputed
_OP_MODE_SAVED = [*matmul_and_attention_ops(), reduce_scatter_op(), RING_ATTENTION]
_CONTEXTS: dict[str, Callable[[], Any]] = {
    "block": noop_context_fn,
    "op": partial(create_selective_checkpoint_contexts, _OP_MODE_SAVED),
}


class Checkpointed(nn.Module):
    """Mixed into a block's class in place (`block.__class__ = checkpointed_class(...)`, as fully_shard
    mixes FSDPModule into the classes it shards): its forward runs under non-reentrant
    torch.utils.checkpoint.

    Why a class swap: torch's public checkpoint_wrapper puts the block inside a module of its own,
    which inserts `_checkpoint_wrapped_module` into every parameter's name, so checkpoints, exports and
    --ckpt_load_path would need their keys remapped both ways; torch's name-keeping, hook-based
    checkpoint (torch.distributed._composable) is private API; and a forward patched onto the instance
    as a closure would, in a deep copy, still run the original's weights. The swapped block stays an
    instance of its class and keeps its parameters, their names and its other methods; it can be
    deep-copied (the copy runs its own weights) and compiled (dynamo traces the checkpoint as one
    region). tests/test_parallel.py checks each."""

    ac_context: Callable[[], Any] = noop_context_fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        context = type(self).ac_context
        if context is noop_context_fn:  # whole blocks: dynamo (2.13) cannot trace the default passed explicitly
            return checkpoint(super().forward, *args, use_reentrant=False, **kwargs)
        return checkpoint(super().forward, *args, use_reentrant=False, context_fn=context, **kwargs)


_CHECKPOINTED_CLASSES: dict[tuple[type, str], type] = {}


def checkpointed_class(cls: type, mode: str) -> type:
    """The subclass of `cls` whose forward is checkpointed under --ac_mode `mode` (made once)."""
    if (cls, mode) not in _CHECKPOINTED_CLASSES:
        _CHECKPOINTED_CLASSES[cls, mode] = type(
            f"Checkpointed{cls.__name__}", (Checkpointed, cls), {"ac_context": staticmethod(_CONTEXTS[mode])}
        )
    return _CHECKPOINTED_CLASSES[cls, mode]


def apply_activation_checkpointing(model: LLaMA, fraction: Fraction, mode: str = "block") -> int:
    """Recompute the chosen blocks' activations in backward: whole blocks, or (mode op) all but the
    matmul and attention outputs. Parameter names and checkpoint keys do not depend on the setting."""
    blocks = blocks_of(model)
    chosen = checkpointed_blocks(len(blocks), fraction)
    for block, take in zip(blocks, chosen):
        if take:
            block.__class__ = checkpointed_class(type(block), mode)
    return sum(chosen)


def apply_fsdp(model: LLaMA, mesh: DeviceMesh, mixed_precision: bool, roots: Optional[list[nn.Module]] = None) -> None:
    """FSDP units, each all-gathered just before use and freed after: the embedding, every block, the
    final norm with the head, and the roots (the model, or a pipeline rank's stages; left with nothing
    but buffers). The last block and the head are used again first thing in backward, so they stay
    gathered after forward. A model whose head shares the embedding's weight keeps both in the root."""
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision
        else MixedPrecisionPolicy()
    )
    tied = model.config.tie_heads
    if not tied and model.base_model.embedding is not None:
        fully_shard(model.base_model.embedding, mesh=mesh, mp_policy=mp)
    blocks = blocks_of(model)
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(blocks) - 1)
    if not tied and model.head is not None:
        fully_shard([model.base_model.dec_norm, model.head], mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    for root in roots or [model]:
        fully_shard(root, mesh=mesh, mp_policy=mp)


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
    """torch.compile every block whole (fullgraph: a graph break is an error, not a slow step) and the
    loss's chunk function (its fp32 upcast, log-softmax and gradient fused)."""
    for block in blocks_of(model):
        block.compile(fullgraph=True)
    if model.head is not None:
        model.head.chunk_fn = torch.compile(chunk_loss, fullgraph=True)


@dataclass(frozen=True)
class ParallelSettings:
    """The flags `parallelize` reads: activation checkpointing (the fraction of blocks, None when off,
    and --ac_mode), compile, bf16, float8 (None when off)."""

    checkpointing: Optional[Fraction]
    ac_mode: str
    compile: bool
    mixed_precision: bool
    float8: Optional[Float8Settings]

    @staticmethod
    def of(cfg: train_config) -> "ParallelSettings":
        fraction = parse_fraction("selective_checkpointing", cfg.selective_checkpointing)
        return ParallelSettings(
            fraction if cfg.fsdp_activation_checkpointing else None,
            cfg.ac_mode,
            cfg.use_torch_compile,
            cfg.mixed_precision,
            Float8Settings.of(cfg),
        )


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
    n_float8 = 0
    if settings.float8 is not None:
        n_float8 = convert_to_float8(model, settings.float8, mesh.device_type, sharded(mesh))
    n_ckpt = None
    if settings.checkpointing is not None:
        n_ckpt = apply_activation_checkpointing(model, settings.checkpointing, settings.ac_mode)
    if settings.compile:
        apply_compile(model)
    if stage_ranks(mesh) > 1:
        apply_fsdp(model, dp_mesh(mesh), settings.mixed_precision, roots)
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
