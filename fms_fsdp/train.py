"""The training loop, top to bottom.

`main`: flags -> train_config (config.py) -> `run`: the flags that other modules judge are checked
(`check_config`), the process group starts (distributed.py), then `train`: the data loader first (bad
data fails before the model is built), the model (models.py) parallelised (parallel.py), AdamW and
the LR schedule (schedule.py); resume from the newest checkpoint or start from --ckpt_load_path
(checkpoint/io.py); then step. A step reads nothing back from the device and takes no collective
beyond FSDP's (and the norm's all-reduce when clipping); every few seconds the ranks agree on stop
requests and time-based saves (triggers.py). Bad steps are judged on the device (guard.py: a non-finite
step stops the run, --skip_bad_steps leaves spikes out) and read at report, checkpoint and stop steps,
before the run checkpoints and reports (metrics.py, trackers.py).
"""

from __future__ import annotations

import math
import os
import re
import sys
import time
from contextlib import closing
from dataclasses import replace
from typing import Any, Iterator, NoReturn, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fms_fsdp.atomic import write_text_keeping_old
from fms_fsdp.checkpoint.export import PeriodicExporter, export_trained_model
from fms_fsdp.checkpoint.io import Checkpointer
from fms_fsdp.checkpoint.policy import KeepPolicy
from fms_fsdp.config import cli_config, parse_fraction, to_yaml, train_config
from fms_fsdp.data import get_data_loader
from fms_fsdp.data.build import check_tokenizer
from fms_fsdp.distributed import (LAUNCHER_DIED, DistInfo, exit_with_parent, init_distributed, lost_peer,
                                  on_rank0, resolve_device, world_from_env)
from fms_fsdp.errors import CheckpointError, ConfigError, DataError, TrainingError, first_line
from fms_fsdp.evaluate import Evaluator
from fms_fsdp.guard import StepGuard
from fms_fsdp.metrics import MetricsReporter
from fms_fsdp.models import (CausalLM, build_model, count_params, flops_per_token, get_model_config, init_weights,
                             resolve_variant)
from fms_fsdp.float8 import check_float8, float8_all_gather, scale_hook
from fms_fsdp.lora import LoRASpec, add_adapters, check_lora
from fms_fsdp.memory import fits_or_warning
from fms_fsdp.memory import report as memory_report
from fms_fsdp.optim import build_optimizer, clip_gradients
from fms_fsdp.parallel import build_mesh, check_tensor_parallel, mesh_shape, parallelize, set_gradient_sync
from fms_fsdp.profiling import check_profiler, maybe_profiler
from fms_fsdp.schedule import build_scheduler
from fms_fsdp.storage import location, make_folder
from fms_fsdp.trackers import Trackers, start_trackers
from fms_fsdp.triggers import StepTriggers, StopRequest

Batches = Iterator[tuple[torch.Tensor, torch.Tensor]]


def check_config(cfg: train_config) -> None:
    """The start-up checks of the flags that config.py cannot judge alone, each by the module that
    uses them; ConfigError before any process group, model or data is touched."""
    resolve_variant(cfg.model_variant)
    KeepPolicy.parse(cfg.checkpoint_keep, cfg.checkpoint_keep_policy)
    _, _, local_rank, _ = world_from_env()
    mesh_shape(cfg, *planned_world(cfg))
    check_tensor_parallel(cfg, get_model_config(cfg.model_variant, cfg.vocab_size, cfg.seq_length))
    if cfg.float8 and not cfg.dry_run:
        check_float8(resolve_device(cfg.device, local_rank))
    check_lora(cfg)
    if cfg.tokenizer_path is not None:
        check_tokenizer(cfg)


def planned_world(cfg: train_config) -> tuple[int, int]:
    """(world size, ranks per node) of this launch, or in a dry run the --plan_world_size the plan is for
    (up to 8 ranks per node)."""
    _, world_size, _, local_world_size = world_from_env()
    if cfg.plan_world_size is None or not cfg.dry_run:
        return world_size, local_world_size
    return cfg.plan_world_size, min(cfg.plan_world_size, 8)


