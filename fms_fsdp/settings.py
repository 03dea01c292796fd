"""Every component's settings, built from the flags once at start-up (`startup.facts`) and kept on the `Run` as
`run.settings`: a component receives its own small settings object, never the flat config. Most settings
classes take each field named as a flag from that flag (`by_name`); the rest are derived here. Each fact the flags
state is parsed here once (the checkpointed fraction, the keep policy, the schedule's cycles, the lm-eval tasks,
the data's layout and framing, the mixture's schedule, the flags replica groups share). Three are built before
the others and not kept here: the mesh's and the pipeline's (`mesh_of`, `pipeline_of`), and --fault_tolerance's
(`ft_of`). A settings object that cannot be (a decay longer than a cycle, an unreadable keep policy or mixture
schedule) is a ConfigError naming the flag, at start-up."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Optional, TypeVar

from fms_fsdp.checkpoint.policy import KeepPolicy
from fms_fsdp.checkpoint.settings import CheckpointSettings, ExportSettings
from fms_fsdp.config import parse_fraction, to_dict, train_config
from fms_fsdp.data.data_cache_dir import IN_DATA
from fms_fsdp.data.file_reader import Options
from fms_fsdp.data.mixture import MixtureSchedule
from fms_fsdp.data.prepare.settings import CacheSettings, RaySettings
from fms_fsdp.data.settings import DataSettings
from fms_fsdp.data.shards import Layout
from fms_fsdp.data.stream import Packing
from fms_fsdp.data.text import TextSpec
from fms_fsdp.evaluation.harness import HarnessSettings, task_names
from fms_fsdp.evaluation.settings import CheckpointEvalSettings, EvalSettings
from fms_fsdp.memory.settings import MemorySettings, Setting
from fms_fsdp.metrics.reporter import MetricsSettings
from fms_fsdp.metrics.trackers import TrackerSettings
from fms_fsdp.model.float8 import Float8Settings
from fms_fsdp.model.lora import LoRASpec
from fms_fsdp.optim import OptimizerSettings
from fms_fsdp.parallel.settings import (
    AttentionSettings,
    MeshSettings,
    ModelSettings,
    ParallelSettings,
    PipelineSettings,
)
from fms_fsdp.profiling import ProfilerSettings
from fms_fsdp.ramp import Ramp, ramp_of
from fms_fsdp.resilience.ft_settings import FTSettings
from fms_fsdp.resilience.triggers import TriggerSettings
from fms_fsdp.schedule import ScheduleSettings, cycle_starts
from fms_fsdp.storage import is_remote, location
from fms_fsdp.train.settings import LoopSettings, StepSettings

S = TypeVar("S")


@dataclass(frozen=True, kw_only=True)
class Settings:
    """The settings of the run's components, one object each."""

    schedule: ScheduleSettings
    optimizer: OptimizerSettings
    parallel: ParallelSettings
    lora: Optional[LoRASpec]  # None without --lora_rank
    profiler: ProfilerSettings
    triggers: TriggerSettings
    checkpoint: CheckpointSettings
    export: ExportSettings
    evaluation: EvalSettings
    harness: HarnessSettings
    memory: MemorySettings
    attention: AttentionSettings
    trackers: TrackerSettings
    loop: LoopSettings
    step: StepSettings
    metrics: MetricsSettings
    model: ModelSettings
    data: DataSettings


