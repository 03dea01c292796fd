"""The training loop, top to bottom.

`main`: flags -> train_config (config.py) -> `run`: the flags that other modules judge are checked
(`check_config`), the process group starts (distributed.py), then `train`: the data loader first (bad
data fails before the model is built), the model (models.py) parallelised (parallel.py), AdamW and
the LR schedule (schedule.py); resume from the newest checkpoint or start from --ckpt_load_path
(checkpoint/io.py); then step. After each step every rank agrees on stop requests and saves
(triggers.py), checkpoints, and reports (metrics.py, trackers.py); a non-finite loss stops the run.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from fms.models.llama import LLaMA
from torch.distributed.tensor import DTensor

from fms_fsdp.atomic import write_text_keeping_old
from fms_fsdp.checkpoint.export import export_trained_model
from fms_fsdp.checkpoint.io import Checkpointer
from fms_fsdp.checkpoint.policy import KeepPolicy
from fms_fsdp.config import cli_config, to_yaml, train_config
from fms_fsdp.data import get_data_loader
from fms_fsdp.distributed import DistInfo, init_distributed, world_from_env
from fms_fsdp.errors import CheckpointError, ConfigError, DataError, TrainingError
from fms_fsdp.metrics import MetricsReporter
from fms_fsdp.models import build_model, count_params, flops_per_token, get_model_config, init_weights, resolve_variant
from fms_fsdp.parallel import build_mesh, mesh_shape, parallelize
from fms_fsdp.profiling import check_profiler, maybe_profiler
from fms_fsdp.schedule import build_scheduler
from fms_fsdp.trackers import Trackers, start_trackers
from fms_fsdp.triggers import StepTriggers, StopRequest

Batches = Iterator[tuple[torch.Tensor, torch.Tensor]]


def check_config(cfg: train_config) -> None:
    """The start-up checks of the flags that config.py cannot judge alone, each by the module that
    uses them; ConfigError before any process group, model or data is touched."""
    resolve_variant(cfg.model_variant)
    KeepPolicy.parse(cfg.checkpoint_keep, cfg.checkpoint_keep_policy)
    _, world_size, _, local_world_size = world_from_env()
    mesh_shape(cfg, world_size, local_world_size)


def log(info: DistInfo, message: str) -> None:
    """Rank 0 speaks."""
    if info.is_main:
        print(message, flush=True)


def causal_lm_loss(model: LLaMA, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy in fp32 over labels != -100; the logits die inside."""
    logits = model(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
    del logits
    return loss


def train_step(model: LLaMA, optimizer: torch.optim.Optimizer, batches: Batches, cfg: train_config,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One optimizer step over grad_accum_steps micro-batches. Returns the detached loss, the global
    gradient norm (before clipping) and the seconds spent waiting for data."""
    total = torch.zeros((), device=device)
    wait = 0.0
    for micro in range(cfg.grad_accum_steps):
        t = time.perf_counter()
        inputs, labels = next(batches)
        wait += time.perf_counter() - t
        model.set_requires_gradient_sync(micro == cfg.grad_accum_steps - 1)
        loss = causal_lm_loss(model, inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True))
        (loss / cfg.grad_accum_steps).backward()
        total += loss.detach() / cfg.grad_accum_steps
    max_norm = cfg.grad_clip_thresh if cfg.grad_clip_thresh > 0 else math.inf
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, norm, wait


def _check_finite(step: int, loss: torch.Tensor, norm: torch.Tensor) -> None:
    # the norm is global, so every rank takes the same decision
    if not torch.isfinite(norm):
        raise TrainingError(
            f"step {step}: the gradient norm is {norm.item()} (loss on rank {dist.get_rank()}: "
            f"{loss.item()}); lower --learning_rate, check the data, or resume from an earlier checkpoint"
        )


def build(cfg: train_config, info: DistInfo) -> tuple[LLaMA, torch.optim.Optimizer, Any]:
    """The sharded, initialised model, its AdamW optimizer and LR scheduler."""
    model_config = get_model_config(cfg.model_variant, cfg.vocab_size)
    mesh = build_mesh(cfg, info)
    model = build_model(model_config, torch.device("meta") if cfg.low_cpu_fsdp else info.device)
    if not cfg.low_cpu_fsdp:
        init_weights(model, cfg.seed)
    n_ckpt = parallelize(model, cfg, mesh)
    if cfg.low_cpu_fsdp:
        model.to_empty(device=info.device)
        init_weights(model, cfg.seed)
    held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    log(info, f"model {cfg.model_variant}: {count_params(model_config):,} parameters ({held:,} held by rank 0), "
              f"mesh (replicate, shard) = {tuple(mesh.shape)} on {info.device.type}, "
              f"activation checkpointing: {'off' if n_ckpt is None else f'{n_ckpt}/{model_config.nlayers} blocks'}, "
              f"compile: {cfg.use_torch_compile}, bf16: {cfg.mixed_precision}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
    return model, optimizer, build_scheduler(optimizer, cfg)


def train(cfg: train_config, info: DistInfo, stop: Optional[StopRequest] = None) -> list[dict[str, Any]]:
    """Train to num_steps, resuming from ckpt_save_path's newest checkpoint when there is one, until
    done or `stop` is requested; returns the metric records of this run (rank 0 also printed, saved and
    tracked them). Every rank must call it."""
    stop = stop or StopRequest()
    torch.manual_seed(cfg.seed)
    check_profiler(cfg, info)
    if info.is_main:
        Path(cfg.ckpt_save_path).mkdir(parents=True, exist_ok=True)
        write_text_keeping_old(Path(cfg.ckpt_save_path) / "config.yaml", to_yaml(cfg))
        log(info, "resolved config:\n" + to_yaml(cfg).rstrip())
        if info.device.type == "cpu" and cfg.mixed_precision:
            log(info, "note: bf16 matmuls are slow on most CPUs; --mixed_precision=False is often 10x faster there")
    trackers = start_trackers(cfg, info)
    failed = True
    try:
        records = _train(cfg, info, stop, trackers)
        dist.barrier()  # every rank is done: rank 0's tracker uploads keep no one waiting in a collective
        failed = False
        return records
    finally:
        trackers.close(failed)


def _train(cfg: train_config, info: DistInfo, stop: StopRequest, trackers: Trackers) -> list[dict[str, Any]]:
    loader = get_data_loader(cfg, info.rank, info.world_size)  # bad data fails here, before the model
    model, optimizer, scheduler = build(cfg, info)
    checkpointer = Checkpointer(cfg, info, model, optimizer, scheduler, loader)
    start, tokens_seen = checkpointer.resume() or (0, 0)
    if start == 0 and cfg.ckpt_load_path:
        checkpointer.load_model(cfg.ckpt_load_path)
    if start >= cfg.num_steps:
        log(info, f"nothing to train: the checkpoint is at step {start} and --num_steps={cfg.num_steps}; "
                  "raise --num_steps to go on, or use a new --ckpt_save_path to start afresh")
    batches = iter(loader)
    reporter = MetricsReporter(cfg, info, flops_per_token(model.config, cfg.seq_length), start, tokens_seen,
                               trackers)
    triggers = StepTriggers(cfg, info, stop)
    records: list[dict[str, Any]] = []
    pending: Optional[tuple[int, torch.Tensor, torch.Tensor]] = None
    model.train()
    step, stopped = start, False
    with maybe_profiler(cfg, info) as prof:
        for step in range(start + 1, cfg.num_steps + 1):
            loss, norm, wait = train_step(model, optimizer, batches, cfg, info.device)
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            if pending is not None:  # checked one step late: no device sync on the hot path
                _check_finite(*pending)
            pending = (step, loss, norm)
            reporter.step_done(loss, wait)
            boundary = triggers.poll(step, writing=checkpointer.writing())
            if boundary.written:
                checkpointer.commit_pending()
            report_now = step % cfg.report_interval == 0 or step == cfg.num_steps or boundary.stop is not None
            if boundary.save or report_now:  # never checkpoint or report a diverged model
                _check_finite(*pending)
            if boundary.save:
                reporter.checkpoint_saved(checkpointer.save(step, reporter.tokens_seen))
                triggers.saved()
            if report_now:
                records.append(reporter.report(step, lr, norm))
            if boundary.stop is not None:
                log(info, f"stopping after step {step} on {boundary.stop}: the checkpoint is saved, resume by "
                          "running the same command")
                stopped = True
                break
            if prof is not None:
                prof.step()
    checkpointer.commit_pending()
    if cfg.export_model_at_end and not stopped:  # a preempted run keeps its grace period for the checkpoint
        export_trained_model(model, Path(cfg.ckpt_save_path) / f"model_step_{step}.safetensors", step, info.is_main)
    reporter.close()
    return records


def run(cfg: train_config) -> list[dict[str, Any]]:
    """Check the flags the modules judge, start the process group, train, and tear it down."""
    stop = StopRequest()  # first: a SIGTERM/SIGUSR1 during start-up stops the run after its first step
    check_config(cfg)
    info = init_distributed(cfg.device)
    try:
        return train(cfg, info, stop)
    finally:
        dist.destroy_process_group()


def main(argv: Optional[list[str]] = None) -> None:
    """Command-line entry: flags -> config -> run; known errors end in one line and status 1 or 2."""
    cfg = cli_config(argv)
    try:
        run(cfg)
    except (ConfigError, DataError, CheckpointError, TrainingError) as e:
        rank = os.environ.get("RANK", "0")
        if rank == "0":
            print(f"error: {e}", file=sys.stderr, flush=True)
        elif isinstance(e, DataError) and not e.every_rank:  # found by this rank's reader alone
            print(f"error (rank {rank}): {e}", file=sys.stderr, flush=True)
        raise SystemExit(2 if isinstance(e, (ConfigError, DataError)) else 1) from None
