"""Training metrics: throughput, MFU, memory, data wait; printed by rank 0, appended as JSON lines to
<ckpt_save_path>/metrics.jsonl, sent to the --tracker trackers, and shown on a tqdm bar when rank 0
runs in a terminal."""

from __future__ import annotations

import json
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from tqdm import tqdm

from fms_fsdp.errors import ConfigError, first_line
from fms_fsdp.metrics.trackers import Trackers
from fms_fsdp.parallel.process_group import DistInfo
from fms_fsdp.periodic import Report
from fms_fsdp.ramp import Ramp
from fms_fsdp.storage import is_remote, storage_error

# Dense bf16 peak TFLOP/s by device name; the first entry whose key is in the name wins.
PEAK_BF16_TFLOPS: list[tuple[str, float]] = [
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("MI300X", 1307.0),
]


def peak_flops(device: torch.device, override_tflops: Optional[float]) -> Optional[float]:
    """Peak bf16 FLOP/s of one device: --peak_tflops if given, else by GPU name; None when unknown."""
    if override_tflops is not None:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((t * 1e12 for key, t in PEAK_BF16_TFLOPS if key in name), None)


@dataclass(frozen=True, kw_only=True)
class MetricsSettings:
    """The flags the reports read (built once: settings.py)."""

    batch_size: int
    seq_length: int
    grad_accum_steps: int
    peak_tflops: Optional[float]  # --peak_tflops, None for the device's table entry
    num_steps: int
    ramp: Optional[Ramp] = None  # --batch_size_schedule, --seq_length_schedule: each step's shape