def settings_of(cfg: train_config, vocab_size: int, run_cache: bool = True) -> Settings:
    """Every component's settings from the flags and the model's vocabulary `vocab_size` (ConfigError
    naming the flag that cannot be); `run_cache`: the data caches may be kept under --ckpt_save_path
    (a training run's; `fms-evaluate` keeps them only in --data_cache_dir)."""
    lora, parallel = lora_of(cfg), parallel_of(cfg)
    layout, packing = layout_of(cfg, vocab_size, run_cache), packing_of(cfg, vocab_size)
    data = data_of(cfg, layout, packing)  # with the steps' shapes, which the schedule and the metrics count
    return Settings(
        schedule=schedule_of(cfg, data.ramp),
        optimizer=optimizer_of(cfg),
        parallel=parallel,
        lora=lora,
        profiler=profiler_of(cfg),
        triggers=triggers_of(cfg),
        checkpoint=checkpoint_of(cfg),
        export=export_of(cfg, lora),
        evaluation=evaluation_of(cfg, layout, packing),
        harness=harness_of(cfg),
        memory=memory_of(cfg, parallel, lora),
        attention=by_name(
            AttentionSettings,
            cfg,
            eos=cfg.eos_token if cfg.document_masking else None,
            restart_positions=cfg.document_positions == "document",
            compile=cfg.use_torch_compile,
            ring=cfg.cp_attention == "ring",
        ),
        trackers=trackers_of(cfg),
        loop=loop_of(cfg),
        step=by_name(StepSettings, cfg),
        metrics=metrics_of(cfg, data.ramp),
        model=by_name(ModelSettings, cfg, low_cpu=cfg.low_cpu_fsdp),
        data=data,
    )


def by_name(cls: type[S], cfg: train_config, **given: Any) -> S:
    """Settings `cls` built from `given`, and each of its other fields from the flag of the same name (a field
    that is no flag keeps its default): a flag added to config.py and, under its name, to a settings class
    reaches that class with no line here."""
    fields = [f for f in dataclasses.fields(cls) if f.name not in given]  # type: ignore[arg-type]
    missing = [f.name for f in fields if not hasattr(cfg, f.name) and not _has_default(f)]
    if missing:
        raise TypeError(f"{cls.__name__}: {missing} are neither flags nor given, and have no default")
    return cls(**given, **{f.name: getattr(cfg, f.name) for f in fields if hasattr(cfg, f.name)})


def _has_default(field: dataclasses.Field) -> bool:
    return field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING


def profiler_of(cfg: train_config) -> ProfilerSettings:
    return by_name(
        ProfilerSettings,
        cfg,
        enabled=cfg.use_profiler,
        rank0_only=cfg.profiler_rank0_only,
        folder=cfg.profiler_dir,
        memory_snapshot=cfg.use_profiler and cfg.profiler_memory_snapshot,
    )


def triggers_of(cfg: train_config) -> TriggerSettings:
    return by_name(
        TriggerSettings,
        cfg,
        num_steps=cfg.num_steps,
        interval=cfg.checkpoint_interval,
        minutes=cfg.checkpoint_minutes,
        hours_between_failures=cfg.expected_hours_between_failures,
        timeout_minutes=cfg.collective_timeout_minutes,
        max_run_minutes=cfg.max_run_minutes,
    )


def checkpoint_of(cfg: train_config) -> CheckpointSettings:
    """--checkpoint_keep* parsed once (ConfigError naming the flag)."""
    return by_name(
        CheckpointSettings,
        cfg,
        policy=KeepPolicy.parse(
            cfg.checkpoint_keep, cfg.checkpoint_keep_policy, cfg.checkpoint_keep_best, cfg.checkpoint_monitor
        ),
        background=cfg.async_checkpoint,
        on_error=cfg.on_checkpoint_error,
        load_path=cfg.ckpt_load_path,
        lora=bool(cfg.lora_rank),
    )


def export_of(cfg: train_config, lora: Optional[LoRASpec]) -> ExportSettings:
    return by_name(
        ExportSettings,
        cfg,
        interval=cfg.export_interval,
        format=cfg.export_format,
        keep=cfg.export_keep,
        tokenizer_path=cfg.tokenizer_path,
        bos=cfg.bos_token,
        eos=cfg.eos_token,
        lora=lora,
        base=cfg.ckpt_load_path,
        ema=cfg.export_ema,
    )


def metrics_of(cfg: train_config, ramp: Optional[Ramp] = None) -> MetricsSettings:
    return by_name(MetricsSettings, cfg, ramp=ramp)


