"""The stateful data loader of one rank: torch DataLoader workers, each a LineReader, with the state of
every delivered batch tracked for exact resume and regrouped for rescaling.

As in torchdata's StatefulDataLoader, each worker sends its state with every batch, so the saved
state is that of the batches the trainer has taken, not of those prefetched. The DataLoader hands
out batches from workers 0, 1, ..., W-1 in turn; on resume, worker roles are rotated so that the
worker whose batch was due next delivers first, and the batch sequence continues exactly. Each rank
counts the batches it took: a worker knows the optimizer step of every batch it makes (batch index //
grad_accum_steps), so with --weights_schedule it sets that step's weights before its lines, and with
--batch_size_schedule or --seq_length_schedule (ramp.py) it makes the step's number and length of lines.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import signal
import sys
import threading
from collections import Counter
from functools import partial
from typing import Any, Callable, Iterator, Optional, TypeVar, Union

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from fms_fsdp.data.mixture import MixtureSchedule
from fms_fsdp.data.shards import Dataset
from fms_fsdp.data.stream import POSITION, LineReader, Packing, n_logical_shards, shard_table
from fms_fsdp.data.worker_deaths import WorkerDied, next_batch, shut_down, watch
from fms_fsdp.errors import DataError
from fms_fsdp.lifetime import STOP_SIGNALS, exit_with_parent
from fms_fsdp.ramp import Ramp

STATE_VERSION = 1
RESTARTS = 3  # deaths of the workers in a row, with no batch between them, started again
Batch = tuple[torch.Tensor, torch.Tensor]
T = TypeVar("T")


def _compact(reader_state: dict[str, Any]) -> dict[str, Any]:
    """A reader state with its per-shard positions as int32 arrays."""
    datasets = {
        name: {**d, **{k: np.asarray(d[k], np.int32) for k in POSITION}} for name, d in reader_state["datasets"].items()
    }
    return {**reader_state, "datasets": datasets}


def _init_worker(worker_id: int, rank_pid: int) -> None:
    """Workers leave the stop signals to their rank, which checkpoints and then ends them: a stop signal
    sent to every process of a job (Slurm signals a whole job step) is ignored, but a SIGTERM from the
    rank itself (multiprocessing's terminate, which ends daemonic children when the rank's interpreter
    exits, or DataLoader's shutdown) ends the worker. Workers also die with their parent process (the
    rank, or a forkserver that dies with it), whatever killed it. A worker that crashes in native code
    prints its Python stack (faulthandler) before DataLoader's own line."""
    faulthandler.enable(file=2, all_threads=True)  # the process's stderr, whatever sys.stderr is now
    for sig in STOP_SIGNALS:
        if sig != signal.SIGTERM:
            signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # taken by the thread below, and only there
    threading.Thread(target=_end_on_rank_sigterm, args=(rank_pid,), daemon=True, name="sigterm").start()
    exit_with_parent(signal.SIGKILL)


def _end_on_rank_sigterm(rank_pid: int) -> None:
    """Wait for SIGTERMs (blocked in every thread of the worker): one sent by the rank ends the worker
    at once; any other sender's is left to the rank."""
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == rank_pid:
            os._exit(0)


def _check_cache_build(saved: Optional[str], now: Optional[str]) -> None:
    """A DataError when a checkpoint read its --cache_dir in another order than this run: built first
    (before --cache_build existed, or with --cache_build=first) or read while built."""
    if saved == now:
        return
    if now == "beside":
        raise DataError(
            "this checkpoint did not read its raw text while --cache_dir was built (it read the cache once built, "
            "or ran without --cache_dir): resume as it was made, with --cache_build=first or without --cache_dir"
        )
    raise DataError(
        "this checkpoint read its raw text while --cache_dir was built: resume with --cache_build=beside "
        "(or external) and the same --cache_dir to keep its batch order"
    )


def _as_is(item: Any) -> Any:
    """DataLoader's collate_fn: keep worker states as numpy (default_convert would make tensors)."""
    return item


