"""The training loop, top to bottom.

`run_training`: the run's facts and start-up checks (startup.facts, under the stop signals), the process group
and mesh, then `train_run`: the run lease on --ckpt_save_path (resilience/lease.py; before any write there) and
the trackers, the data loader first (bad data fails before the model is built), the model parallelised and its
optimizer (parallel/assemble.py), the start (checkpoint/checkpointer.py: resume from the newest checkpoint, else
--ckpt_load_path's weights), config.yaml once started; then step. A step reads nothing back
from the device and takes no collective beyond FSDP's (and the norm's all-reduce when clipping);
every few seconds the ranks agree on stop requests and time-based saves (resilience/triggers.py). Bad steps are
judged on the device (train/guard.py: a non-finite step stops the run, --skip_bad_steps leaves spikes out)
and read at report, checkpoint and stop steps, before the run writes a checkpoint, reports
(metrics/reporter.py, metrics/trackers.py; resilience/stragglers.py names the slowest rank), commits the checkpoint, then runs the periodic work that is due
(periodic.py: exports, evaluation, lm-eval's tasks, the profiler; each returns a Report the metrics
take). Under --fault_tolerance (resilience/ft.py) each step begins with the replica groups' quorum (a group
behind the others catches up there and goes on from the step it got) and commits only when torchft says
so; one that does not runs again on the same batches. What the loop opens is closed through one
ExitStack, so a step that raises still stops the loader's workers, the exporter's thread and frees the
staging buffers.

A training collective that times out leaves every live rank's stacks and last collectives, and one
line naming the ranks that did not reach it (resilience/hangs.py).

`_build` makes the loop's collaborators (a `Loop`), `_steps` runs the steps, `_after_step` is the
order of what follows each (the loop's contract), `_end` says how the run ended.
"""

from __future__ import annotations

import time
from contextlib import ExitStack, closing
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions

from fms_fsdp.checkpoint.checkpointer import Checkpointer
from fms_fsdp.checkpoint.export import PeriodicExporter, export_trained_model
from fms_fsdp.checkpoint.save import CheckpointSaver
from fms_fsdp.context import Run
from fms_fsdp.data import get_data_loader
from fms_fsdp.determinism import deterministic
from fms_fsdp.errors import CheckpointError, ConfigError, TrainingError
from fms_fsdp.evaluation.evaluate import Evaluator
from fms_fsdp.evaluation.harness import HarnessEvaluator
from fms_fsdp.lifetime import LAUNCHER_DIED
from fms_fsdp.memory.report import fits_or_warning
from fms_fsdp.metrics.reporter import MetricsReporter, check_metrics_file
from fms_fsdp.metrics.trackers import Trackers, start_trackers
from fms_fsdp.model.variants import CausalLM, flops_per_token
from fms_fsdp.parallel.assemble import build_stages
from fms_fsdp.parallel.pipeline import Pipeline
from fms_fsdp.parallel.process_group import agreement_group, on_rank0
from fms_fsdp.periodic import Periodic, Report
from fms_fsdp.profiling import StepProfiler
from fms_fsdp.resilience.ft import FaultTolerance, Replay
from fms_fsdp.resilience.ft_settings import fingerprint
from fms_fsdp.resilience.hangs import HangDiagnostics, timed_out
from fms_fsdp.resilience.lease import RunLease
from fms_fsdp.resilience.stragglers import Stragglers
from fms_fsdp.resilience.triggers import StepTriggers, StopRequest
from fms_fsdp.startup import model_build, optimizer_and_schedule, started, summary, write_config
from fms_fsdp.train.guard import StepGuard
from fms_fsdp.train.step import StepResult, not_deterministic_error, out_of_memory_error, train_step
from fms_fsdp.weights.ema import WeightAverage

_TRAINED = StateDictOptions(ignore_frozen_params=True)  # what --ema_decay averages: with LoRA, the adapters