def data_of(cfg: train_config, layout: Layout, packing: Packing) -> DataSettings:
    """The training data's settings: --weights_schedule parsed once (ConfigError naming it), --cache_dir's."""
    schedule = None if cfg.weights_schedule is None else MixtureSchedule.parse(cfg.weights_schedule)
    ramp = ramp_of(cfg.batch_size_schedule, cfg.seq_length_schedule, cfg.batch_size, cfg.seq_length)
    return by_name(DataSettings, cfg, schedule=schedule, layout=layout, packing=packing, cache=cache_of(cfg), ramp=ramp)


def cache_of(cfg: train_config) -> Optional[CacheSettings]:
    """--cache_dir and how it is tokenized (data/prepare/cache_dir.py); None without it."""
    if cfg.cache_dir is None:
        return None
    assert cfg.tokenizer_path is not None  # config.validate: --cache_dir needs --tokenizer_path
    ray = by_name(
        RaySettings,
        cfg,
        address=cfg.ray_address,
        start_workers=cfg.ray_start_workers,
        auto_start_cluster=cfg.ray_auto_start_cluster,
    )
    text = {"tokenizer_path": cfg.tokenizer_path, "text_field": cfg.text_field}
    when = {"build": cfg.cache_build} if cfg.cache_build is not None else {}  # not given: the default, beside
    return by_name(CacheSettings, cfg, **text, **when, workers=cfg.cache_workers, ray=ray)


def packing_of(cfg: train_config, vocab_size: int) -> Packing:
    """How documents become lines under cfg's separator, bos/bol/eol and strip tokens."""
    strip = {cfg.eos_token, *cfg.strip_tokens} | ({cfg.bos_token} if cfg.bos_token is not None else set())
    return Packing(
        seq_length=cfg.seq_length,
        eos=cfg.eos_token,
        bos=cfg.bos_token,
        bol=cfg.bol_token,
        eol=cfg.eol_token,
        strip=frozenset(strip),
        vocab_size=vocab_size,
    )


def layout_of(cfg: train_config, vocab_size: Optional[int], run_cache: bool = True) -> Layout:
    """Which files the datasets hold and how they are read, from cfg and the run's vocabulary; the cache folder
    is --data_cache_dir, else (`run_cache`: a run's) <ckpt_save_path>/data_cache (data/data_cache_dir.py), else none."""
    text = None if cfg.tokenizer_path is None else TextSpec(cfg.tokenizer_path, cfg.text_field)
    options = Options(col_name=cfg.col_name, token_dtype=cfg.token_dtype, eos=cfg.eos_token, vocab_size=vocab_size)
    cache = cfg.data_cache_dir
    if cache is None and run_cache:
        save = cfg.ckpt_save_path
        root = save.rstrip("/") if is_remote(save) else str(location(save, "ckpt_save_path"))
        cache = f"{root}/data_cache"
    if cache is not None and cache != IN_DATA and not is_remote(cache):
        cache = os.path.abspath(cache.removeprefix("file://"))
    return Layout(file_type=cfg.file_type, options=options, text=text, cache_dir=cache)


def loop_of(cfg: train_config) -> LoopSettings:
    """The flags the training loop reads itself (each field is the flag of its name)."""
    return by_name(LoopSettings, cfg)


def trackers_of(cfg: train_config) -> TrackerSettings:
    """--tracker's settings, with every flag's value for the trackers' hyper-parameters."""
    return by_name(
        TrackerSettings,
        cfg,
        names=tuple(cfg.tracker or ()),
        project=cfg.tracker_project_name,
        folder=cfg.tracker_dir,
        run_id=cfg.tracker_run_id,
        config=to_dict(cfg),
    )


