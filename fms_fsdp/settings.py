"""Every component's settings, built once from the flags at the door (`run.facts`) and kept on the
`Run` as `run.settings`: a component receives its own small settings object, never the flat config.

Each fact the flags state is parsed here once: the fraction of checkpointed blocks (for `parallelize`
and the memory plan alike), the keep policy, the schedule's cycles, the lm-eval task names, the data's
layout and framing (for training and evaluation alike), the mixture's schedule and the values of the
flags replica groups share. Three are built before the others, by `run.facts` or the command line, and
are not kept here: the mesh's and the pipeline's (`mesh_of`, `pipeline_of`; the run keeps what follows
from them, `run.shape` and `run.pipeline`) and --fault_tolerance's (`ft_of`: `run.ft`). A settings
object that cannot be (a decay longer than a cycle, an unreadable keep policy, an unreadable mixture
schedule) is a ConfigError naming the flag, raised at start-up.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

from fms_fsdp.checkpoint.policy import KeepPolicy
from fms_fsdp.checkpoint.settings import CheckpointSettings, ExportSettings
from fms_fsdp.config import parse_fraction, to_dict, train_config
from fms_fsdp.data.cache import IN_DATA
from fms_fsdp.data.mixture import MixtureSchedule
from fms_fsdp.data.reader import Options
from fms_fsdp.data.settings import DataSettings
from fms_fsdp.data.shards import Layout
from fms_fsdp.data.stream import Packing
from fms_fsdp.data.text import TextSpec
from fms_fsdp.data.token_cache import CacheSettings, RaySettings
from fms_fsdp.evaluation.harness import HarnessSettings, task_names
from fms_fsdp.evaluation.settings import CheckpointEvalSettings, EvalSettings
from fms_fsdp.memory.plan import MemorySettings, Setting
from fms_fsdp.metrics import MetricsSettings
from fms_fsdp.model.attention import AttentionSettings
from fms_fsdp.model.float8 import Float8Settings
from fms_fsdp.model.lora import LoRASpec
from fms_fsdp.optim import OptimizerSettings
from fms_fsdp.parallel.mesh import MeshSettings
from fms_fsdp.parallel.parallelize import ParallelSettings
from fms_fsdp.parallel.pipeline import PipelineSettings
from fms_fsdp.profiling import ProfilerSettings
from fms_fsdp.schedule import ScheduleSettings, cycle_starts
from fms_fsdp.storage import is_remote, location
from fms_fsdp.trackers import TrackerSettings
from fms_fsdp.train.ft_settings import FTSettings
from fms_fsdp.train.settings import LoopSettings, ModelSettings
from fms_fsdp.train.step import StepSettings
from fms_fsdp.train.triggers import TriggerSettings


@dataclass(frozen=True)
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
    return Settings(
        schedule=schedule_of(cfg),
        optimizer=optimizer_of(cfg),
        parallel=parallel,
        lora=lora,
        profiler=ProfilerSettings(
            cfg.use_profiler,
            cfg.profiler_rank0_only,
            cfg.profiler_dir,
            cfg.use_profiler and cfg.profiler_memory_snapshot,
        ),
        triggers=TriggerSettings(
            cfg.num_steps,
            cfg.checkpoint_interval,
            cfg.checkpoint_minutes,
            cfg.expected_hours_between_failures,
            cfg.collective_timeout_minutes,
            cfg.max_run_minutes,
        ),
        checkpoint=CheckpointSettings(
            KeepPolicy.parse(
                cfg.checkpoint_keep, cfg.checkpoint_keep_policy, cfg.checkpoint_keep_best, cfg.checkpoint_monitor
            ),
            cfg.async_checkpoint,
            cfg.on_checkpoint_error,
            cfg.ckpt_load_path,
            bool(cfg.lora_rank),
        ),
        export=ExportSettings(
            cfg.export_interval,
            cfg.export_format,
            cfg.export_keep,
            cfg.tokenizer_path,
            cfg.bos_token,
            cfg.eos_token,
            lora,
            cfg.ckpt_load_path,
        ),
        evaluation=evaluation_of(cfg, layout, packing),
        harness=harness_of(cfg),
        memory=memory_of(cfg, parallel, lora),
        attention=AttentionSettings(
            cfg.eos_token if cfg.document_masking else None,
            cfg.document_positions == "document",
            cfg.use_torch_compile,
            cfg.cp_attention == "ring",
        ),
        trackers=trackers_of(cfg),
        loop=loop_of(cfg),
        step=StepSettings(cfg.grad_accum_steps, cfg.grad_clip_thresh),
        metrics=MetricsSettings(cfg.batch_size, cfg.seq_length, cfg.grad_accum_steps, cfg.peak_tflops, cfg.num_steps),
        model=ModelSettings(cfg.low_cpu_fsdp, cfg.seed, cfg.z_loss_weight),
        data=data_of(cfg, layout, packing),
    )


def data_of(cfg: train_config, layout: Layout, packing: Packing) -> DataSettings:
    """The training data's settings: --weights_schedule parsed once (ConfigError naming it), --cache_dir's."""
    schedule = None if cfg.weights_schedule is None else MixtureSchedule.parse(cfg.weights_schedule)
    return DataSettings(
        cfg.use_dummy_dataset,
        cfg.batch_size,
        cfg.seed,
        cfg.data_path,
        cfg.datasets,
        cfg.weights,
        schedule,
        layout,
        packing,
        cfg.logical_shards,
        cfg.num_workers,
        cfg.grad_accum_steps,
        cache_of(cfg),
    )


def cache_of(cfg: train_config) -> Optional[CacheSettings]:
    """--cache_dir and how it is tokenized (data/token_cache.py); None without it."""
    if cfg.cache_dir is None:
        return None
    assert cfg.tokenizer_path is not None  # config.validate: --cache_dir needs --tokenizer_path
    ray = RaySettings(cfg.ray_address, cfg.ray_start_workers, cfg.ray_auto_start_cluster)
    return CacheSettings(cfg.cache_dir, cfg.tokenizer_path, cfg.text_field, ray)


def packing_of(cfg: train_config, vocab_size: int) -> Packing:
    """How documents become lines under cfg's separator, bos/bol/eol and strip tokens."""
    strip = {cfg.eos_token, *cfg.strip_tokens} | ({cfg.bos_token} if cfg.bos_token is not None else set())
    return Packing(
        cfg.seq_length, cfg.eos_token, cfg.bos_token, cfg.bol_token, cfg.eol_token, frozenset(strip), vocab_size
    )