def run_training(facts_of: Callable[[], Run]) -> list[dict[str, Any]]:
    """Work out the run's facts (`facts_of`: startup.facts of the flags, which checks the flags the modules
    judge), start the process group, train, and tear it down; the stop signals are this function's from
    its first line (a signal during start-up stops the run after its first step) to its last. A run
    stopped before --num_steps then exits with --stop_exit_status when it is not 0."""
    stop = StopRequest()
    try:
        with started(facts_of()) as run, deterministic(run.settings.loop.deterministic, run.settings.loop.seed):
            records = train_run(run, stop)
    finally:
        stop.restore()
    status = run.settings.loop.stop_exit_status
    if stop.agreed is not None and status:  # stopped early: Kubernetes restarts a failed pod
        raise SystemExit(status)
    return records


def _warn_if_memory_short(run: Run) -> None:
    """On GPUs, rank 0 says before the model is built when the memory plan does not fit the device."""
    if run.device.type == "cuda" and run.info.is_main:
        memory, info = run.settings.memory, run.info
        warning = fits_or_warning(memory, run.shape, run.model_config, run.pipeline, info.local_world_size)
        if warning:
            run.log(warning)


def _quorum(ft: FaultTolerance, step: int, batches: Replay, reporter: MetricsReporter, triggers: StepTriggers) -> int:
    """--fault_tolerance: the replica groups' quorum before step `step` + 1; a group behind the others
    catches up there, and goes on from the step it got (and the data position, when it came with it)."""
    caught_up = ft.begin(step + 1)
    if caught_up is None:
        return step
    reporter.caught_up(caught_up.step, caught_up.tokens_seen)
    triggers.moved(caught_up.step)
    if caught_up.position:
        batches.restart()
    else:
        batches.again()
    return caught_up.step


def train_run(run: Run, stop: StopRequest) -> list[dict[str, Any]]:
    """Train to num_steps, resuming from ckpt_save_path's newest checkpoint when there is one, until
    done or `stop` is requested; returns the metric records of this run (rank 0 also printed, saved and
    tracked them). Every rank calls it, with the process group up."""
    settings = run.settings.loop
    torch.manual_seed(settings.seed)
    lease = RunLease(run.paths.root)
    run.hold_log()  # a start that fails says its error alone; a started run its lines, then a summary
    note = on_rank0(lease.acquire, ConfigError, ConfigError)  # before any write there
    try:
        on_rank0(lambda: check_metrics_file(run.paths.metrics), ConfigError, ConfigError)
        if note:
            run.log(note)
        for line in run.notes:
            run.log(line)
        if run.device.type == "cpu" and settings.mixed_precision:
            run.log("note: bf16 matmuls are slow on most CPUs; --mixed_precision=False is often 10x faster there")
        hangs = HangDiagnostics.start(
            folder=run.paths.diagnostics, rank=run.info.rank, timeout_minutes=run.settings.triggers.timeout_minutes
        )
        trackers = start_trackers(run.settings.trackers, run.paths.root)
        failed = True
        try:
            records = _train(run, stop, trackers, lease, hangs.hosts)
            failed = False
            return records
        except Exception as e:
            if timed_out(e):  # every rank still alive dumps what it was doing; one line names who hung
                raise hangs.diagnose(e) from None
            raise
        finally:
            trackers.close(failed)
    finally:
        if run.info.is_main:
            lease.release()


@dataclass(kw_only=True)
class Loop:
    """The collaborators of one training loop, built once by `_build`."""

    run: Run
    loader: Any
    model: CausalLM
    pipeline: Optional[Pipeline]
    optimizer: torch.optim.Optimizer
    scheduler: Any
    guard: StepGuard
    ft: Optional[FaultTolerance]
    checkpointer: Checkpointer
    reporter: MetricsReporter
    triggers: StepTriggers
    stragglers: Stragglers
    periodic: list[Periodic]  # run in this order at a step: export, evaluation, lm-eval tasks, profiler
    average: Optional[WeightAverage]  # --ema_decay's, moved after every committed step
    records: list[dict[str, Any]] = field(default_factory=list)