def memory_of(cfg: train_config, parallel: ParallelSettings, lora: Optional[LoRASpec]) -> MemorySettings:
    """The memory plan's settings: its activation checkpointing is `parallel`'s, its adapters `lora`'s."""
    fraction = parallel.checkpointing
    return by_name(
        MemorySettings,
        cfg,
        setting=Setting(
            batch=cfg.batch_size,
            checkpointing=fraction is not None,
            fraction=fraction or Fraction(0),
            mode=parallel.ac_mode,
        ),
        variant=cfg.model_variant,
        compile=cfg.use_torch_compile,
        muon=cfg.optimizer == "muon",
        skip_bad_steps=cfg.skip_bad_steps > 0,
        lora=lora,
        device_gib=cfg.plan_device_memory_gib,
        ema=cfg.ema_decay > 0,
    )


def evaluation_of(cfg: train_config, layout: Layout, packing: Packing) -> EvalSettings:
    """--eval_data_path's evaluation, its datasets read and framed as training's (`layout`, `packing`)."""
    return by_name(
        EvalSettings,
        cfg,
        interval=cfg.eval_interval,
        num_steps=cfg.num_steps,
        data_path=cfg.eval_data_path,
        datasets=cfg.eval_datasets,
        batch=cfg.eval_batch_size or cfg.batch_size,
        batches=cfg.eval_batches,
        pipelined=cfg.pipeline_parallel_size > 1,
        layout=layout if cfg.eval_interval else None,
        packing=packing,
    )


def checkpoint_evaluation_of(cfg: train_config) -> CheckpointEvalSettings:
    """What `fms-evaluate` is asked to evaluate (checked before the run's facts)."""
    return by_name(
        CheckpointEvalSettings,
        cfg,
        load_path=cfg.ckpt_load_path,
        data=bool(cfg.eval_data_path),
        tasks=bool(cfg.eval_harness_tasks),
        pipeline_parallel_size=cfg.pipeline_parallel_size,
        lora=bool(cfg.lora_rank),
    )


def harness_of(cfg: train_config) -> HarnessSettings:
    """--eval_harness_tasks's settings, the task names parsed once."""
    return by_name(
        HarnessSettings,
        cfg,
        tasks=task_names(cfg.eval_harness_tasks),
        include_path=cfg.eval_harness_include_path,
        tokenizer_path=cfg.tokenizer_path,
        interval=cfg.eval_harness_interval,
        limit=cfg.eval_harness_limit or None,
        num_steps=cfg.num_steps,
        seq_length=cfg.seq_length,
        batch=cfg.eval_batch_size or cfg.batch_size,
        eos=cfg.eos_token,
        prefix=cfg.bos_token if cfg.bos_token is not None else cfg.eos_token,
        cp=cfg.context_parallel_size,
        tp=cfg.tensor_parallel_size,
    )


def schedule_of(cfg: train_config, ramp: Optional[Ramp] = None) -> ScheduleSettings:
    """The learning-rate schedule's settings (ConfigError for cycles or a decay that cannot be); `ramp`: the
    steps' shapes (data_of's), whose tokens --lr_schedule_unit=tokens counts."""
    starts = cycle_starts(cfg.num_steps, cfg.lr_cycles, cfg.lr_cycle_length, cfg.lr_cycle_ends)
    return by_name(
        ScheduleSettings,
        cfg,
        stage=cfg.training_stage,
        schedule=cfg.lr_schedule,
        steps=cfg.num_steps,
        starts=starts,
        warmup=cfg.warmup_steps,
        rewarmup=cfg.lr_rewarmup,
        decay=cfg.decay_steps,
        min_ratio=cfg.min_lr_ratio,
        tokens=ramp if cfg.lr_schedule_unit == "tokens" else None,
    )


def optimizer_of(cfg: train_config) -> OptimizerSettings:
    """The optimizer's settings (AdamW, or Muon for the blocks' matrices)."""
    return by_name(
        OptimizerSettings,
        cfg,
        decay_all=cfg.weight_decay_norms_and_embeddings,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        impl=cfg.optimizer_impl,
        state_dtype=cfg.optimizer_state_dtype,
        muon=cfg.optimizer == "muon",
    )


