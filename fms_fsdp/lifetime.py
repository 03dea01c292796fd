"""How this package's processes end: the signals that ask a rank to save and stop, and children that die
with their parent (no torch here: the data tools' worker pools use it too)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1
LAUNCHER_DIED = signal.SIGUSR2  # the parent-death signal of ranks started by torchrun (cli.train)
# what asks a rank to save and stop (triggers.StopRequest); its loader workers leave them to the rank.
# SIGINT is Ctrl-C, from a terminal, torchrun or fms-torchrun (launch.py): a second one stops the rank at once
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, LAUNCHER_DIED, signal.SIGINT)


def exit_with_parent(sig: signal.Signals) -> None:
    """Have Linux send `sig` to this process when its parent dies, so that a SIGKILLed launcher (or
    rank) leaves nothing training on; if the parent is already gone, send it now. A no-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)


def dying_with_parent(argv: list[str], sig: signal.Signals = signal.SIGTERM) -> list[str]:
    """A command line that runs `argv` (another program, such as `ray start --block`) so that it gets `sig`
    when the process that starts it dies, even by SIGKILL (exit_with_parent, then exec). Linux only;
    elsewhere `argv` itself."""
    if not sys.platform.startswith("linux"):
        return argv
    code = (
        "import ctypes, os, sys; sig, parent = int(sys.argv[1]), int(sys.argv[2]); "
        f"ctypes.CDLL(None).prctl({_PR_SET_PDEATHSIG}, sig, 0, 0, 0); "
        "os.getppid() == parent or os.kill(os.getpid(), sig); os.execvp(sys.argv[3], sys.argv[3:])"
    )
    return [sys.executable, "-c", code, str(int(sig)), str(os.getpid()), *argv]


def pool_worker() -> None:
    """Set up a worker of a process pool (fms-prepare-data's, also inside a training rank): it ends on
    its pool's SIGTERM (multiprocessing's terminate) even where the rank handles the stop signals,
    leaves Ctrl-C and the other stop signals to its parent, and dies with its parent."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for sig in STOP_SIGNALS[1:]:
        signal.signal(sig, signal.SIG_IGN)
    exit_with_parent(signal.SIGKILL)