def _train(run: Run, stop: StopRequest, trackers: Trackers, lease: RunLease, hosts: list[str]) -> list[dict[str, Any]]:
    """Build the loop, run its steps, finish what is in flight, say how it ended; its records."""
    with ExitStack() as stack:  # closed on the way out, an exception too
        loop, start = _build(run, stop, trackers, lease, hosts, stack)
        # the loader's workers stop with the loop, before the last commit
        with closing(_batches(loop)) as batches:
            step, stopped = _steps(loop, batches, start)
            stop.agreed = stopped
        loop.checkpointer.finish()
        for work in loop.periodic:
            work.finish()
        if stopped is None:  # a cache's build (rank 0) goes on past the loop, to be waited for; a stop stops it
            getattr(loop.loader, "keep_building", lambda: None)()
    _end(loop, step, stopped)
    if stopped is None:  # rank 0 waits for the build after the last collective with the training's timeout
        getattr(loop.loader, "finish", lambda: None)()
    # every rank is done (and waits for rank 0's file work on a group without the training timeout);
    # rank 0's tracker uploads then keep no one waiting in a collective
    dist.barrier(group=agreement_group())
    return loop.records


def _build(
    run: Run, stop: StopRequest, trackers: Trackers, lease: RunLease, hosts: list[str], stack: ExitStack
) -> tuple[Loop, int]:
    """The loop's collaborators, each closed by `stack`, and the step it starts from (a resume's);
    `hosts`: every rank's host."""
    settings, info = run.settings.loop, run.info
    loader = get_data_loader(run.settings.data, info.data_rank, info.data_size)  # bad data fails before the model
    stack.callback(getattr(loader, "close", lambda: None))  # a cache's build (rank 0) stops with the run
    # the tasks load before the model
    evaluator, harness = Evaluator(run.settings.evaluation, info), HarnessEvaluator(run.settings.harness, info)
    _warn_if_memory_short(run)
    assert run.mesh is not None, "the process group is up (started)"
    model, pipeline = build_stages(model_build(run), run.mesh, run.log)
    evaluator.pipeline = pipeline
    optimizer, scheduler = optimizer_and_schedule(run, model)
    guard = StepGuard(settings.skip_bad_steps, settings.spike_sigma, optimizer, info.device)
    ft = _fault_tolerance(run, model, optimizer, scheduler, loader, guard, stack)
    average = WeightAverage(model, settings.ema_decay, _TRAINED, settings.ema_on_host) if settings.ema_decay else None
    evaluator.average = average
    checkpointer = _checkpointer(run, model, optimizer, scheduler, loader, lease, ft, average, stack)
    exporter = PeriodicExporter(
        settings=run.settings.export, root=run.paths.exports, info=info, model=model, average=average
    )
    stack.callback(exporter.close)
    start, tokens_seen = checkpointer.start()
    if ft is not None:
        ft.resumed(start, tokens_seen)
    _started(run, start)
    lines = getattr(loader, "lines_by_dataset", None)  # the synthetic loader has no datasets
    flops = flops_per_token(model.config, settings.seq_length)
    reporter = MetricsReporter(
        run.settings.metrics, info, run.paths.metrics, flops, start, tokens_seen, trackers, lines
    )
    stack.callback(reporter.close)
    triggers = StepTriggers(run.settings.triggers, info, stop, start)
    stragglers = Stragglers(
        model, info.device, hosts, settings.straggler_threshold, settings.straggler_reports, run.log
    )
    stack.callback(stragglers.close)
    profiler = StepProfiler(run.settings.profiler, info, run.paths.root)
    stack.callback(profiler.close)
    model.train()
    periodic: list[Periodic] = [exporter, evaluator, harness, profiler]
    loop = Loop(
        run=run,
        loader=loader,
        model=model,
        pipeline=pipeline,
        optimizer=optimizer,
        scheduler=scheduler,
        guard=guard,
        ft=ft,
        checkpointer=checkpointer,
        reporter=reporter,
        triggers=triggers,
        stragglers=stragglers,
        periodic=periodic,
        average=average,
    )
    return loop, start


