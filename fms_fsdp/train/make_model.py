"""The model and optimizer of a run, built as training and evaluation build them: fms's LLaMA (on the
meta device with --low_cpu_fsdp), LoRA's adapters, parallelised over the run's mesh (parallel/parallelize.py) and
initialised to the same weights at any mesh (model/initialization.py); AdamW and the LR schedule."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fms_fsdp.context import Run
from fms_fsdp.memory.report import fits_or_warning
from fms_fsdp.model.float8 import scale_hook
from fms_fsdp.model.initialization import init_weights
from fms_fsdp.model.lora import add_adapters
from fms_fsdp.model.variants import CausalLM, build_model, count_params
from fms_fsdp.optim import build_optimizer
from fms_fsdp.parallel.attention import LinePlan
from fms_fsdp.parallel.context_parallel import ContextParallel
from fms_fsdp.parallel.mesh import sharded
from fms_fsdp.parallel.parallelize import Parallelized, parallelize
from fms_fsdp.parallel.pipeline import Pipeline, blocks_of, prune
from fms_fsdp.schedule import build_scheduler


def build_sharded_model(run: Run) -> CausalLM:
    """The run's model, parallelised over its mesh and initialised (every rank calls it), without
    pipeline parallelism."""
    model, pipeline = build_stages(run)
    assert pipeline is None, "under pipeline parallelism the stages run the model: build_stages"
    return model


class Stages(NamedTuple):
    """The run's model (under pipeline parallelism this rank's stages of it) as parallelised."""

    model: CausalLM
    pipeline: Optional[Pipeline]  # the schedule over the stages, not yet started
    done: Parallelized
    n_lora: int  # layers given LoRA adapters


def build_stages(run: Run) -> tuple[CausalLM, Optional[Pipeline]]:
    """The run's model, parallelised over its mesh and initialised (every rank calls it); under
    pipeline parallelism this rank's stages of it, and the schedule that runs them."""
    settings, device = run.settings.model, run.device
    if device.type == "cuda" and run.info.is_main:
        warning = fits_or_warning(
            run.settings.memory, run.shape, run.model_config, run.pipeline, run.info.local_world_size
        )
        if warning:
            run.log(warning)
    model, pipeline, done, n_lora = parallelised(run, torch.device("meta") if settings.low_cpu else device)
    if settings.low_cpu:
        model.to_empty(device=device)
        init_weights(model, settings.seed)
    if pipeline is not None:
        pipeline.start()
    run.log(describe(run, model, done, n_lora))
    float8 = run.settings.parallel.float8
    if float8 is not None and done.float8 == 0:
        run.log(
            f"warning: --float8=True converted no Linear layer: none has >= --float8_min_size={float8.min_size} "
            "features in and out"
        )
    return model, pipeline


def parallelised(run: Run, device: torch.device) -> Stages:
    """The run's model built on `device` (initialised there unless it is the meta device), LoRA's
    adapters added, under pipeline parallelism pruned to this rank's stages, and parallelised over the
    run's mesh: what every start does, and what --dry_run rehearses on the meta device."""
    settings = run.settings.model
    assert run.mesh is not None, "the process group is up (startup.started)"
    model = build_model(run.model_config, device)
    n_lora = 0 if run.settings.lora is None else add_adapters(model, run.settings.lora)
    model.head.z_loss_weight = settings.z_loss_weight
    model.lines = LinePlan.of(run.settings.attention, run.device, context_parallel(run))
    pipeline = None
    if run.pipeline is not None:  # this rank's stages only, under their whole-model names
        group = run.mesh["pp"].get_group()
        prune(model, run.pipeline, dist.get_rank(group))
        pipeline = Pipeline(run.pipeline, model, group, run.device, settings.z_loss_weight > 0)
    if device.type != "meta":
        init_weights(model, settings.seed)
    done = parallelize(model, run.settings.parallel, run.mesh, None if pipeline is None else list(pipeline.parts))
    return Stages(model, pipeline, done, n_lora)


def context_parallel(run: Run) -> Optional[ContextParallel]:
    """This rank's context-parallel group (--context_parallel_size), None without one."""
    if run.shape.cp == 1:
        return None
    assert run.mesh is not None
    cp = run.mesh["cp"]
    return ContextParallel(cp.get_group(), cp.get_local_rank(), run.shape.cp)


def describe(run: Run, model: CausalLM, done: Parallelized, n_lora: int) -> str:
    """The start-up line about the model: sizes, mesh, and what is on."""
    parallel, lora, mesh = run.settings.parallel, run.settings.lora, run.mesh
    assert mesh is not None
    held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    checkpointing = (
        "off"
        if done.checkpointed is None
        else f"{done.checkpointed}/{len(blocks_of(model))} blocks, {parallel.ac_mode}"
    )
    line = (
        f"model {run.variant}: {count_params(run.model_config):,} parameters ({held:,} held by rank 0), "
        f"mesh ({', '.join(mesh.mesh_dim_names or ())}) = {tuple(mesh.shape)} on {run.device.type}"
        f"{' (one rank: no FSDP)' if run.shape.whole else ''}, "
        f"activation checkpointing: {checkpointing}, compile: {parallel.compile}, "
        f"bf16: {parallel.mixed_precision}{' (autocast)' if parallel.mixed_precision and run.shape.whole else ''}"
    )
    if parallel.float8 is not None:
        line += f", float8 ({parallel.float8.recipe}): {done.float8} Linear layers"
    if lora is not None:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        line += f", LoRA rank {lora.rank} on {n_lora} layers, {trainable:,} trainable parameters held"
    if run.pipeline is not None:
        line += f"; {run.pipeline.describe()}"
    return line


def build_optimizer_and_schedule(run: Run, model: CausalLM) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW over the model's trainable parameters (with float8 all-gather, the scales of the next
    all-gather computed after each step) and its LR scheduler."""
    optimizer = build_optimizer(model, run.settings.optimizer, run.device)
    float8 = run.settings.parallel.float8
    assert run.mesh is not None
    if float8 is not None and float8.all_gather(sharded(run.mesh)):
        optimizer.register_step_post_hook(scale_hook(model))
    return optimizer, build_scheduler(optimizer, run.settings.schedule)
