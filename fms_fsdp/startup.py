"""A run's start: its facts worked out once from the flags (`facts`: the `Run` of context.py: where this
process sits, the mesh's shape, the model config and every component's settings), its process group
and mesh (`started`), what the model's build takes from them (`model_build`), and what it records once
started (config.yaml, the summary lines).

`facts` runs every start-up check that needs more than the flags (config.validate judged the
flags alone): the torch release, the model variant, the mesh, what tensor parallelism must divide,
the keep policy, the device for float8, the profiler and the optimizer's kernels, LoRA, what
--ckpt_load_path names, and the tokenizer, each by the module that uses it. All of it happens before
any process group, data or model, and none of it waits: `started` waits for --fault_tolerance's
lighthouse, then starts the process group. The checks stay written out in `facts`, in order, rather
than in a registry: each needs the facts worked out before it (the device, the mesh's shape, the
model config), and the order decides which of two errors a user sees first.
"""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from fms.models.llama import LLaMAConfig

from fms_fsdp.atomic import write_text_keeping_old
from fms_fsdp.checkpoint.checkpointer import newest_metadata
from fms_fsdp.compat import check_torch
from fms_fsdp.config import to_yaml, train_config
from fms_fsdp.context import Paths, Run
from fms_fsdp.data.make_loader import check_tokenizer
from fms_fsdp.errors import CheckpointError, ConfigError, first_line
from fms_fsdp.evaluation.harness import check_harness
from fms_fsdp.model.float8 import check_float8
from fms_fsdp.model.lora import check_lora
from fms_fsdp.model.moe import check_sparse
from fms_fsdp.model.variants import CausalLM, context_length, get_model_config
from fms_fsdp.optim import adamw_kernels, check_optimizer
from fms_fsdp.parallel.assemble import ModelBuild, build_optimizer_and_schedule, build_sharded_model
from fms_fsdp.parallel.expert_parallel import check_expert_parallel
from fms_fsdp.parallel.mesh import (
    build_mesh,
    check_context_parallel,
    check_cpu_offload,
    check_tensor_parallel,
    mesh_shape,
)
from fms_fsdp.parallel.pipeline import PipelinePlan, check_pipeline
from fms_fsdp.parallel.process_group import (
    DistInfo,
    resolve_device,
    start_process_group,
    stop_process_group,
    world_from_env,
)
from fms_fsdp.parallel.settings import MeshShape
from fms_fsdp.profiling import check_profiler
from fms_fsdp.ramp import Ramp, Resumed, Stages, steps_of_tokens
from fms_fsdp.resilience.ft_settings import FTSettings, check_fault_tolerance, wait_for_lighthouse
from fms_fsdp.settings import Settings, ft_of, mesh_of, pipeline_of, settings_of
from fms_fsdp.storage import is_remote, make_folder
from fms_fsdp.versions import code_commit, installed
from fms_fsdp.weights.hf import special_tokens
from fms_fsdp.weights.load import check_load_path

PLANNED_RANKS_PER_NODE = 8  # a dry run's --plan_world_size is planned on nodes of up to this many ranks
RECORDED_ENV = ("NCCL_", "TORCH_", "CUDA_")  # environment variables a run record keeps


def planned_world(cfg: train_config) -> tuple[int, int, int, int]:
    """(rank, world size, local rank, ranks per node) of this launch, or in a dry run the
    --plan_world_size the plan is for."""
    rank, world_size, local_rank, local_world_size = world_from_env()
    if cfg.plan_world_size is None or not cfg.dry_run:
        return rank, world_size, local_rank, local_world_size
    return rank, cfg.plan_world_size, local_rank, min(cfg.plan_world_size, PLANNED_RANKS_PER_NODE)


# the newest checkpoint's run state (None: none to resume), read when first asked for
Resumable = Callable[[], Optional[dict[str, Any]]]