def _checkpointer(
    run: Run,
    model: CausalLM,
    optimizer: Any,
    scheduler: Any,
    loader: Any,
    lease: RunLease,
    ft: Optional[FaultTolerance],
    average: Optional[WeightAverage],
    stack: ExitStack,
) -> Checkpointer:
    """The run's checkpoints (closed by `stack`): the lease confirmed and fault tolerance's state kept at
    each save."""
    saver = CheckpointSaver(
        settings=run.settings.checkpoint,
        root=run.paths.checkpoints,
        info=run.info,
        config=run.flags,
        log=run.log,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        loader=loader,
        lease=lease,
        ft=ft,
        average=average,
    )
    checkpointer = Checkpointer(saver=saver, metrics=run.paths.metrics, variant=run.variant)
    stack.callback(checkpointer.close)
    return checkpointer


def _started(run: Run, start: int) -> None:
    """The start has succeeded: the config written, the start's lines said, NCCL's dump folder made."""
    on_rank0(lambda: write_config(run), CheckpointError, CheckpointError)
    run.release_log(summary(run, start))
    HangDiagnostics.started(run.device, run.paths.nccl_traces)
    num_steps = run.settings.loop.num_steps
    if start >= num_steps:
        run.log(
            f"nothing to train: the checkpoint is at step {start} and --num_steps={num_steps}; "
            "raise --num_steps to go on, or use a new --ckpt_save_path to start afresh"
        )


def _fault_tolerance(
    run: Run, model: CausalLM, optimizer: Any, scheduler: Any, loader: Any, guard: StepGuard, stack: ExitStack
) -> Optional[FaultTolerance]:
    """--fault_tolerance's replica-group membership (closed by `stack`), None without it."""
    if run.ft is None:
        return None
    fp = fingerprint(run.ft.shared, run.model_config, run.shape)
    ft = FaultTolerance(run.ft, model, optimizer, scheduler, loader, guard, fp, run.device, run.log)
    stack.callback(ft.close)
    return ft


def _batches(loop: Loop) -> Any:
    """The loop's batches: replayable under --fault_tolerance (a step that does not commit runs again on
    its batches), placeholders on a pipeline stage that reads no data."""
    settings = loop.run.settings.loop
    if loop.ft is not None:
        return Replay(loop.loader)
    if loop.pipeline is None or loop.pipeline.reads_data(loop.model):
        return iter(loop.loader)
    return loop.pipeline.no_data(settings.batch_size, settings.seq_length)


def _steps(loop: Loop, batches: Any, step: int) -> tuple[int, Optional[str]]:
    """Train from `step` to --num_steps or a stop request: (the last step, the stop signal's name or
    None). Under --fault_tolerance each step begins with the replica groups' quorum."""
    settings = loop.run.settings.loop
    while step < settings.num_steps:
        if loop.ft is not None:
            step = _quorum(loop.ft, step, batches, loop.reporter, loop.triggers)
            if step >= settings.num_steps:
                break
        step += 1
        report_step = step % settings.report_interval == 0 or step == settings.num_steps
        done = _attempt(loop, step, batches, report_step)
        if done is None:  # --fault_tolerance: not committed; the same batches again, with the live groups
            step -= 1
            continue
        stopped = _after_step(loop, step, done, report_step, batches)
        if stopped is not None:
            return step, stopped
    return step, None


def _attempt(loop: Loop, step: int, batches: Any, report_step: bool) -> Optional[StepResult]:
    """Optimizer step `step` (train_step); None under --fault_tolerance when it did not commit, its
    batches then served again."""
    run = loop.run
    started_at = time.perf_counter()
    try:
        done = train_step(
            model=loop.model,
            optimizer=loop.optimizer,
            guard=loop.guard,
            step=step,
            batches=batches,
            settings=run.settings.step,
            device=run.device,
            global_norm=report_step,
            pipeline=loop.pipeline,
            ft=loop.ft,
        )
    except torch.OutOfMemoryError as e:  # one line, not a traceback; earlier checkpoints are untouched
        raise out_of_memory_error(
            step, e, run.settings.loop.batch_size, run.settings.parallel.checkpointing, run.device
        ) from None
    except RuntimeError as e:  # --deterministic and an operation without a deterministic kernel: one line
        told = not_deterministic_error(step, e)
        if told is None:
            raise
        raise told from None
    if done is None:
        assert loop.ft is not None
        loop.ft.failed_attempt(time.perf_counter() - started_at)
        batches.again()
    elif loop.average is not None:
        loop.average.update(loop.guard.kept)
    return done


