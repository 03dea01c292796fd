"""The DeviceMesh: its shape from the flags (`MeshShape`: pipeline, replicate, shard, context and
tensor parallel dimensions), the checks of what tensor and context parallelism need, and the mesh's
sub-meshes (data parallel, a stage's ranks)."""

from __future__ import annotations

from typing import Optional

import torch
from fms.models.llama import LLaMAConfig
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fms_fsdp.compat import (
    context_parallel_compiles,
    flatten_mesh,
    joined_meshes,
    set_group_timeout,
)
from fms_fsdp.errors import ConfigError
from fms_fsdp.model.shapes import hidden_dim
from fms_fsdp.parallel.process_group import collective_timeout
from fms_fsdp.parallel.settings import MeshSettings, MeshShape


def mesh_shape(settings: MeshSettings, world_size: int, local_world_size: int) -> MeshShape:
    """The mesh for the sharding strategy and --tensor_parallel_size; ConfigError naming the numbers
    when they don't divide. HSDP's shard group (--sharding_group_size, default: the node) counts
    data-parallel ranks: with TP, a node holds ranks per node / T of them. Pipeline parallelism takes
    the outermost factor P of the world; the rest is laid out inside each stage's world / P ranks."""
    pp = settings.pp
    if world_size % pp:
        raise ConfigError(f"--pipeline_parallel_size={pp} must divide the world size {world_size}")
    # each pipeline stage's ranks: what the rest is laid out over
    world = f"world size {world_size}" + (f" / --pipeline_parallel_size={pp}" if pp > 1 else "")
    world_size //= pp
    world += f" = {world_size}" if pp > 1 else ""
    tp, cp = settings.tp, settings.cp
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
    if settings.sharding_strategy == "fsdp":
        return _with_experts(MeshShape(1, dp, tp, cp, pp), settings.ep)
    if settings.sharding_strategy == "ddp":
        return _with_experts(MeshShape(dp, 1, tp, cp, pp), settings.ep)
    group = settings.sharding_group_size or max(1, min(dp, local_world_size // (tp * cp)))  # a stage of a node
    if dp % group:
        raise ConfigError(
            f"--sharding_group_size={group} does not divide the {world}"
            + (f" / --tensor_parallel_size={tp} = {dp} data-parallel ranks" if tp > 1 else "")
            + "; pick a divisor (default: ranks per node"
            + (f" / {tp}" if tp > 1 else "")
            + ")"
        )
    return _with_experts(MeshShape(dp // group, group, tp, cp, pp), settings.ep)


def _with_experts(shape: MeshShape, ep: int) -> MeshShape:
    """`shape` with --expert_parallel_size=ep, which must divide its FSDP shard group; ConfigError naming
    both numbers."""
    if ep > 1 and shape.shard % ep:
        raise ConfigError(
            f"--expert_parallel_size={ep} must divide the FSDP shard group ({shape.shard} ranks"
            + (": with --sharding_strategy=ddp there is none; use fsdp or hsdp" if shape.shard == 1 else "")
            + ")"
        )
    return shape._replace(ep=ep)


def check_cpu_offload(shape: MeshShape, offload: bool) -> None:
    """ConfigError when --cpu_offload has no FSDP to offload: one rank per pipeline stage trains the module
    itself."""
    if offload and shape.whole:
        raise ConfigError(
            "--cpu_offload moves FSDP's shards to the host, but one rank per pipeline stage trains without FSDP; "
            "drop it, or train on more ranks"
        )


def check_context_parallel(settings: MeshSettings, device: torch.device) -> None:
    """--context_parallel_size=C cuts every line into 2C equal chunks (and, under tensor parallelism,
    each rank's part again T ways): ConfigError naming the numbers, or a setting it does not serve."""
    cp, tp, seq_length = settings.cp, settings.tp, settings.seq_length
    if cp == 1:
        return
    if settings.cp_attention == "ring" and settings.document_masking:
        raise ConfigError(
            "--cp_attention=ring passes keys and values round the ranks for causal lines only: "
            "--document_masking=True needs --cp_attention=allgather"
        )
    if settings.cp_attention == "ring" and device.type == "cuda" and not settings.mixed_precision:
        raise ConfigError(
            "--cp_attention=ring runs CUDA's flash attention, which takes bf16: set --mixed_precision=True "
            "or --cp_attention=allgather"
        )
    if seq_length % (2 * cp):
        raise ConfigError(
            f"--context_parallel_size={cp} cuts each line into 2 x {cp} = {2 * cp} chunks: --seq_length="
            f"{seq_length} must be a multiple of {2 * cp}"
        )
    if (seq_length // cp) % tp:
        raise ConfigError(
            f"--context_parallel_size={cp} x --tensor_parallel_size={tp}: each rank's {seq_length // cp} "
            f"tokens of a line must divide by {tp} (sequence parallel); pick a --seq_length that does"
        )
    if settings.compile and not context_parallel_compiles():
        raise ConfigError(
            f"--context_parallel_size={cp} with --use_torch_compile=True needs torch 2.13 or later (torch "
            f"{torch.__version__} computes wrong gradients there); set --use_torch_compile=False or upgrade torch"
        )


def check_tensor_parallel(settings: MeshSettings, model_config: LLaMAConfig) -> None:
    """--tensor_parallel_size=T splits heads, KV heads, the FFN width, the vocabulary and the sequence
    (sequence parallel) T ways: ConfigError naming the first that T does not divide, or a feature that
    does not combine with it yet."""
    tp = settings.tp
    if tp == 1:
        return
    for what, n in (
        ("attention heads", model_config.nheads),
        ("KV heads", model_config.kvheads),
        ("FFN width", hidden_dim(model_config)),
        ("vocabulary size", model_config.src_vocab_size),
        ("sequence length (--seq_length)", settings.seq_length),
    ):
        if n % tp:
            raise ConfigError(f"--tensor_parallel_size={tp} must divide the model's {what}, {n}; pick a divisor")
    for flag, used in (
        ("--float8", settings.float8),
        ("--lora_rank", settings.lora),
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
    # the group FSDP gathers and reduces over, made now on every rank (dp_mesh finds it again)
    shard_cp = flatten_mesh(mesh, ("shard", "cp"), "shard_cp") if shape.cp > 1 else None
    timeout = collective_timeout(timeout_minutes)
    if timeout is not None:
        for dim in range(mesh.ndim):
            set_group_timeout(timeout, mesh.get_group(dim))
        if shard_cp is not None:
            set_group_timeout(timeout, shard_cp.get_group())
    return mesh


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The (replicate, shard) mesh FSDP2 runs over, of this rank's pipeline stage: (replicate,
    shard_cp) under context parallelism."""
    names = mesh.mesh_dim_names or ()
    if "cp" in names:
        return joined_meshes(mesh["replicate"], flatten_mesh(mesh, ("shard", "cp"), "shard_cp"))
    return mesh["replicate", "shard"] if "tp" in names or "pp" in names else mesh


def stage_ranks(mesh: DeviceMesh) -> int:
    """The ranks of this rank's pipeline stage (the whole mesh without pipeline parallelism)."""
    names = mesh.mesh_dim_names or ()
    return mesh.size() // (mesh.size(names.index("pp")) if "pp" in names else 1)


def sharded(mesh: DeviceMesh) -> bool:
    """Whether FSDP shards the parameters (over more than one rank of a replica)."""
    return dp_mesh(mesh).size(1) > 1