class _Workers(IterableDataset):
    """What each DataLoader worker runs: one LineReader, yielding (lines, reader state) batches."""

    def __init__(self, loader: "StatefulLoader"):
        self.datasets, self.weights, self.packing = loader.datasets, loader.weights, loader.packing
        self.batch_size, self.logical_shards, self.seed = loader.batch_size, loader.logical_shards, loader.seed
        self.rank, self.workers = loader.rank, loader.workers
        self.consumers = loader.world_size * self.workers
        self.states, self.rotation = list(loader.states), loader.next_worker
        self.schedule, self.accum, self.first = loader.schedule, loader.grad_accum, loader.batches
        self.ramp = loader.ramp

    def __iter__(self) -> Iterator[tuple[Optional[np.ndarray], dict]]:
        info = get_worker_info()
        logical = ((info.id if info else 0) + self.rotation) % self.workers
        try:
            reader = LineReader(
                self.datasets,
                self.weights,
                self.logical_shards,
                self.rank * self.workers + logical,
                self.consumers,
                self.seed,
                self.packing,
                self.states[logical],
            )
            # this worker makes the rank's batches first, first + W, ...: DataLoader takes them in turn
            batch = self.first + (info.id if info else 0)
            building = [d for d in self.datasets if d.building is not None]
            while True:
                if self.schedule is not None:
                    reader.set_weights(self.schedule.weights_at(batch // self.accum))
                size, length = (self.batch_size, self.packing.seq_length)
                if self.ramp is not None:  # this batch's step's shape: documents run on across a change
                    size, length = self.ramp.shape(batch // self.accum)
                batch += self.workers
                lines: np.ndarray = np.empty((size, length + 1), dtype=np.int64)
                for line in lines:
                    reader.next_line(line)
                state = reader.state()
                if building:  # documents read from the caches being built, and tokenized here, so far
                    state["read_from"] = {d.name: dict(d.read_from) for d in building}
                yield lines, state  # numpy crosses the worker pipe faster than a shared tensor
        except DataError as e:  # crosses the worker boundary as one line, not a wrapped traceback
            yield None, {"error": str(e)}


class StatefulLoader:
    """Iterable of (inputs, labels) [batch_size, seq_length] int64 batches for one rank, with
    state_dict() / load_state_dict()."""

    def __init__(
        self,
        *,
        datasets: list[Dataset],
        weights: list[float],
        packing: Packing,
        batch_size: int,
        logical_shards: int,
        seed: int,
        rank: int,
        world_size: int,
        num_workers: int,
        schedule: Optional[MixtureSchedule] = None,
        grad_accum: int = 1,
        ramp: Optional[Ramp] = None,
        builder: Optional[Any] = None,
    ):
        self.datasets, self.weights, self.packing = datasets, weights, packing
        self.builder = builder  # rank 0's build of the caches read while built (data/prepare/beside.py)
        self._keep_building = False
        self.read_from: dict[int, dict[str, dict[str, int]]] = {}  # reader -> documents by dataset and source
        self._read_before: dict[str, int] = {}
        self.schedule, self.grad_accum, self.ramp = schedule, grad_accum, ramp
        self.batches = 0  # taken by this rank: every rank takes grad_accum per step
        self.batch_size, self.logical_shards, self.seed = batch_size, logical_shards, seed
        self.rank, self.world_size, self.num_workers = rank, world_size, num_workers
        self.workers = max(1, num_workers)  # readers per rank; 0 workers = one reader in this process
        readers = world_size * self.workers
        for ds in datasets:
            if n_logical_shards(logical_shards, ds.documents) < readers:
                raise DataError(
                    f"{ds.root / ds.name}: {ds.documents} documents and --logical_shards={logical_shards} "
                    f"give fewer logical shards than the {readers} readers (data-parallel ranks x num_workers); "
                    "add data or use fewer workers",
                    every_rank=True,
                )
        self.states: list[Optional[dict[str, Any]]] = [None] * self.workers
        self.next_worker = 0

    def __iter__(self) -> Iterator[Batch]:
        """The rank's batches. Workers that die (killed for memory, a crash in native code) are started
        again from the last batch taken, which keeps every document once; RESTARTS deaths in a row with
        no batch between them end the run."""
        deaths = 0
        while True:
            it = None
            try:
                it = self._start_workers()
                while True:
                    lines, state = next_batch(it)
                    deaths = 0
                    yield self._take(lines, state)
            except WorkerDied as e:
                deaths += 1
                self._worker_died(e, deaths)
            finally:
                # the workers stop with this generator (closed, dropped, or ended by an error), not when a
                # traceback that holds its frame is freed; a generator still held at interpreter exit has its
                # workers ended by multiprocessing's SIGTERM, which they take from their rank (_init_worker)
                shut_down(it)

    def _start_workers(self) -> Iterator[tuple[Optional[np.ndarray], dict]]:
        """The readers' (lines, state) stream from the batches taken so far: in this process with
        num_workers=0, else from DataLoader workers whose deaths are found as the rank waits (worker_deaths)."""
        source = _Workers(self)
        if self.num_workers == 0:
            return iter(source)
        loader = DataLoader(
            source,
            batch_size=None,
            num_workers=self.num_workers,
            prefetch_factor=2,
            collate_fn=_as_is,
            worker_init_fn=partial(_init_worker, rank_pid=os.getpid()),  # not always the parent (forkserver)
        )
        it = fork_safely(lambda: iter(loader))
        watch(it)
        return it

    def _worker_died(self, error: WorkerDied, deaths: int) -> None:
        """Say that a worker died and its readers start again (their counts of documents read from a cache
        being built go on from here); a DataError after RESTARTS deaths in a row."""
        if deaths > RESTARTS:
            raise DataError(
                f"the data loader's workers died {deaths} times in a row ({error.how}; out of memory? see "
                "`dmesg`): resume from the last checkpoint, with fewer --num_workers"
            ) from error
        print(
            f"warning: rank {self.rank}: {error}; started again from the last batch taken", file=sys.stderr, flush=True
        )
        counted = self._read_totals()
        self._read_before = {k: self._read_before.get(k, 0) - counted[k] for k in {*counted, *self._read_before}}
        self.read_from.clear()

    def _take(self, lines: Optional[np.ndarray], state: dict[str, Any]) -> Batch:
        """A worker's batch, its reader's state kept as the rank's position."""
        if "error" in state:
            raise DataError(state["error"])
        assert lines is not None
        logical = state["consumer"] - self.rank * self.workers
        if "read_from" in state:
            self.read_from[logical] = state.pop("read_from")
        self.states[logical] = state
        self.next_worker = (logical + 1) % self.workers
        self.batches += 1
        batch = torch.from_numpy(lines)
        return batch[:, :-1], batch[:, 1:]

    def _fingerprint(self) -> dict[str, Any]:
        found = {
            "seed": self.seed,
            "logical_shards": self.logical_shards,
            "documents": {d.name: d.documents for d in self.datasets},
        }
        if any(d.building is not None for d in self.datasets):  # raw text's order, from its cache
            found["cache_build"] = "beside"
        return found

    def data_report(self) -> dict[str, float]:
        """The interval's figures of the caches read while built: this rank's documents read from the cache
        and tokenized as read, and (rank 0) the share of the text the build has done."""
        if not any(d.building is not None for d in self.datasets):
            return {}
        totals = self._read_totals()
        new = {k: totals[k] - self._read_before.get(k, 0) for k in ("cache", "tokenized")}
        self._read_before = dict(totals)
        report: dict[str, float] = {"documents_from_cache": new["cache"], "documents_tokenized": new["tokenized"]}
        if self.builder is not None:
            report["cache_built"] = self.builder.progress()
        return report

    def _read_totals(self) -> Counter[str]:
        """Documents this rank's readers read from the caches and tokenized, since they started."""
        totals: Counter[str] = Counter()
        for by_dataset in self.read_from.values():
            for counts in by_dataset.values():
                totals.update(counts)
        return totals

    def keep_building(self) -> None:
        """A run that ends normally: `close` leaves rank 0's build of the caches running, for `finish`."""
        self._keep_building = True

    def finish(self) -> None:
        """Wait for rank 0's build of the caches."""
        if self.builder is not None:
            self.builder.finish()

    def close(self) -> None:
        """Stop rank 0's build of the caches (kept as far as it got), unless the run ended normally."""
        if self.builder is not None and not self._keep_building:
            self.builder.close()

    def state_dict(self) -> dict[str, Any]:
        """This rank's position: small (int32 arrays), picklable, no tokens."""
        return {
            "version": STATE_VERSION,
            "rank": self.rank,
            "world_size": self.world_size,
            "num_workers": self.num_workers,
            "next_worker": self.next_worker,
            "batches": self.batches,
            "grad_accum": self.grad_accum,
            "readers": [None if r is None else _compact(r) for r in self.states],
            **self._fingerprint(),
        }

    def load_state_dict(self, state: Union[dict[str, Any], list[dict[str, Any]]]) -> None:
        """Resume from this rank's own state, or from the list of every rank's states of a run with
        any world size and num_workers (regrouped by logical shard)."""
        states = state if isinstance(state, list) else [state]
        for s in states:
            if s.get("version") != STATE_VERSION:
                raise DataError(f"data loader state version {s.get('version')} is not {STATE_VERSION}")
            _check_cache_build(s.get("cache_build"), self._fingerprint().get("cache_build"))
            for key, value in self._fingerprint().items():
                if s[key] != value:
                    raise DataError(f"the data changed since this state was saved: {key} was {s[key]}, is {value}")
        own = states[self.rank] if isinstance(state, list) and len(states) == self.world_size else states[0]
        # optimizer steps x grad_accum_steps, the same on every rank; in this run's micro-batches
        self.batches = int(own.get("batches", 0)) // int(own.get("grad_accum", 1)) * self.grad_accum
        if (own["rank"], own["world_size"], own["num_workers"]) == (self.rank, self.world_size, self.num_workers):
            self.states, self.next_worker = list(own["readers"]), own["next_worker"]
        elif not isinstance(state, list):
            raise DataError("a single rank's loader state cannot be rescaled: pass the list of every rank's states")
        else:
            self.states, self.next_worker = self._regroup(states), 0

    def _regroup(self, states: list[dict[str, Any]]) -> list[Optional[dict[str, Any]]]:
        """Reader states for this rank's readers from every old reader's shards."""
        old = [r for s in states for r in s["readers"]]
        consumers = self.world_size * self.workers
        ranks = {s["rank"] for s in states}
        if len(ranks) != states[0]["world_size"] or len(old) != states[0]["world_size"] * max(
            1, states[0]["num_workers"]
        ):
            raise DataError(f"loader state of {len(ranks)} ranks given; the run had {states[0]['world_size']}")
        result: list[Optional[dict[str, Any]]] = []
        for logical in range(self.workers):
            consumer = self.rank * self.workers + logical
            datasets = {}
            for ds in self.datasets:
                n = n_logical_shards(self.logical_shards, ds.documents)
                table = {}
                for r in old:
                    if r is not None:
                        table.update(shard_table(r["datasets"][ds.name], r["consumer"], r["consumers"], n))
                rows = [table.get(s, (0,) * len(POSITION)) for s in range(consumer, n, consumers)]
                datasets[ds.name] = {key: np.array([x[k] for x in rows], np.int32) for k, key in enumerate(POSITION)}
                datasets[ds.name]["next"] = 0
            result.append({"consumer": consumer, "consumers": consumers, "lines": 0, "datasets": datasets})
        if self.rank == 0:  # the job's lines per dataset so far, kept on its first reader
            used = [r.get("used", [0] * len(self.datasets)) for r in old if r is not None]
            first = result[0]
            assert first is not None
            first["used"] = [int(sum(u[k] for u in used)) for k in range(len(self.datasets))]
        return result

    def lines_by_dataset(self) -> dict[str, int]:
        """Lines this rank took from each dataset since the run began (a rescaled run counts the job's
        earlier lines on rank 0)."""
        totals = [0] * len(self.datasets)
        for state in self.states:
            if state is not None:
                for k, n in enumerate(state.get("used", ())):
                    totals[k] += int(n)
        return {d.name: n for d, n in zip(self.datasets, totals)}


def fork_safely(start: Callable[[], T]) -> T:
    """`start()`, which forks the workers, with the rank's garbage freed first, here, where the threads its
    objects wait on still run, and what the workers inherit frozen, so that their collections never free it:
    a process group left in a reference cycle and freed in a forked worker waits forever on the rank's
    threads (torch's gloo group does). A caller's own `gc.freeze()` stays in force: what was frozen here is
    then left frozen with it, as Python cannot thaw part of the frozen objects."""
    frozen_before = gc.get_freeze_count()
    gc.collect()
    gc.freeze()
    try:
        return start()
    finally:
        if not frozen_before:
            gc.unfreeze()