def layout_of(cfg: train_config, vocab_size: Optional[int], run_cache: bool = True) -> Layout:
    """Which files the datasets hold and how they are read, from cfg and the run's vocabulary; the
    cache folder is --data_cache_dir, else (`run_cache`: a training run's) <ckpt_save_path>/data_cache
    (data/cache.py), else none."""
    text = None if cfg.tokenizer_path is None else TextSpec(cfg.tokenizer_path, cfg.text_field)
    options = Options(cfg.col_name, cfg.token_dtype, cfg.eos_token, vocab_size)
    cache = cfg.data_cache_dir
    if cache is None and run_cache:
        save = cfg.ckpt_save_path
        cache = (
            f"{save.rstrip('/')}/data_cache"
            if is_remote(save)
            else str(location(save, "ckpt_save_path") / "data_cache")
        )
    if cache is not None and cache != IN_DATA and not is_remote(cache):
        cache = os.path.abspath(cache.removeprefix("file://"))
    return Layout(cfg.file_type, options, text, cache)


def loop_of(cfg: train_config) -> LoopSettings:
    """The flags the training loop reads itself."""
    return LoopSettings(
        cfg.num_steps,
        cfg.report_interval,
        cfg.seed,
        cfg.skip_bad_steps,
        cfg.spike_sigma,
        cfg.grad_clip_thresh,
        cfg.straggler_threshold,
        cfg.straggler_reports,
        cfg.batch_size,
        cfg.seq_length,
        cfg.mixed_precision,
        cfg.checkpoint_interval,
        cfg.stop_exit_status,
        cfg.export_model_at_end,
    )