def lora_of(cfg: train_config) -> Optional[LoRASpec]:
    """--lora_rank's adapters, or None without it."""
    if not cfg.lora_rank:
        return None
    return LoRASpec(rank=cfg.lora_rank, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout, targets=tuple(cfg.lora_targets))


def float8_of(cfg: train_config) -> Optional[Float8Settings]:
    """--float8's settings, or None without it."""
    return by_name(Float8Settings, cfg, recipe=cfg.float8_recipe, min_size=cfg.float8_min_size) if cfg.float8 else None


def parallel_of(cfg: train_config) -> ParallelSettings:
    """What `parallelize` applies: activation checkpointing (its fraction parsed here, once), and the rest."""
    fraction = parse_fraction("selective_checkpointing", cfg.selective_checkpointing)
    return by_name(
        ParallelSettings,
        cfg,
        checkpointing=fraction if cfg.fsdp_activation_checkpointing else None,
        ac_mode=cfg.ac_mode,
        compile=cfg.use_torch_compile,
        mixed_precision=cfg.mixed_precision,
        float8=float8_of(cfg),
        ep=cfg.expert_parallel_size,
        cpu_offload=cfg.cpu_offload,
    )


def mesh_of(cfg: train_config) -> MeshSettings:
    """The mesh's flags (startup.facts lays out the mesh from them before the other settings are built, and
    keeps its shape: run.shape)."""
    return by_name(
        MeshSettings,
        cfg,
        pp=cfg.pipeline_parallel_size,
        tp=cfg.tensor_parallel_size,
        cp=cfg.context_parallel_size,
        ep=cfg.expert_parallel_size,
        compile=cfg.use_torch_compile,
        lora=bool(cfg.lora_rank),
    )


def pipeline_of(cfg: train_config) -> PipelineSettings:
    """The pipeline's flags (startup.facts plans the stages from them, and keeps the plan: run.pipeline)."""
    return by_name(
        PipelineSettings,
        cfg,
        size=cfg.pipeline_parallel_size,
        schedule=cfg.pipeline_schedule,
        stages_per_rank=cfg.pipeline_stages_per_rank,
        microbatches=cfg.pipeline_microbatches,
        split=cfg.pipeline_split,
        batch_size=cfg.batch_size,
        variant=cfg.model_variant,
        grad_accum_steps=cfg.grad_accum_steps,
        harness=bool(cfg.eval_harness_tasks),
        evaluates=cfg.eval_interval > 0,
        eval_batch_size=cfg.eval_batch_size,
    )


# Flags every replica group shares beyond the model and mesh: config.py's fields marked `shared` (what sets each
# group's batches and updates). Paths (the data's too: a copy on another mount), logging and checkpoints may differ.
SHARED_FLAGS = tuple(f.name for f in dataclasses.fields(train_config) if f.metadata["shared"])


def shared_of(cfg: train_config) -> str:
    """The values of SHARED_FLAGS, as --fault_tolerance's fingerprint holds them (resilience/ft_settings.py)."""
    return "|".join(f"{f}={getattr(cfg, f)!r}" for f in SHARED_FLAGS)


def ft_of(cfg: train_config) -> Optional[FTSettings]:
    """--fault_tolerance's settings, the environment filled in (None without it; ConfigError naming a missing
    or wrong flag). Built once: by the command line (which labels lines with the group), else startup.facts."""
    if not cfg.fault_tolerance:
        return None
    return FTSettings.of(
        replica_groups=cfg.ft_replica_groups,
        group_index=cfg.ft_group_index,
        min_replicas=cfg.ft_min_replicas,
        lighthouse=cfg.ft_lighthouse,
        timeout_seconds=cfg.ft_timeout_seconds,
        step_timeout=cfg.ft_step_timeout_seconds,
        shared=shared_of(cfg),
    )