def facts(cfg: train_config, run_cache: bool = True, ft: Optional[FTSettings] = None) -> Run:
    """The run's facts, after every start-up check (ConfigError naming the flag); no process group,
    data or model is touched, and nothing is waited for (`started` waits for the lighthouse).
    `run_cache`: the data caches may be kept under --ckpt_save_path (False: `fms-evaluate`'s). `ft`:
    --fault_tolerance's settings where the command line built them already (settings.ft_of)."""
    check_torch()
    rank, world_size, local_rank, local_world_size = planned_world(cfg)
    # a dry run plans for the device asked for, which this machine need not have
    device = (
        torch.device("cuda" if cfg.device == "cuda" else "cpu")
        if cfg.dry_run
        else resolve_device(cfg.device, local_rank)
    )
    ft = ft or ft_of(cfg)
    checkpoints = Paths.of(cfg.ckpt_save_path, ft.index if ft else None).checkpoints
    resumed = functools.cache(lambda: newest_metadata(checkpoints))  # read once, where a setting depends on it
    cfg, notes = resumed_cache_order(cfg, resumed)
    mesh, pipeline_settings = mesh_of(cfg), pipeline_of(cfg)
    shape = mesh_shape(mesh, world_size, local_world_size)
    cfg, told = ramp_in_steps(cfg, shape.dp, resumed)
    notes += told
    model_config = model_config_of(cfg, cfg.seq_length, shape.tp)
    check_tensor_parallel(mesh, model_config)
    check_context_parallel(mesh, device)
    check_pipeline(pipeline_settings, model_config)
    pipeline = PipelinePlan.of(pipeline_settings, model_config)
    # every component's settings (the keep policy, the schedule, ...): ConfigError naming the flag
    settings = settings_of(cfg, model_config.src_vocab_size, run_cache)
    check_optimizer(settings.optimizer, settings.lora is not None)
    if not cfg.dry_run:  # a plan is made on any machine, for the devices the run will have
        if settings.parallel.float8 is not None:
            check_float8(device)
        check_profiler(settings.profiler, device)
    adamw_kernels(settings.optimizer.impl, device, settings.optimizer.skip_bad_steps)
    check_lora(settings.lora, cfg.ckpt_load_path, cfg.float8)
    check_expert_parallel(shape, model_config, settings.parallel.per_op_checkpointing)
    check_cpu_offload(shape, settings.parallel.cpu_offload)
    check_sparse(model_config, sparse_refusals(cfg, shape, model_config))
    check_harness(settings.harness)
    positions = context_length(model_config_of(cfg))  # before a longer --seq_length extends them
    # a plan may be made where the weights are not: a dry run checks them where they are on this machine
    if cfg.ckpt_load_path is not None and (not cfg.dry_run or Path(cfg.ckpt_load_path).exists()):
        source = check_load_path(cfg.ckpt_load_path, model_config, cfg.model_variant, positions)
        if source is not None:  # a Hugging Face folder: its exports keep its special token ids
            settings, told = with_source_tokens(settings, source, cfg)
            notes += told
    tokenizer = cfg.tokenizer_path
    if tokenizer is not None:
        notes += tuple(check_tokenizer(tokenizer, cfg.model_variant, settings.data.packing))
    if cfg.seq_length > positions:
        notes += (beyond_positions(cfg, positions),)
    if ft is not None and not cfg.dry_run:
        check_fault_tolerance(shape, world_size, cfg.sharding_strategy)
    groups = (ft.groups, ft.index) if ft is not None else (1, 0)
    info = DistInfo(rank, world_size, local_rank, local_world_size, device, shape.tp, shape.cp, shape.pp, *groups)
    return Run(cfg, settings, info, shape, model_config, notes, pipeline=pipeline, ft=ft)


def resumed_cache_order(cfg: train_config, resumed: Resumable) -> tuple[train_config, tuple[str, ...]]:
    """--cache_build as given, or where it is not: first if the newest checkpoint (`resumed()`) read its
    --cache_dir once built (made with --cache_build=first, or before the flag existed), so that the resume
    keeps the checkpoint's batch order, and otherwise beside. Its start-up note, if first was chosen."""
    if cfg.cache_dir is None or cfg.cache_build is not None:
        return cfg, ()
    recorded = (resumed() or {}).get("config")
    if recorded is None or recorded.get("cache_dir") is None or recorded.get("cache_build", "first") != "first":
        return replace(cfg, cache_build="beside"), ()
    return replace(cfg, cache_build="first"), (
        "note: the checkpoint resumed read its --cache_dir once built (--cache_build=first, or made before that "
        "flag): the cache is read in that order again, built first where it is not complete",
    )


