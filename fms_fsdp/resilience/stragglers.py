"""Stragglers: which rank is slow, measured by each rank apart from its waits for the others.

In a synchronous step every rank takes as long as the slowest, so step times name no one. Each rank
instead measures its own work: the forward compute of its blocks (each bracketed after FSDP has
gathered the block's weights, so the wait for that all-gather is outside) and its wait for data.
At every report the ranks' figures are gathered (one small all-gather) and the record gets the
slowest rank, its host, its own work over the median rank's, and the slowest data wait; a rank over
--straggler_threshold for --straggler_reports reports in a row is named in one warning line.
Megatron-LM's StragglerDetector does the same with CUDA events around a training section. The median
is the lower middle one (of two ranks, the faster). Under tensor or context parallelism a block's
forward holds that group's collectives, so a straggler's group (on its node) measures its slowness
too; under pipeline parallelism the stages hold different blocks, so the ratio compares stages as well.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from fms_fsdp.parallel.pipeline import blocks_of


class CpuClock:
    """A CPU rank's own-work clock: wall time less the time the thread waited for a core.

    Wall time alone would name a random rank on a machine shared with other jobs (a rank that got
    fewer turns on a core), and CPU time alone (time.thread_time) would miss a rank that does not run
    at all for a while: a process stopped (SIGSTOP, a paused VM or container) accumulates neither CPU
    time nor run-queue delay, exactly as a rank blocked in a collective's wait does. So the clock runs
    only inside brackets that hold compute and no wait for another rank, and there it counts wall time
    less the run-queue delay of the thread (Linux's /proc/<pid>/task/<tid>/schedstat, second field):
    compute, and any time the process was stopped, but not the turns other processes took. Elsewhere
    than Linux it is wall time."""

    def __init__(self) -> None:
        self.fd: Optional[int] = None
        self.tid = 0
        self.total = 0.0
        self.started: Optional[float] = None

    def _run_delay(self) -> float:
        tid = threading.get_native_id()
        if self.fd is None or tid != self.tid:
            if self.fd is not None:
                os.close(self.fd)
            try:
                self.fd, self.tid = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY), tid
            except OSError:
                self.fd, self.tid = None, tid
        if self.fd is None:
            return 0.0
        return int(os.pread(self.fd, 128, 0).split()[1]) / 1e9

    def start(self) -> None:
        self.started = time.perf_counter() - self._run_delay()

    def stop(self) -> None:
        if self.started is not None:
            self.total += time.perf_counter() - self._run_delay() - self.started
            self.started = None

    def take(self) -> float:
        """Seconds counted since the last take."""
        total, self.total = self.total, 0.0
        return total

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class CudaClock:
    """A GPU rank's own-work clock: CUDA events on the compute stream around each bracket, so the time
    the stream waits for a collective before the bracket is outside it. Finished pairs are read at
    each step's end without waiting; the rest at the report (which synchronizes anyway)."""

    def __init__(self) -> None:
        self.pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.opened: Optional[torch.cuda.Event] = None
        self.total = 0.0

    def start(self) -> None:
        self.drain()
        self.opened = torch.cuda.Event(enable_timing=True)
        self.opened.record()

    def stop(self) -> None:
        if self.opened is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.pending.append((self.opened, end))
            self.opened = None

    def drain(self, wait: bool = False) -> None:
        while self.pending and (wait or self.pending[0][1].query()):
            start, end = self.pending.pop(0)
            end.synchronize()
            self.total += start.elapsed_time(end) / 1e3

    def take(self) -> float:
        self.drain(wait=True)
        total, self.total = self.total, 0.0
        return total

    def close(self) -> None:
        self.pending.clear()


class Stragglers:
    """Measures this rank's own work per report interval and, at each report, names the slowest rank
    (every rank calls `report`; rank 0 warns); nothing with one rank. `hosts`: every rank's host name."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        hosts: list[str],
        threshold: float,
        reports: int,
        log: Callable[[str], None],
    ):
        self.clock: Any = CudaClock() if device.type == "cuda" else CpuClock()
        self.device, self.hosts, self.threshold, self.reports, self.log = device, hosts, threshold, reports, log
        self.over = [0] * len(hosts)  # reports in a row each rank was over the threshold
        self.handles: list[Any] = []
        # registered after fully_shard's hooks: a block's all-gather wait comes before its bracket opens
        for block in blocks_of(model) if len(hosts) > 1 else []:
            self.handles.append(block.register_forward_pre_hook(self._start))
            self.handles.append(block.register_forward_hook(self._stop))

    @torch.compiler.disable
    def _start(self, module: torch.nn.Module, args: Any) -> None:
        self.clock.start()

    @torch.compiler.disable
    def _stop(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.clock.stop()

    def report(self, data_wait_s: float, interval_s: float) -> dict[str, Any]:
        """The interval's straggler figures (every rank calls it: one all-gather): `data_wait_s`, this
        rank's seconds waiting for data in the interval of `interval_s` seconds. Nothing with one rank."""
        if len(self.hosts) == 1:
            return {}
        mine = torch.tensor([self.clock.take() + data_wait_s, data_wait_s / max(interval_s, 1e-9)], device=self.device)
        every = [torch.empty_like(mine) for _ in self.hosts]
        dist.all_gather(every, mine)
        work, waits = torch.stack(every).t().tolist()
        median = statistics.median_low(work)
        slowest = max(range(len(work)), key=work.__getitem__)
        ratio = work[slowest] / median if median > 0 else 1.0
        waiting = max(range(len(waits)), key=waits.__getitem__)
        self._warn(work, median)
        return {
            "slowest_rank": slowest,
            "slowest_rank_host": self.hosts[slowest],
            "slowest_rank_ratio": ratio,
            "slowest_data_wait": waits[waiting],
            "slowest_data_wait_rank": waiting,
        }

    def _warn(self, work: list[float], median: float) -> None:
        """Count each rank's reports in a row over the threshold; rank 0 names one that reaches
        --straggler_reports (once per run of reports)."""
        for rank, seconds in enumerate(work):
            ratio = seconds / median if median > 0 else 1.0
            self.over[rank] = self.over[rank] + 1 if ratio > self.threshold else 0
            if self.over[rank] == self.reports:
                self.log(
                    f"warning: rank {rank} (host {self.hosts[rank]}) is a straggler: its own work (compute and "
                    f"data wait) was {ratio:.2f}x the median rank's for {self.reports} reports in a row "
                    f"(--straggler_threshold={self.threshold:g}); every rank waits for it: check that host "
                    "(other processes, clocks, temperatures, its storage)"
                )

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.clock.close()