def trackers_of(cfg: train_config) -> TrackerSettings:
    """--tracker's settings, with every flag's value for the trackers' hyper-parameters."""
    names = tuple(cfg.tracker or ())
    return TrackerSettings(names, cfg.tracker_project_name, cfg.tracker_dir, cfg.tracker_run_id, to_dict(cfg))


def memory_of(cfg: train_config, parallel: ParallelSettings, lora: Optional[LoRASpec]) -> MemorySettings:
    """The memory plan's settings; its activation checkpointing is `parallel`'s (parsed once there) and
    its adapters `lora`'s."""
    fraction = parallel.checkpointing
    return MemorySettings(
        Setting(cfg.batch_size, fraction is not None, fraction or Fraction(0), parallel.ac_mode),
        cfg.model_variant,
        cfg.vocab_size,
        cfg.seq_length,
        cfg.mixed_precision,
        cfg.device,
        cfg.use_torch_compile,
        cfg.document_masking,
        cfg.cp_attention,
        cfg.optimizer == "muon",
        lora,
        cfg.plan_device_memory_gib,
    )


def evaluation_of(cfg: train_config, layout: Layout, packing: Packing) -> EvalSettings:
    """--eval_data_path's evaluation, its datasets read and framed as training's (`layout`, `packing`)."""
    return EvalSettings(
        cfg.eval_interval,
        cfg.num_steps,
        cfg.eval_data_path,
        cfg.eval_datasets,
        cfg.eval_batch_size or cfg.batch_size,
        cfg.eval_batches,
        cfg.pipeline_parallel_size > 1,
        layout if cfg.eval_interval else None,
        packing,
    )


def checkpoint_evaluation_of(cfg: train_config) -> CheckpointEvalSettings:
    """What `fms-evaluate` is asked to evaluate (checked before the run's facts)."""
    return CheckpointEvalSettings(
        cfg.ckpt_load_path,
        bool(cfg.eval_data_path),
        bool(cfg.eval_harness_tasks),
        cfg.pipeline_parallel_size,
        bool(cfg.lora_rank),
    )


def harness_of(cfg: train_config) -> HarnessSettings:
    """--eval_harness_tasks's settings, the task names parsed once."""
    return HarnessSettings(
        task_names(cfg.eval_harness_tasks),
        cfg.eval_harness_include_path,
        cfg.tokenizer_path,
        cfg.eval_harness_interval,
        cfg.eval_harness_limit or None,
        cfg.num_steps,
        cfg.seq_length,
        cfg.eval_batch_size or cfg.batch_size,
        cfg.eos_token,
        cfg.bos_token if cfg.bos_token is not None else cfg.eos_token,
        cfg.context_parallel_size,
        cfg.tensor_parallel_size,
    )


def schedule_of(cfg: train_config) -> ScheduleSettings:
    """The learning-rate schedule's settings (ConfigError for cycles or a decay that cannot be)."""
    starts = cycle_starts(cfg.num_steps, cfg.lr_cycles, cfg.lr_cycle_length, cfg.lr_cycle_ends)
    return ScheduleSettings(
        cfg.training_stage,
        cfg.lr_schedule,
        cfg.num_steps,
        starts,
        cfg.warmup_steps,
        cfg.lr_rewarmup,
        cfg.decay_steps,
        cfg.min_lr_ratio,
    )


