"""torchrun as the package's launch scripts run it (`fms-torchrun`): torch.distributed.run with its own
command line and behaviour, ending in what the ranks said instead of torchrun's own endings.

- A rank that ends in the package's one-line error: that line again, last, and the rank's status (2: fix
  the input; 1: the work failed), instead of torchrun's traceback and failure summary (status 1).
- Ctrl-C (SIGINT): passed on to the ranks, which save and print their stop line; a second Ctrl-C,
  passed on too, stops them at once (their SIGINT is then the default action). Under srun, Slurm sends
  it to every process of the job step, the ranks too: it is not passed on then (they would get it
  twice). Either way the status is 130 (128 + SIGINT, as a shell reports Ctrl-C), without torchrun's
  SignalException traceback (torchrun itself would stop on the first and, on a second, send SIGTERM: its
  ranks would save again).
- Ctrl-C before the ranks exist (the rendezvous), or a third: the launcher ends at once, status 130.
- --dry_run's plan that does not fit: its status, 3, after its PLAN line.
- A signal torchrun still handles itself (SIGTERM, SIGHUP, SIGQUIT where its --signals_to_handle lists
  them): passed on by torchrun; then status 128 + the signal, without the traceback.
- Anything else (a rank that crashed with a traceback, a rank killed by a signal) keeps torchrun's
  summary, status 1.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any, Sequence

INTERRUPTED = 128 + signal.SIGINT
PLAN_DOES_NOT_FIT = 3  # --dry_run's status when its plan does not fit (cli.py)


class Interrupts:
    """Ctrl-C's reaching the launcher, each passed on to the ranks; with no rank yet (the rendezvous),
    or at a third, it ends the launcher as Ctrl-C ends a program (KeyboardInterrupt)."""

    def __init__(self) -> None:
        self.count = 0
        self.ranks_get_it = "SLURM_STEP_ID" in os.environ  # srun's step: Slurm signals each of its processes
        signal.signal(signal.SIGINT, self._pass_on)

    def _pass_on(self, signum: int, frame: Any) -> None:
        self.count += 1
        if not signal_children(0 if self.ranks_get_it else signal.SIGINT) or self.count > 2:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            raise KeyboardInterrupt


def launch(argv: Sequence[str]) -> int:
    """Run torchrun with `argv` (its flags, the script, the script's flags); the status to exit with."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(list(argv))
    # SIGINT is the launcher's own (Interrupts); torchrun needs at least one signal named
    handled = [s for s in args.signals_to_handle.split(",") if s.strip() != "SIGINT"]
    args.signals_to_handle = ",".join(handled) or "SIGHUP"
    interrupts = Interrupts()
    try:
        run(args)
    except ChildFailedError as e:
        return INTERRUPTED if interrupts.count and _interrupted(e) else _failed(e)
    except SignalException as e:
        return 128 + int(e.sigval)
    except KeyboardInterrupt:
        return INTERRUPTED
    return INTERRUPTED if interrupts.count else 0


def _interrupted(error: Any) -> bool:
    """Whether every failed rank ended because of Ctrl-C (its SIGINT, or its own status for it)."""
    return all(f.exitcode in (-signal.SIGINT, INTERRUPTED) for f in error.failures.values())


def _said(error: Any) -> bool:
    """Whether the first failing rank ended in the package's one-line error (its error file)."""
    _, failure = error.get_first_failure()
    return failure.exitcode > 0 and str(_message(failure)).startswith("error")


def _message(failure: Any) -> str:
    return failure.message.get("message", "") if isinstance(failure.message, dict) else failure.message


def _failed(error: Any) -> int:
    """A failed launch's status; the first failing rank's one line printed last when it has one."""
    _, failure = error.get_first_failure()
    if _said(error):
        print(_message(failure), file=sys.stderr, flush=True)
        return failure.exitcode
    if all(f.exitcode == PLAN_DOES_NOT_FIT for f in error.failures.values()):  # its PLAN line was the last
        return PLAN_DOES_NOT_FIT
    print(error, file=sys.stderr, flush=True)  # torchrun's own summary
    return 1


def signal_children(sig: int) -> int:
    """Send `sig` to this process's children (torchrun's ranks, each in a session of its own; 0: none,
    they are only counted); how many."""
    me, sent = str(os.getpid()), 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = stat.read_text().rsplit(")", 1)[1].split()[1]
            if parent == me:
                os.kill(int(stat.parent.name), sig)
                sent += 1
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return sent
