"""Builds a run's model over its mesh, as training, evaluation and --dry_run's rehearsal build it: fms's
LLaMA (on the meta device with --low_cpu_fsdp), LoRA's adapters, pruned to this rank's pipeline stages,
parallelised (parallelize.py) and initialised to the same weights at any mesh (model/initialization.py); and
its optimizer and LR schedule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fms_fsdp.model.float8 import Float8Settings, scale_hook
from fms_fsdp.model.initialization import init_weights
from fms_fsdp.model.lora import LoRASpec, add_adapters
from fms_fsdp.model.moe import MoEConfig, Routing, RoutingStats
from fms_fsdp.model.variants import CausalLM, LLaMAConfig, build_model, count_params
from fms_fsdp.optim import OptimizerSettings, build_optimizer
from fms_fsdp.parallel.attention import LinePlan
from fms_fsdp.parallel.context_parallel import ContextParallel
from fms_fsdp.parallel.mesh import sharded
from fms_fsdp.parallel.parallelize import Parallelized, parallelize
from fms_fsdp.parallel.pipeline import Pipeline, PipelinePlan, blocks_of, prune
from fms_fsdp.parallel.settings import AttentionSettings, MeshShape, ModelSettings, ParallelSettings
from fms_fsdp.schedule import ScheduleSettings, build_scheduler


@dataclass(frozen=True, kw_only=True)
class ModelBuild:
    """What building the model over a mesh reads: the variant and its config, the build's, LoRA's,
    attention's and parallelism's settings, the mesh's shape and pipeline plan, and the run's device."""

    variant: str  # --model_variant, for the start-up line
    model_config: LLaMAConfig
    model: ModelSettings
    lora: Optional[LoRASpec]  # None without --lora_rank
    attention: AttentionSettings
    parallel: ParallelSettings
    shape: MeshShape
    pipeline: Optional[PipelinePlan]  # --pipeline_parallel_size > 1
    device: torch.device


class Stages(NamedTuple):
    """The model (under pipeline parallelism this rank's stages of it) as parallelised."""

    model: CausalLM
    pipeline: Optional[Pipeline]  # the schedule over the stages, not yet started
    done: Parallelized
    n_lora: int  # layers given LoRA adapters


def build_sharded_model(build: ModelBuild, mesh: DeviceMesh, log: Callable[[str], None]) -> CausalLM:
    """The model, parallelised over `mesh` and initialised (every rank calls it), without pipeline
    parallelism."""
    model, pipeline = build_stages(build, mesh, log)
    assert pipeline is None, "under pipeline parallelism the stages run the model: build_stages"
    return model


def build_stages(
    build: ModelBuild, mesh: DeviceMesh, log: Callable[[str], None]
) -> tuple[CausalLM, Optional[Pipeline]]:
    """The model, parallelised over `mesh` and initialised (every rank calls it); under pipeline
    parallelism this rank's stages of it, and the schedule that runs them. `log` gets the start-up line."""
    low_cpu = build.model.low_cpu
    model, pipeline, done, n_lora = parallelised(build, mesh, torch.device("meta") if low_cpu else build.device)
    if low_cpu:
        model.to_empty(device=build.device)
        init_weights(model, build.model.seed)
    if pipeline is not None:
        pipeline.start()
    log(describe(build, mesh, model, done, n_lora))
    float8 = build.parallel.float8
    if float8 is not None and done.float8 == 0:
        log(
            f"warning: --float8=True converted no Linear layer: none has >= --float8_min_size={float8.min_size} "
            "features in and out"
        )
    return model, pipeline


def parallelised(build: ModelBuild, mesh: DeviceMesh, device: torch.device) -> Stages:
    """The model built on `device` (initialised there unless it is the meta device), LoRA's adapters
    added, under pipeline parallelism pruned to this rank's stages, and parallelised over `mesh`: what
    every start does, and what --dry_run rehearses on the meta device."""
    model = build_model(build.model_config, device)
    n_lora = 0 if build.lora is None else add_adapters(model, build.lora)
    model.head.z_loss_weight = build.model.z_loss_weight
    if model.routing is not None:
        set_routing(model.routing, build)
    model.lines = LinePlan.of(build.attention, build.device, context_parallel(build.shape, mesh))
    pipeline = None
    if build.pipeline is not None:  # this rank's stages only, under their whole-model names
        group = mesh["pp"].get_group()
        prune(model, build.pipeline, dist.get_rank(group))
        pipeline = Pipeline(build.pipeline, model, group, build.device, build.model.z_loss_weight > 0)
    if device.type != "meta":
        init_weights(model, build.model.seed)
    done = parallelize(model, build.parallel, mesh, None if pipeline is None else list(pipeline.parts))
    return Stages(model, pipeline, done, n_lora)


def set_routing(routing: Routing, build: ModelBuild) -> None:
    """A sparse model's routing settings from the flags, and its figures counted on the run's device."""
    config = build.model_config
    assert isinstance(config, MoEConfig)
    routing.balance_weight = build.model.moe_aux_loss_weight
    routing.z_weight = build.model.moe_z_loss_weight
    routing.capacity_factor = build.model.moe_capacity_factor
    routing.kernel = build.model.moe_kernel
    routing.stats = RoutingStats(config.nlayers, config.moe_experts, build.device)


def context_parallel(shape: MeshShape, mesh: DeviceMesh) -> Optional[ContextParallel]:
    """This rank's context-parallel group (--context_parallel_size), None without one."""
    if shape.cp == 1:
        return None
    cp = mesh["cp"]
    return ContextParallel(cp.get_group(), cp.get_local_rank(), shape.cp)


def describe(build: ModelBuild, mesh: DeviceMesh, model: CausalLM, done: Parallelized, n_lora: int) -> str:
    """The start-up line about the model: sizes, mesh, and what is on."""
    parallel, lora, whole = build.parallel, build.lora, build.shape.whole
    held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    checkpointing = (
        "off"
        if done.checkpointed is None
        else f"{done.checkpointed}/{len(blocks_of(model))} blocks, {parallel.ac_mode}"
    )
    line = (
        f"model {build.variant}: {count_params(build.model_config):,} parameters ({held:,} held by rank 0), "
        f"mesh ({', '.join(mesh.mesh_dim_names or ())}) = {tuple(mesh.shape)} on {build.device.type}"
        f"{' (one rank: no FSDP)' if whole else ''}, "
        f"activation checkpointing: {checkpointing}, compile: {parallel.compile}, "
        f"bf16: {parallel.mixed_precision}{' (autocast)' if parallel.mixed_precision and whole else ''}"
    )
    if parallel.cpu_offload:
        line += ", parameters, gradients and optimizer state on the host (CPU offload)"
    if parallel.ep > 1:
        line += f", experts spread over {parallel.ep} ranks (expert parallel)"
    if parallel.float8 is not None:
        line += f", float8 ({parallel.float8.recipe}): {done.float8} Linear layers"
    if lora is not None:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        line += f", LoRA rank {lora.rank} on {n_lora} layers, {trainable:,} trainable parameters held"
    if build.pipeline is not None:
        line += f"; {build.pipeline.describe()}"
    return line


def build_optimizer_and_schedule(
    model: CausalLM,
    *,
    optimizer: OptimizerSettings,
    schedule: ScheduleSettings,
    float8: Optional[Float8Settings],
    mesh: DeviceMesh,
    device: torch.device,
) -> tuple[torch.optim.Optimizer, Any]:
    """The optimizer over the model's trainable parameters (with float8 all-gather, the scales of the
    next all-gather computed after each step) and its LR scheduler."""
    built = build_optimizer(model, optimizer, device)
    if float8 is not None and float8.all_gather(sharded(mesh)):
        built.register_step_post_hook(scale_hook(model))
    return built, build_scheduler(built, schedule)