def optimizer_of(cfg: train_config) -> OptimizerSettings:
    """The optimizer's settings (AdamW, or Muon for the blocks' matrices)."""
    return OptimizerSettings(
        cfg.learning_rate,
        cfg.weight_decay,
        cfg.weight_decay_norms_and_embeddings,
        (cfg.adam_beta1, cfg.adam_beta2),
        cfg.adam_eps,
        cfg.optimizer_impl,
        cfg.skip_bad_steps,
        cfg.optimizer == "muon",
        cfg.muon_momentum,
        cfg.muon_adjust_lr,
    )


def lora_of(cfg: train_config) -> Optional[LoRASpec]:
    """--lora_rank's adapters, or None without it."""
    return LoRASpec(cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, tuple(cfg.lora_targets)) if cfg.lora_rank else None


def float8_of(cfg: train_config) -> Optional[Float8Settings]:
    """--float8's settings, or None without it."""
    return Float8Settings(cfg.float8_recipe, cfg.float8_min_size) if cfg.float8 else None


def parallel_of(cfg: train_config) -> ParallelSettings:
    """What `parallelize` applies: activation checkpointing (the fraction parsed here, once), compile,
    bf16 and float8."""
    fraction = parse_fraction("selective_checkpointing", cfg.selective_checkpointing)
    return ParallelSettings(
        fraction if cfg.fsdp_activation_checkpointing else None,
        cfg.ac_mode,
        cfg.use_torch_compile,
        cfg.mixed_precision,
        float8_of(cfg),
    )


def mesh_of(cfg: train_config) -> MeshSettings:
    """The mesh's flags (run.facts lays out the mesh from them before the other settings are built, and
    keeps its shape: run.shape)."""
    return MeshSettings(
        cfg.pipeline_parallel_size,
        cfg.tensor_parallel_size,
        cfg.context_parallel_size,
        cfg.sharding_strategy,
        cfg.sharding_group_size,
        cfg.seq_length,
        cfg.cp_attention,
        cfg.document_masking,
        cfg.mixed_precision,
        cfg.use_torch_compile,
        cfg.float8,
        bool(cfg.lora_rank),
    )


def pipeline_of(cfg: train_config) -> PipelineSettings:
    """The pipeline's flags (run.facts plans the stages from them, and keeps the plan: run.pipeline)."""
    return PipelineSettings(
        cfg.pipeline_parallel_size,
        cfg.pipeline_schedule,
        cfg.pipeline_stages_per_rank,
        cfg.pipeline_microbatches,
        cfg.pipeline_split,
        cfg.batch_size,
        cfg.model_variant,
        cfg.grad_accum_steps,
        bool(cfg.eval_harness_tasks),
        cfg.eval_batch_size,
    )


# Flags every replica group must share beyond the model and the mesh: the fields marked `shared` in
# config.py (what sets each group's batches and every update: data layout and order, optimizer,
# learning-rate schedule, precision, adapters). Paths (the data's too: a copy on another mount),
# logging and checkpoint cadence may differ.
SHARED_FLAGS = tuple(f.name for f in dataclasses.fields(train_config) if f.metadata["shared"])


def shared_of(cfg: train_config) -> str:
    """The values of SHARED_FLAGS, as --fault_tolerance's fingerprint holds them (train/ft_settings.py)."""
    return "|".join(f"{f}={getattr(cfg, f)!r}" for f in SHARED_FLAGS)


def ft_of(cfg: train_config) -> Optional[FTSettings]:
    """--fault_tolerance's settings, the environment filled in (None without it; ConfigError naming the
    flag when one is missing or wrong). Built once: by the command line, which labels each line with the
    replica group before the run's facts, else by run.facts."""
    if not cfg.fault_tolerance:
        return None
    return FTSettings.of(
        cfg.ft_replica_groups,
        cfg.ft_group_index,
        cfg.ft_min_replicas,
        cfg.ft_lighthouse,
        cfg.ft_timeout_seconds,
        cfg.ft_step_timeout_seconds,
        shared_of(cfg),
    )