def ramp_in_steps(cfg: train_config, data_parallel: int, resumed: Resumable) -> tuple[train_config, tuple[str, ...]]:
    """--ramp_unit=tokens: the schedules with their stages in steps for `data_parallel` ranks (what the
    run, its checkpoints and its tools then read), and the start-up note that gives them. `resumed()`: the
    newest checkpoint's run state, whose steps keep their shapes (ramp.steps_of_tokens), on any world size."""
    if cfg.ramp_unit != "tokens":
        return cfg, ()
    meta = resumed()
    ramp = steps_of_tokens(
        Stages.parse("batch_size_schedule", cfg.batch_size_schedule, cfg.batch_size, "batch_size", unit="token"),
        Stages.parse("seq_length_schedule", cfg.seq_length_schedule, cfg.seq_length, "seq_length", unit="token"),
        data_parallel * cfg.grad_accum_steps,
        None if meta is None else resumed_ramp(meta, cfg),
    )
    texts = {
        flag: ",".join(f"{start}:{value}" for start, value in zip(stages.starts, stages.values)) if given else ""
        for flag, stages, given in (
            ("batch_size_schedule", ramp.batch, cfg.batch_size_schedule),
            ("seq_length_schedule", ramp.seq, cfg.seq_length_schedule),
        )
    }
    said = " ".join(f"--{flag}={text}" for flag, text in texts.items() if text)
    at = f", resumed at step {meta['step']}" if meta else ""
    note = f"note: --ramp_unit=tokens on {data_parallel} data-parallel ranks{at}: in steps, {said}"
    batch, seq = texts["batch_size_schedule"], texts["seq_length_schedule"]
    return replace(cfg, batch_size_schedule=batch, seq_length_schedule=seq, ramp_unit="steps"), (note,)


def resumed_ramp(meta: dict[str, Any], cfg: train_config) -> Resumed:
    """The step, tokens seen and step shapes of a checkpoint's run state (the schedules in steps its flags
    recorded; `cfg`'s sizes where it recorded none)."""
    recorded = {"batch_size": cfg.batch_size, "seq_length": cfg.seq_length, **meta.get("config", {})}
    batch, seq = (
        Stages.parse(flag, recorded.get(flag) or "", int(recorded[of]), of)
        for flag, of in (("batch_size_schedule", "batch_size"), ("seq_length_schedule", "seq_length"))
    )
    return Resumed(int(meta["step"]), int(meta["tokens_seen"]), Ramp(batch, seq))


def model_config_of(cfg: train_config, seq_length: Optional[int] = None, tp: int = 1) -> LLaMAConfig:
    """The model config the flags give: the variant's, with --vocab_size, --rope_theta,
    --rope_scaling_factor, --norm_eps and --max_position_embeddings (and grown to `seq_length`)."""
    return get_model_config(
        cfg.model_variant,
        cfg.vocab_size,
        seq_length,
        tp,
        cfg.rope_theta,
        cfg.rope_scaling_factor,
        norm_eps=cfg.norm_eps,
        positions=cfg.max_position_embeddings,
        moe=moe_flags(cfg),
    )


def sparse_refusals(cfg: train_config, shape: MeshShape, model_config: LLaMAConfig) -> dict[str, bool]:
    """The features a sparse model does not combine with yet (model/moe.check_sparse), each: whether the
    run uses it."""
    return {
        "--tensor_parallel_size": shape.tp > 1,
        "--context_parallel_size": shape.cp > 1,
        "--float8": cfg.float8,
        "--lora_rank": bool(cfg.lora_rank),
        "--fault_tolerance": cfg.fault_tolerance,
        "--export_format=hf with shared experts (Mixtral's layout has none)": cfg.export_format == "hf"
        and cfg.export_interval > 0
        and bool(getattr(model_config, "moe_shared_experts", 0)),
    }