def dry_run(cfg: train_config) -> None:
    """--dry_run: rank 0 prints the memory plan; no process group starts, no GPU memory is touched."""
    check_config(cfg)
    text = memory_report(cfg, *planned_world(cfg))
    if world_from_env()[0] == 0:
        print(text, flush=True)


def log(info: DistInfo, message: str) -> None:
    """Rank 0 speaks."""
    if info.is_main:
        print(message, flush=True)


def to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host batch to `device` without blocking the host: through pinned memory on CUDA."""
    if device.type == "cuda":
        batch = batch.pin_memory()
    return batch.to(device, non_blocking=True)


def train_step(model: CausalLM, optimizer: torch.optim.Optimizer, guard: StepGuard, step: int, batches: Batches,
               cfg: train_config, device: torch.device, global_norm: bool) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Optimizer step `step` over grad_accum_steps micro-batches, without a host sync; `guard` judges
    it before the update (and may leave it out). Returns the detached loss, the gradient norm before
    clipping (global when clipping, skipping bad steps or `global_norm`, else this rank's) and the
    seconds spent waiting for data."""
    total = torch.zeros((), device=device)
    wait = 0.0
    for micro in range(cfg.grad_accum_steps):
        t = time.perf_counter()
        inputs, labels = next(batches)
        wait += time.perf_counter() - t
        set_gradient_sync(model, micro == cfg.grad_accum_steps - 1)
        loss = model(to_device(inputs, device), labels=to_device(labels, device))
        (loss / cfg.grad_accum_steps).backward()
        total += loss.detach() / cfg.grad_accum_steps
    norm = clip_gradients(model, cfg.grad_clip_thresh, global_norm or guard.skipping)
    guard.judge(step, total, norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, norm, wait


def out_of_memory_error(step: int, error: torch.OutOfMemoryError, cfg: train_config,
                        device: torch.device) -> TrainingError:
    """The one-line error for an out-of-memory at `step`: what was being allocated, the device's
    memory, and the flags that lower the peak."""
    asked = re.search(r"[Tt]ried to allocate ([\d.]+ [KMGT]?i?B)", str(error))
    what = f"allocating {asked.group(1)}" if asked else "out of memory"
    where = device.type
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        where = (f"{props.name} ({props.total_memory / 2**30:.1f} GiB, "
                 f"{torch.cuda.memory_allocated(device) / 2**30:.1f} GiB allocated)")
    fraction = parse_fraction("selective_checkpointing", cfg.selective_checkpointing)
    if not cfg.fsdp_activation_checkpointing or fraction < 1:
        advice = (f"lower --batch_size (now {cfg.batch_size}) or checkpoint more blocks "
                  "(--fsdp_activation_checkpointing=True --selective_checkpointing=1)")
    else:
        advice = f"lower --batch_size (now {cfg.batch_size}) or shard over more GPUs"
    return TrainingError(f"step {step}: out of memory {what} on {where}; {advice}", every_rank=False)


def build(cfg: train_config, info: DistInfo) -> tuple[CausalLM, torch.optim.Optimizer, Any]:
    """The sharded, initialised model, its AdamW optimizer and LR scheduler."""
    model_config = get_model_config(cfg.model_variant, cfg.vocab_size, cfg.seq_length, cfg.tensor_parallel_size)
    if info.device.type == "cuda" and info.is_main:
        warning = fits_or_warning(cfg, info.world_size, info.local_world_size)
        if warning:
            log(info, warning)
    mesh = build_mesh(cfg, info)
    model = build_model(model_config, torch.device("meta") if cfg.low_cpu_fsdp else info.device)
    n_lora = add_adapters(model, LoRASpec.of(cfg)) if cfg.lora_rank else 0
    if not cfg.low_cpu_fsdp:
        init_weights(model, cfg.seed)
    done = parallelize(model, cfg, mesh)
    if cfg.low_cpu_fsdp:
        model.to_empty(device=info.device)
        init_weights(model, cfg.seed)
    held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    n_ckpt = done.checkpointed
    log(info, f"model {cfg.model_variant}: {count_params(model_config):,} parameters ({held:,} held by rank 0), "
              f"mesh ({', '.join(mesh.mesh_dim_names or ())}) = {tuple(mesh.shape)} on {info.device.type}, "
              f"activation checkpointing: {'off' if n_ckpt is None else f'{n_ckpt}/{model_config.nlayers} blocks, {cfg.ac_mode}'}, "
              f"compile: {cfg.use_torch_compile}, bf16: {cfg.mixed_precision}"
              + (f", float8 ({cfg.float8_recipe}): {done.float8} Linear layers" if cfg.float8 else "")
              + (f", LoRA rank {cfg.lora_rank} on {n_lora} layers, "
                 f"{sum(p.numel() for p in model.parameters() if p.requires_grad):,} trainable parameters held"
                 if cfg.lora_rank else ""))
    if cfg.float8 and done.float8 == 0:
        log(info, f"warning: --float8=True converted no Linear layer: none has >= --float8_min_size={cfg.float8_min_size} "
                  "features in and out")
    optimizer = build_optimizer(model, cfg, info.device)
    if float8_all_gather(cfg, mesh["shard"].size() > 1):
        optimizer.register_step_post_hook(scale_hook(model))
    return model, optimizer, build_scheduler(optimizer, cfg)


def train(cfg: train_config, info: DistInfo, stop: Optional[StopRequest] = None) -> list[dict[str, Any]]:
    """Train to num_steps, resuming from ckpt_save_path's newest checkpoint when there is one, until
    done or `stop` is requested; returns the metric records of this run (rank 0 also printed, saved and
    tracked them). Every rank must call it."""
    if stop is None:
        stop = StopRequest()
        try:
            return train(cfg, info, stop)
        finally:
            stop.restore()
    info = replace(info, tp=cfg.tensor_parallel_size)
    torch.manual_seed(cfg.seed)
    check_profiler(cfg, info)
    on_rank0(lambda: write_run_config(cfg), CheckpointError, CheckpointError)
    if info.is_main:
        log(info, "resolved config:\n" + to_yaml(cfg).rstrip())
        if info.device.type == "cpu" and cfg.mixed_precision:
            log(info, "note: bf16 matmuls are slow on most CPUs; --mixed_precision=False is often 10x faster there")
    trackers = start_trackers(cfg, info)
    failed = True
    try:
        records = _train(cfg, info, stop, trackers)
        failed = False
        return records
    finally:
        trackers.close(failed)


def write_run_config(cfg: train_config) -> None:
    """<ckpt_save_path>/config.yaml (an earlier, different one is kept as config.<n>.yaml). The first
    write of a run: a path that cannot be written (a read-only disk; a missing bucket, no endpoint or
    no access in object storage) is a CheckpointError naming it, before any work."""
    root = location(cfg.ckpt_save_path, "ckpt_save_path")
    try:
        make_folder(root)
        write_text_keeping_old(root / "config.yaml", to_yaml(cfg))
    except Exception as e:  # fsspec filesystems raise their clients' own errors too
        raise CheckpointError(f"--ckpt_save_path: cannot write {cfg.ckpt_save_path} "
                              f"({type(e).__name__}: {first_line(e)})") from None


def _train(cfg: train_config, info: DistInfo, stop: StopRequest, trackers: Trackers) -> list[dict[str, Any]]:
    loader = get_data_loader(cfg, info.dp_rank, info.dp_size)  # bad data fails here, before the model
    evaluator = Evaluator(cfg, info, get_model_config(cfg.model_variant, cfg.vocab_size).src_vocab_size)
    model, optimizer, scheduler = build(cfg, info)
    checkpointer = Checkpointer(cfg, info, model, optimizer, scheduler, loader)
    if cfg.lora_rank:  # the frozen base is not in this run's checkpoints: it is loaded at every start
        checkpointer.load_model(cfg.ckpt_load_path)
    start, tokens_seen = checkpointer.resume() or (0, 0)
    if start == 0 and cfg.ckpt_load_path and not cfg.lora_rank:
        checkpointer.load_model(cfg.ckpt_load_path)
    if start >= cfg.num_steps:
        log(info, f"nothing to train: the checkpoint is at step {start} and --num_steps={cfg.num_steps}; "
                  "raise --num_steps to go on, or use a new --ckpt_save_path to start afresh")
    reporter = MetricsReporter(cfg, info, flops_per_token(model.config, cfg.seq_length), start, tokens_seen,
                               trackers)
    triggers = StepTriggers(cfg, info, stop, start)
    guard = StepGuard(cfg, optimizer, info.device)
    exporter = PeriodicExporter(cfg, info, model)
    records: list[dict[str, Any]] = []
    model.train()
    step, stopped = start, None
    # closed on the way out, an exception too: its workers stop now, not at exit, where they would
    # wait (they leave SIGTERM to the rank) and hold the rank forever
    with closing(iter(loader)) as batches, maybe_profiler(cfg, info) as prof:
        for step in range(start + 1, cfg.num_steps + 1):
            report_step = step % cfg.report_interval == 0 or step == cfg.num_steps
            try:
                loss, norm, wait = train_step(model, optimizer, guard, step, batches, cfg, info.device,
                                              global_norm=report_step)
            except torch.OutOfMemoryError as e:  # one line, not a traceback; earlier checkpoints are untouched
                raise out_of_memory_error(step, e, cfg, info.device) from None
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            reporter.step_done(loss, wait, guard.kept)
            boundary = triggers.poll(step, writing=checkpointer.writing())
            if boundary.written:
                checkpointer.commit_pending()
            export, evaluate = exporter.due(step), evaluator.due(step)
            if boundary.save or report_step or boundary.stop or export or evaluate:
                guard.check()  # never save, export, evaluate or report a diverged model
            if boundary.save:
                stall = checkpointer.save(step, reporter.tokens_seen)
                reporter.checkpoint_saved(stall)
                triggers.saved(stall)
            if export:
                exporter.export(step)
            if evaluate:
                reporter.evaluated(evaluator.evaluate(model, step))
            if report_step or boundary.stop:
                global_norm = report_step or cfg.grad_clip_thresh > 0 or guard.skipping
                skipped = guard.skipped_since_report() if guard.skipping else None
                records.append(reporter.report(step, lr, norm if global_norm else None, skipped))
            if boundary.stop is not None:
                stopped = boundary.stop
                break
            if prof is not None:
                prof.step()
    checkpointer.close()
    exporter.close()
    reporter.close()
    if stopped is not None:
        outcome = "the checkpoint is saved, resume by running the same command" if cfg.checkpoint_interval != 0 \
            else "no checkpoint (--checkpoint_interval=0)"
        if stopped == LAUNCHER_DIED.name:  # an error, so that torchrun on every node ends now
            raise TrainingError(f"stopped after step {step}: the launcher (torchrun) of a rank died; {outcome}")
        log(info, f"stopping after step {step} on {stopped}: {outcome}")
    elif cfg.export_model_at_end:  # a preempted run keeps its grace period for the checkpoint
        export_trained_model(model, location(cfg.ckpt_save_path, "ckpt_save_path") / f"model_step_{step}.safetensors",
                             step, info.is_main, cfg)
    # every rank is done (and waits for rank 0's file work on a group without the training timeout);
    # rank 0's tracker uploads then keep no one waiting in a collective
    dist.barrier(group=checkpointer.group)
    return records


def run(cfg: train_config) -> list[dict[str, Any]]:
    """Check the flags the modules judge, start the process group, train, and tear it down."""
    stop = StopRequest()  # first: a stop signal during start-up stops the run after its first step
    try:
        check_config(cfg)
        info = init_distributed(cfg.device, cfg.collective_timeout_minutes)
        try:
            return train(cfg, info, stop)
        finally:
            dist.destroy_process_group()
    finally:
        stop.restore()


KNOWN_ERRORS = (ConfigError, DataError, CheckpointError, TrainingError)


def exit_on(error: Exception) -> NoReturn:
    """End a command on one of KNOWN_ERRORS: one line (rank 0's, or the rank that alone found it),
    status 2 for bad flags or data, 1 otherwise."""
    rank = os.environ.get("RANK", "0")
    if rank == "0":
        print(f"error: {error}", file=sys.stderr, flush=True)
    elif isinstance(error, (DataError, TrainingError)) and not error.every_rank:  # found by this rank alone
        print(f"error (rank {rank}): {error}", file=sys.stderr, flush=True)
    raise SystemExit(2 if isinstance(error, (ConfigError, DataError)) else 1) from None


def main(argv: Optional[list[str]] = None) -> None:
    """Command-line entry: flags -> config -> run; known errors end in one line and status 1 or 2. A
    rank started by torchrun stops (saving, as on a preemption, then failing) if torchrun dies."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        exit_with_parent(LAUNCHER_DIED)
    cfg = cli_config(argv)
    try:
        dry_run(cfg) if cfg.dry_run else run(cfg)
    except KNOWN_ERRORS as e:
        exit_on(e)
    except (RuntimeError, dist.DistError) as e:
        if not lost_peer(e):
            raise
        cause = re.sub(r"^\[[^\]]*\]\s*", "", first_line(e)).split(". This is typically")[0]  # gloo's source path
        exit_on(TrainingError(f"lost contact with another rank ({cause}): a process or node of this run "
                              "died or hung, its log has the cause; run the same command again to resume from "
                              "the last checkpoint", every_rank=False))


def evaluate_model(cfg: train_config) -> dict[str, Any]:
    """The model of --ckpt_load_path (a checkpoint folder, a safetensors/.pth file or a Hugging Face
    folder), built as training builds it, evaluated on --eval_data_path by every rank of the launch;
    rank 0 prints one `EVAL dataset=<name> loss=.. ppl=.. tokens=..` line per dataset and one for all."""
    if not cfg.ckpt_load_path or not cfg.eval_data_path:
        raise ConfigError("--ckpt_load_path and --eval_data_path are needed: the weights to evaluate and the data")
    if cfg.lora_rank:
        raise ConfigError("evaluation takes whole models: drop --lora_rank and give --ckpt_load_path a LoRA run's "
                          "merged export (model_step_<N>.safetensors or exports/step_<N>)")
    check_config(cfg)
    info = replace(init_distributed(cfg.device, cfg.collective_timeout_minutes), tp=cfg.tensor_parallel_size)
    try:
        evaluator = Evaluator(cfg, info, get_model_config(cfg.model_variant, cfg.vocab_size).src_vocab_size)
        model, optimizer, scheduler = build(cfg, info)
        Checkpointer(cfg, info, model, optimizer, scheduler, loader=None).load_model(cfg.ckpt_load_path)
        record = evaluator.evaluate(model, 0)
    finally:
        dist.destroy_process_group()
    names = [k.split("/", 1)[1] for k in record if k.startswith("eval_loss/")]
    rows = [(name, record[f"eval_loss/{name}"], record[f"eval_tokens/{name}"]) for name in names]
    for name, loss, tokens in [*rows, ("all", record["eval_loss"], record["eval_tokens"])]:
        log(info, f"EVAL dataset={name} loss={loss:.6f} ppl={math.exp(loss):.4f} tokens={tokens}")
    return record


def evaluate_main(argv: Optional[list[str]] = None) -> None:
    """`fms-evaluate` / scripts/evaluate.py: training's flags (--eval_interval not needed); known errors
    end in one line and status 1 or 2."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a.startswith("--eval_data_path") for a in argv):
        argv = ["--eval_interval=1", *argv]  # evaluating is the point; a given --eval_interval still wins
    cfg = cli_config(argv)
    try:
        evaluate_model(cfg)
    except KNOWN_ERRORS as e:
        exit_on(e)
