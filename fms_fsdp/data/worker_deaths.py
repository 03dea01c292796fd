"""Where a rank finds that one of its DataLoader workers died: while it waits for a batch (the SIGCHLD of
the death ends the wait) or as it starts to wait, never in the middle of a training step, where torch's
own SIGCHLD handler would raise."""

from __future__ import annotations

import signal
import threading
from typing import Any, Callable, Iterator

from fms_fsdp.compat import loader_workers_died, unwatch_loader_workers

_waiting: list[Any] = []  # the DataLoader iterator the main thread waits on, while it waits
_installed = False  # this module's SIGCHLD handler


class WorkerDied(RuntimeError):
    """A DataLoader worker of this rank died: the exit codes found (negative: the killing signal)."""

    def __init__(self, codes: list[int]):
        how = ", ".join(f"signal {-c}" if c < 0 else f"exit status {c}" for c in codes) or "as it started"
        super().__init__(f"a data loader worker died ({how})")
        self.how = how


def watch(it: Iterator[Any]) -> None:
    """Find `it`'s worker deaths in `next_batch` (torch's handler leaves them), with a SIGCHLD handler of
    this module in the main thread, installed once, before whatever handler was there."""
    global _installed
    try:
        unwatch_loader_workers(it)
    except RuntimeError as e:  # torch's handler: a worker died as they started
        raise WorkerDied(loader_workers_died(it)) from e
    if not _installed and threading.current_thread() is threading.main_thread():
        previous = signal.getsignal(signal.SIGCHLD)
        signal.signal(signal.SIGCHLD, lambda signum, frame: _on_child_exit(previous, signum, frame))
        _installed = True


def _on_child_exit(previous: Any, signum: int, frame: Any) -> None:
    """SIGCHLD: WorkerDied while the rank waits on workers of which one died; then the handler before."""
    codes = loader_workers_died(_waiting[-1]) if _waiting else []
    if codes:
        raise WorkerDied(codes)
    if callable(previous):
        previous(signum, frame)


def next_batch(it: Iterator[Any]) -> Any:
    """`it`'s next item; WorkerDied when one of its workers died before the wait or during it."""
    _waiting.append(it)
    try:
        codes = loader_workers_died(it)
        if codes:  # a worker killed mid-send leaves a part of a batch in the pipe: never read after it
            raise WorkerDied(codes)
        return next(it)
    except WorkerDied:
        raise
    except RuntimeError as e:  # torch's own check of the workers, every 5 s of waiting
        codes = loader_workers_died(it)
        if not codes:
            raise
        raise WorkerDied(codes) from e
    finally:
        _waiting.pop()


def shut_down(it: Any) -> None:
    """Stop a DataLoader iterator's workers now (not when a traceback holding it is freed)."""
    shutdown: Callable[[], None] = getattr(it, "_shutdown_workers", lambda: None)
    shutdown()