def _after_step(loop: Loop, step: int, done: StepResult, report_step: bool, batches: Any) -> Optional[str]:
    """What follows a committed step, in the order docs/checkpoints.md gives: the schedule, the stop and
    save agreement, a checkpoint written, the report, the checkpoint's commit, then the periodic work
    that is due (exports, evaluation, lm-eval tasks, the profiler). The stop signal's name when the run
    stops here."""
    ft, reporter, checkpointer = loop.ft, loop.reporter, loop.checkpointer
    lr = float(loop.scheduler.get_last_lr()[0])  # a tensor for torchao's AdamW
    loop.scheduler.step()
    reporter.step_done(done.loss, done.data_wait, loop.guard.kept, done.z_loss, len(ft.present) if ft else 1)
    if ft is not None:
        batches.committed()
        ft.publish(step, reporter.tokens_seen)
    boundary = loop.triggers.poll(step, writing=checkpointer.writing())
    if boundary.written:
        checkpointer.commit_pending()
    due = [work for work in loop.periodic if work.due(step)]
    if boundary.save or report_step or boundary.stop or any(work.reads_model for work in due):
        loop.guard.check()  # never save, export, evaluate or report a diverged model
    if boundary.save:
        stall = checkpointer.save(step, reporter.tokens_seen)
        reporter.checkpoint_saved(stall)
    if report_step or boundary.stop:  # before the commit: a checkpoint's step has its record
        loop.records.append(_report(loop, step, lr, done.grad_norm, report_step))
    if boundary.save:
        commit_s = checkpointer.commit_written()
        reporter.record(Report(commit_s))
        loop.triggers.saved(stall + commit_s)
    for work in due:
        report = work.run(step, loop.model)
        reporter.record(report)
        if report.scores_checkpoint and report.record is not None:
            checkpointer.scored(step, report.record)  # --checkpoint_keep_best ranks this step's checkpoint
    return boundary.stop


def _report(loop: Loop, step: int, lr: float, grad_norm: torch.Tensor, report_step: bool) -> dict[str, Any]:
    """The interval's record (every rank calls it): the gradient norm where it is global (the step's
    clipping or guard made it so, or a report step asked for it), the steps left out by
    --skip_bad_steps, the slowest rank's figures, --fault_tolerance's and a sparse model's routing."""
    settings, guard, reporter = loop.run.settings.loop, loop.guard, loop.reporter
    global_norm = report_step or settings.grad_clip_thresh > 0 or guard.skipping
    skipped = guard.skipped_since_report() if guard.skipping else None
    extra = loop.stragglers.report(reporter.data_wait, time.perf_counter() - reporter.interval_start)
    extra.update(loop.ft.report() if loop.ft is not None else {})
    extra.update(getattr(loop.loader, "data_report", dict)())  # a cache read while built
    routing = loop.model.routing
    if routing is not None and routing.stats is not None:
        extra.update(routing.stats.report(dropping=routing.capacity_factor > 0))
    return loop.reporter.report(step, lr, grad_norm if global_norm else None, skipped, extra)


def _end(loop: Loop, step: int, stopped: Optional[str]) -> None:
    """A stopped run's line (an error when the launcher died, so that torchrun on every node ends now),
    or a finished run's --export_model_at_end."""
    run, settings = loop.run, loop.run.settings.loop
    if stopped is not None:
        outcome = (
            "the checkpoint is saved, resume by running the same command"
            if settings.checkpoint_interval != 0
            else "no checkpoint (--checkpoint_interval=0)"
        )
        if stopped == LAUNCHER_DIED.name:
            raise TrainingError(f"stopped after step {step}: the launcher (torchrun) of a rank died; {outcome}")
        if settings.stop_exit_status:
            outcome += f" (exit status {settings.stop_exit_status}, --stop_exit_status)"
        run.log(f"stopping after step {step} on {stopped}: {outcome}")
    elif settings.export_model_at_end:  # a preempted run keeps its grace period for the checkpoint
        export_trained_model(loop.model, run.paths.model_file(step), step, run.settings.export, loop.average)