class MetricsReporter:
    """Accumulates per-step figures on the device and reports them every report_interval steps."""

    def __init__(
        self,
        settings: MetricsSettings,
        info: DistInfo,
        path: Path,
        flops_per_token: float,
        start_step: int = 0,
        tokens_seen: int = 0,
        trackers: Optional[Trackers] = None,
        dataset_lines: Optional[Callable[[], dict[str, int]]] = None,
    ):
        """`path`: metrics.jsonl (run.paths.metrics)."""
        self.dataset_lines, self.seq_length = dataset_lines, settings.seq_length  # tokens per dataset, reported
        self.info = info
        self.trackers = trackers or Trackers({})
        self.device = info.device
        # per GPU: a tensor- (context-, pipeline-) parallel group of T x C x P GPUs trains on one rank's batch
        self.tokens_per_step = settings.batch_size * settings.seq_length * settings.grad_accum_steps / info.same_data
        self.ramp, self.per_line = settings.ramp, settings.grad_accum_steps / info.same_data  # each step's tokens
        self.next_step = start_step  # the 0-based step step_done counts next
        self.flops_per_token = flops_per_token
        self.peak = peak_flops(info.device, settings.peak_tflops)
        self.log = MetricsLog(path, info.is_main)
        self.start_step = start_step
        self.tokens_seen = tokens_seen  # all ranks, carried over a resume
        self.run_start, self.run_tokens = time.perf_counter(), 0.0  # per rank since the start (or a catch-up)
        self._reset(time.perf_counter())
        self.bar = None
        if info.is_main and sys.stderr.isatty():
            self.bar = tqdm(total=settings.num_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def _reset(self, now: float) -> None:
        self.interval_start = now
        # every step's loss, and the kept steps' (--skip_bad_steps: a skipped step is not averaged in)
        self.loss_sum = torch.zeros((), device=self.device)
        self.kept_loss_sum = torch.zeros((), device=self.device)
        self.kept_steps = torch.zeros((), device=self.device)
        self.z_loss_sum: Optional[torch.Tensor] = None
        self.steps = 0
        self.tokens = 0.0  # per rank, over the interval
        self.data_wait = 0.0
        self.interval_sums: dict[str, float] = {}  # figures summed over the interval (checkpoint_stall_s, export_s)
        self.paused = 0.0  # seconds of the interval spent saving, exporting, evaluating: not steps
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def step_done(
        self,
        loss: torch.Tensor,
        data_wait_s: float,
        kept: Optional[torch.Tensor] = None,
        z_loss: Optional[torch.Tensor] = None,
        replicas: int = 1,
    ) -> None:
        """Record one optimizer step's loss (a detached scalar; no device sync), its z-loss term if any,
        and data wait; a step `kept` false (skipped by --skip_bad_steps) is left out of the reported loss.
        `replicas`: the replica groups that trained the step (--fault_tolerance), counted in tokens_seen."""
        self.loss_sum += loss
        if z_loss is not None:
            self.z_loss_sum = z_loss if self.z_loss_sum is None else self.z_loss_sum + z_loss
        self.kept_loss_sum += loss if kept is None else torch.where(kept, loss, 0.0)
        self.kept_steps += 1 if kept is None else kept
        self.steps += 1
        tokens = self.tokens_per_step if self.ramp is None else self.ramp.tokens(self.next_step) * self.per_line
        self.next_step += 1
        self.tokens += tokens
        self.run_tokens += tokens
        self.tokens_seen += round(tokens * self.info.world_size * replicas)
        self.data_wait += data_wait_s
        if self.bar is not None:
            self.bar.update(1)

    def caught_up(self, step: int, tokens_seen: int) -> None:
        """The run went on from `step` with a healthy replica group's state (--fault_tolerance): its
        tokens, and the overall rate counted from here."""
        self.start_step, self.tokens_seen, self.run_start = step, tokens_seen, time.perf_counter()
        self.next_step, self.run_tokens = step, 0.0
        self._reset(self.run_start)

    def checkpoint_saved(self, stall_s: float) -> None:
        """Record the seconds training waited for a checkpoint save (reported with the interval); the
        log so far is uploaded (object storage), so it keeps what the checkpoint covers."""
        self.record(Report(stall_s, interval={"checkpoint_stall_s": stall_s}))
        self.log.flush()

    def record(self, report: Report) -> None:
        """What periodic work or a checkpoint's commit reports (periodic.Report): its seconds are not
        counted in step_time, its interval figures join the next interval record, and rank 0 prints its
        record and appends it to metrics.jsonl and the trackers."""
        self.paused += report.seconds
        for key, value in report.interval.items():
            self.interval_sums[key] = self.interval_sums.get(key, 0.0) + value
        if report.record is not None and self.info.is_main:
            self._write(report.record, report.line)

    def report(
        self,
        step: int,
        lr: float,
        grad_norm: Optional[torch.Tensor],
        skipped_steps: Optional[int] = None,
        extra: Optional[dict[str, Any]] = None,
    ) -> dict[str, Any]:
        """Reduce the interval's figures over ranks; rank 0 prints them and appends them to
        metrics.jsonl. `grad_norm`: the global norm of this step, if known; `skipped_steps`: steps of
        the interval left out by --skip_bad_steps; `extra`: figures of the interval to add (those of
        --fault_tolerance). Every rank must call it (it all-reduces)."""
        z_sum = self.z_loss_sum if self.z_loss_sum is not None else torch.zeros((), device=self.device)
        sums = torch.stack([self.loss_sum, self.kept_loss_sum, z_sum])
        dist.all_reduce(sums)  # gloo has no AVG; every rank kept the same steps
        kept = int(self.kept_steps)
        loss_value = float(sums[1]) / kept if kept else float(sums[0]) / max(1, self.steps)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        step_time = (now - self.interval_start - self.paused) / max(1, self.steps)
        tps = self.tokens / max(1, self.steps) / step_time
        overall_tps = self.run_tokens / (now - self.run_start)
        record: dict[str, Any] = {
            "step": step,
            "loss": loss_value / self.info.world_size,
            "lr": lr,
            "tokens_seen": self.tokens_seen,
            "step_time": step_time,
            "tokens_per_sec_per_gpu": tps,
            "overall_tokens_per_sec_per_gpu": overall_tps,
            "tokens_per_day": overall_tps * self.info.world_size * 86400,
            "data_wait": self.data_wait / (now - self.interval_start),
        }
        if self.ramp is not None:  # the shape of the interval's last step
            record["batch_size"], record["seq_length"] = self.ramp.shape(self.next_step - 1)
        if self.z_loss_sum is not None:
            record["z_loss"] = float(sums[2]) / max(1, self.steps) / self.info.world_size
        record.update(self._dataset_tokens())
        if grad_norm is not None:
            record["grad_norm"] = float(grad_norm)
        if skipped_steps is not None:
            record["skipped_steps"] = skipped_steps
        record.update(self.interval_sums)
        if self.peak is not None:
            record["mfu"] = tps * self.flops_per_token / self.peak
        record.update(self._memory())
        record.update(extra or {})
        if self.info.is_main:
            self._emit(record)
            if "checkpoint_stall_s" in self.interval_sums:  # the record of the checkpoint's step too
                self.log.flush()
        self._reset(time.perf_counter())
        return record

    def _dataset_tokens(self) -> dict[str, int]:
        """tokens/<dataset> of every rank so far (all-reduced: every rank calls it), none without datasets or
        under --seq_length_schedule (the loader counts lines, of lengths that changed)."""
        if self.dataset_lines is None or (self.ramp is not None and self.ramp.seq.changes):
            return {}
        lines = self.dataset_lines()
        counts = torch.tensor(list(lines.values()), dtype=torch.int64, device=self.device)
        if not self.info.first_stage:  # counted on the first pipeline stage, which always reads
            counts.zero_()
        dist.all_reduce(counts)  # a tensor- (context-) parallel group reads the same lines: counted once
        parts = self.info.tp * self.info.cp
        return {f"tokens/{name}": n * self.seq_length // parts for name, n in zip(lines, counts.tolist())}

    def _memory(self) -> dict[str, float]:
        """This rank's peak memory: the CUDA allocator's since the last report, else the process's RSS."""
        if self.device.type == "cuda":
            return {
                "peak_memory_allocated_gb": torch.cuda.max_memory_allocated(self.device) / 2**30,
                "peak_memory_reserved_gb": torch.cuda.max_memory_reserved(self.device) / 2**30,
            }
        return {"max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}

    def _emit(self, record: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.4f}")
        self._write(record, format_record(record))

    def _write(self, record: dict[str, Any], line: str) -> None:
        """Append `record` to metrics.jsonl, send it to the trackers, print `line` (above the bar)."""
        self.log.append(json.dumps(record) + "\n")
        self.trackers.log(record)
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        self.log.flush()
        if self.bar is not None:
            self.bar.close()


class MetricsLog:
    """metrics.jsonl, appended to. Object storage cannot append: there rank 0 keeps the file's lines
    (read back on a resume) and uploads them whole after a checkpoint save and the report that follows
    it, with the first record UPLOAD_EVERY_S seconds or more after the last upload, and at the end: a
    crash loses at most the records after the last checkpoint, which the resumed run writes again."""

    UPLOAD_EVERY_S = 60.0

    def __init__(self, path: Path, is_main: bool):
        self.path, self.remote = path, is_remote(path)
        # lines, joined only to upload (appending to one growing string would copy it at every record)
        self.lines: list[str] = []
        if self.remote and is_main and path.exists():
            self.lines = path.read_text().splitlines(keepends=True)
        self.uploaded = time.monotonic()
        self.dirty = self.warned = False

    def append(self, line: str) -> None:
        if not self.remote:
            try:
                with open(self.path, "a") as f:
                    f.write(line)
            except OSError as e:  # a disk gone full or read-only: the records stay in the log
                self._warn(
                    f"cannot append to {self.path} ({type(e).__name__}: {first_line(e)}); records go on to the log only"
                )
            return
        self.lines.append(line)
        self.dirty = True
        if time.monotonic() - self.uploaded >= self.UPLOAD_EVERY_S:
            self.flush()

    def flush(self) -> None:
        """Upload what is not uploaded yet (object storage). A failed upload warns (once) and is
        tried again later: training goes on."""
        if not self.dirty:
            return
        try:
            self.path.write_text("".join(self.lines))
        except Exception as e:
            if not storage_error(e):
                raise
            self._warn(f"cannot upload {self.path} ({type(e).__name__}: {first_line(e)}); trying again later")
            self.uploaded = time.monotonic()
            return
        self.uploaded, self.dirty = time.monotonic(), False

    def _warn(self, message: str) -> None:
        """Warn of a failed write once: training goes on."""
        if not self.warned:
            print(f"warning: {message}", flush=True)
            self.warned = True


def check_metrics_file(path: Path) -> None:
    """ConfigError when <ckpt_save_path>/metrics.jsonl cannot be appended to (a start-up check)."""
    if is_remote(path):
        return
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
        if not existed:  # a start that fails leaves no empty file behind
            path.unlink()
    except OSError as e:
        raise ConfigError(f"--ckpt_save_path: cannot append to {path} ({type(e).__name__}: {first_line(e)})") from None


def format_record(r: dict[str, Any]) -> str:
    """One human-readable line of a metrics record."""
    parts = [
        f"step {r['step']}",
        f"loss {r['loss']:.4f}",
        f"lr {r['lr']:.3e}",
        *([f"z_loss {r['z_loss']:.4f}"] if "z_loss" in r else []),
        *([f"grad_norm {r['grad_norm']:.3f}"] if "grad_norm" in r else []),
        *([f"moe_balance {r['moe_balance_loss']:.3f} load_max {r['moe_load_max']:.2f}"] if "moe_load_max" in r else []),
        *([f"dropped {100 * r['moe_dropped']:.1f}%"] if "moe_dropped" in r else []),
        *([f"batch {r['batch_size']} x {r['seq_length']}"] if "batch_size" in r else []),
        f"tokens {r['tokens_seen']:,}",
        f"step_time {r['step_time']:.3f}s",
        f"tok/s/rank {r['tokens_per_sec_per_gpu']:,.0f} (overall {r['overall_tokens_per_sec_per_gpu']:,.0f})",
        f"tok/day {r['tokens_per_day']:.3e}",
    ]
    if "mfu" in r:
        parts.append(f"mfu {r['mfu']:.3f}")
    if "peak_memory_allocated_gb" in r:
        parts.append(f"mem {r['peak_memory_allocated_gb']:.1f}/{r['peak_memory_reserved_gb']:.1f} GiB")
    else:
        parts.append(f"rss {r['max_rss_gb']:.2f} GiB")
    parts.append(f"data_wait {100 * r['data_wait']:.1f}%")
    if "documents_from_cache" in r:  # a --cache_dir read while it is built
        built = f", {100 * r['cache_built']:.0f}% built" if "cache_built" in r else ""
        parts.append(
            f"documents {r['documents_from_cache']} from the cache, {r['documents_tokenized']} tokenized{built}"
        )
    if "slowest_rank" in r:
        parts.append(f"slowest rank {r['slowest_rank']} ({r['slowest_rank_ratio']:.2f}x)")
    if r.get("skipped_steps"):
        parts.append(f"skipped {r['skipped_steps']}")
    if "checkpoint_stall_s" in r:
        parts.append(f"ckpt_stall {r['checkpoint_stall_s']:.2f}s")
    if "export_s" in r:
        parts.append(f"export {r['export_s']:.2f}s")
    if "ft_groups" in r:
        changes = [f"{r[k]} {k[3:]}" for k in ("ft_dropped", "ft_joined") if r[k]]
        changes += [f"retried {r['ft_retries']}: {r['ft_retry_s']:.2f}s"] * bool(r["ft_retries"])
        parts.append(f"groups {r['ft_groups']}" + (f" ({', '.join(changes)})" if changes else ""))
    return " | ".join(parts)