def moe_flags(cfg: train_config) -> dict[str, int]:
    """--moe_experts, --moe_top_k and --moe_shared_experts where given (MoEConfig's fields)."""
    given = {"moe_experts": cfg.moe_experts, "moe_top_k": cfg.moe_top_k, "moe_shared_experts": cfg.moe_shared_experts}
    return {k: v for k, v in given.items() if v is not None}


def beyond_positions(cfg: train_config, positions: int) -> str:
    """The start-up note of a --seq_length beyond the model's positions."""
    scaled = "" if cfg.rope_scaling_factor in (None, 1) else f" (with --rope_scaling_factor={cfg.rope_scaling_factor})"
    return (
        f"note: --seq_length={cfg.seq_length} is beyond {cfg.model_variant}'s {positions} positions{scaled}: the "
        f"model trains at {cfg.seq_length}, and its Hugging Face exports say max_position_embeddings={cfg.seq_length}"
    )


def with_source_tokens(settings: Settings, hf: dict, cfg: train_config) -> tuple[Settings, tuple[str, ...]]:
    """The settings whose exports record the special token ids of the Hugging Face folder the run starts
    from (where it names them), and a note where its end-of-text id is not the run's --eos_token, or its
    beginning-of-text id is put before no document. A --bos_token other than its own is refused: the
    exports would record an id the run never put there."""
    bos, eos = special_tokens(hf)
    if bos is not None and cfg.bos_token is not None and cfg.bos_token != bos:
        raise ConfigError(
            f"--ckpt_load_path: {cfg.ckpt_load_path}: bos_token_id is {bos} but the run puts --bos_token="
            f"{cfg.bos_token} before each document; set --bos_token={bos}"
        )
    export = replace(
        settings.export,
        bos=bos if bos is not None else settings.export.bos,
        eos=eos if eos is not None else settings.export.eos,
    )
    notes: tuple[str, ...] = ()
    if eos is not None and cfg.eos_token not in (eos if isinstance(eos, list) else [eos]):
        notes = (
            f"note: {cfg.ckpt_load_path} ends text with eos_token_id {eos}, but documents are separated by "
            f"--eos_token={cfg.eos_token}; its exports keep {eos} (set --eos_token={eos if not isinstance(eos, list) else eos[0]} "
            "if the data ends documents with it)",
        )
    if bos is not None and cfg.bos_token is None:
        notes += (
            f"note: {cfg.ckpt_load_path} begins text with bos_token_id {bos}, but no --bos_token is put before "
            f"documents; set --bos_token={bos} if the data does not begin documents with it",
        )
    return replace(settings, export=export), notes


def with_mesh(run: Run) -> Run:
    """The run with its DeviceMesh (the process group must be up; every rank calls it)."""
    return replace(run, mesh=build_mesh(run.shape, run.device, run.cfg.collective_timeout_minutes))


def model_build(run: Run) -> ModelBuild:
    """What building the run's model over its mesh reads (parallel/assemble.py)."""
    settings = run.settings
    return ModelBuild(
        variant=run.variant,
        model_config=run.model_config,
        model=settings.model,
        lora=settings.lora,
        attention=settings.attention,
        parallel=settings.parallel,
        shape=run.shape,
        pipeline=run.pipeline,
        device=run.device,
    )


def sharded_model(run: Run) -> CausalLM:
    """The run's model parallelised over its mesh and initialised, without pipeline parallelism (every rank
    calls it, once `started`)."""
    assert run.mesh is not None, "the process group is up (started)"
    return build_sharded_model(model_build(run), run.mesh, run.log)


def optimizer_and_schedule(run: Run, model: CausalLM) -> tuple[torch.optim.Optimizer, Any]:
    """The run's optimizer over `model` and its LR scheduler (parallel/assemble.py)."""
    assert run.mesh is not None, "the process group is up (started)"
    settings = run.settings
    return build_optimizer_and_schedule(
        model,
        optimizer=settings.optimizer,
        schedule=settings.schedule,
        float8=settings.parallel.float8,
        mesh=run.mesh,
        device=run.device,
    )


def record(run: Run) -> str:
    """What ran, as YAML comments at the head of config.yaml (--config reads only the flags below them):
    the package's version and git commit, torch, ibm-fms and torchao, the world and mesh, and the
    environment variables that change how it runs (NCCL_*, TORCH_*, CUDA_*)."""
    dims = run.shape.dims()
    lines = [
        "run record (comments: --config reads only the flags below)",
        f"fms-fsdp {installed('fms-fsdp')}, git {code_commit()}",
        f"torch {torch.__version__}, ibm-fms {installed('ibm-fms')}, torchao {installed('torchao')}",
        f"world {run.info.world_size}, mesh ({', '.join(n for n, _ in dims)}) = {tuple(s for _, s in dims)}",
        *(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith(RECORDED_ENV)),
    ]
    return "".join(f"# {line}\n" for line in lines)


def write_config(run: Run) -> None:
    """<ckpt_save_path>/config.yaml: the run record (`record`), then the flags (an earlier, different
    one is kept as config.<n>.yaml), written once the run has started (a start that failed leaves none);
    CheckpointError naming the path when it cannot be written."""
    try:
        make_folder(run.paths.root)
        write_text_keeping_old(run.paths.config, record(run) + to_yaml(run.cfg))
    except Exception as e:  # fsspec filesystems raise their clients' own errors too
        raise CheckpointError(
            f"--ckpt_save_path: cannot write {run.cfg.ckpt_save_path} ({type(e).__name__}: {first_line(e)})"
        ) from None


def summary(run: Run, start: int) -> list[str]:
    """The end of a training run's start-up lines, after the model's (model, mesh; parallel/assemble.py): the
    data, the steps, and where the config went."""
    cfg = run.cfg
    if cfg.use_dummy_dataset:
        data = "synthetic token lines (--use_dummy_dataset)"
    else:
        data = f"{cfg.data_path}: " + (", ".join(cfg.datasets) if cfg.datasets else "every dataset folder there")
        data += f", weights {','.join(f'{w:g}' for w in cfg.weights)}" if cfg.weights else ""
        data += f", raw text tokenized by {cfg.tokenizer_path}" if cfg.tokenizer_path else ""
    steps = f"steps {start + 1} to {cfg.num_steps}" if start < cfg.num_steps else "no steps left"
    per_rank = f"{cfg.batch_size} x {cfg.seq_length}" + (
        f" x {cfg.grad_accum_steps}" if cfg.grad_accum_steps > 1 else ""
    )
    total = cfg.batch_size * cfg.seq_length * cfg.grad_accum_steps * run.shape.dp
    if cfg.batch_size_schedule or cfg.seq_length_schedule:
        per_rank = f"up to {per_rank} (--batch_size_schedule, --seq_length_schedule)"
    return [
        f"data: {data}",
        f"training: {steps}{f' (resumed at step {start})' if start else ''}, {per_rank} tokens per "
        f"data-parallel rank and step ({total:,} in all), a report every {cfg.report_interval}",
        f"config: {run.paths.config} (every flag; --config=<it> runs it again)",
    ]


@contextmanager
def started(run: Run) -> Iterator[Run]:
    """The process group of `run` (and its mesh) for the block, torn down after it; under
    --fault_tolerance, once the lighthouse answers (ConfigError after --ft_timeout_seconds)."""
    if run.ft is not None:
        wait_for_lighthouse(run.ft)
    local = not is_remote(run.cfg.ckpt_save_path)  # an evaluation in object storage needs no fsspec package here
    start_process_group(
        run.device,
        run.cfg.collective_timeout_minutes,
        run.paths.nccl_traces if local else None,
        host_tensors=run.settings.parallel.cpu_offload,
    )
    try:
        yield with_mesh(run)
    finally:
        stop_process_group()
