"""Run a command of the package held at a known point, so that what a test does to it (a kill, a signal,
a disk turned read-only, a network cut) lands there every time instead of racing the run:

    python tests/held_at.py <folder> <point> <script> [its arguments]

(under torchrun too, in place of the script), or install(folder, point) in a process that then runs a
command's function itself. <point>, optionally limited to one rank (`step:5@1`):

  step:N    before training step N: steps up to N-1 are done, their checkpoints committed, their records
            written
  save:N    inside step N's save: its temporary folder (.step_N_ckp.tmp) made, nothing written in it yet
  write:N   --async_checkpoint: in step N's background write, before DCP writes its files (the ranks'
            loader and run state are in the folder); training goes on until it waits for that write
            (at the next save)
  agree:N   before the first agreement of the ranks (resilience/triggers.py) at step N or later, so that a
            stop signal sent meanwhile is agreed at that step
  piece:N   fms-prepare-data's piece N (counted from 0, in the order it runs them: --workers=1), once its
            first document went into its shard's temporary file

A held process writes `held-<rank>` (RANK, 0 without one) in <folder> and waits until <folder>/release
exists; a stop signal (SIGTERM, SIGUSR1, SIGINT) that reaches it meanwhile writes `signalled-<rank>`, then goes to
the run's own handler. It gives up (exit status 3) once its parent has ended, or after GIVE_UP_S, so a
failed test leaves nothing waiting. The real code runs in every case; only when it goes on is held."""

from __future__ import annotations

import itertools
import os
import re
import runpy
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

GIVE_UP_S = 600.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def rank() -> str:
    return os.environ.get("RANK", "0")


def _write(path: Path, text: str) -> None:
    """`path` whole when seen (written aside, then renamed)."""
    aside = path.with_name(f".{path.name}.{os.getpid()}")
    aside.write_text(text)
    aside.rename(path)


def _record_stop_signals(folder: Path) -> dict[int, tuple[Any, Any]]:
    """While held: a stop signal writes signalled-<rank>, then goes to the handler it replaced (the run's).
    Each signal's (handler replaced, recording handler), to put back where the run changed nothing."""
    replaced = {}
    for sig in STOP_SIGNALS:
        handler = signal.getsignal(sig)
        if not callable(handler):  # the default action or ignored: left as it is
            continue

        def recorded(signum: int, frame: Any, handler: Callable = handler) -> None:
            _write(folder / f"signalled-{rank()}", f"{signal.Signals(signum).name}\n")
            handler(signum, frame)

        replaced[sig] = (handler, recorded)
        signal.signal(sig, recorded)
    return replaced


def hold(folder: Path) -> None:
    """Say `held-<rank>`, then wait for <folder>/release (see the module's text)."""
    parent, deadline = os.getppid(), time.monotonic() + GIVE_UP_S
    main = threading.current_thread() is threading.main_thread()  # signal handlers are the main thread's
    replaced = _record_stop_signals(folder) if main else {}
    try:
        _write(folder / f"held-{rank()}", f"{os.getpid()}\n")
        while not (folder / "release").exists():
            if os.getppid() != parent or time.monotonic() > deadline:
                os._exit(3)
            time.sleep(0.02)
    finally:
        for sig, (handler, recorded) in replaced.items():
            if signal.getsignal(sig) is recorded:  # a first Ctrl-C sets SIGINT's default: kept
                signal.signal(sig, handler)


def wait_held(
    folder: Path,
    count: int,
    procs: Iterable[subprocess.Popen],
    timeout: float = 240,
    files: str = "held-*",
    said: Optional[Callable[[], Any]] = None,
) -> None:
    """In a test: until `count` files `files` (held-<rank>, or signalled-<rank>) are in `folder`, while every
    process of `procs` runs; a failure's message is `said()`, else the ended processes' output."""
    procs, deadline = list(procs), time.monotonic() + timeout
    while len(list(folder.glob(files))) < count:
        ended = [p for p in procs if p.poll() is not None]
        if ended or time.monotonic() > deadline:
            detail = (
                said() if said is not None else "".join((p.stdout.read() if p.stdout else "")[-3000:] for p in ended)
            )
            why = "a process ended" if ended else f"not within {timeout:.0f} s"
            raise AssertionError(f"{count} {files} in {folder}: {why}; {detail}")
        time.sleep(0.05)


def install(folder: Path, point: str) -> None:
    """Hold this process at `point` (see the module's text), if it is one of the ranks it names."""
    m = re.fullmatch(r"(step|save|write|agree|piece):(\d+)(?:@(\d+))?", point)
    assert m, f"not a point: {point}"
    where, n, only = m.group(1), int(m.group(2)), m.group(3)
    if only is not None and only != rank():
        return
    folder.mkdir(parents=True, exist_ok=True)
    once = itertools.count()

    def first() -> bool:
        return next(once) == 0

    if where == "step":
        from fms_fsdp.train import loop

        attempt = loop._attempt

        def held_attempt(lp: Any, step: int, *args: Any) -> Any:
            if step == n and first():
                hold(folder)
            return attempt(lp, step, *args)

        loop._attempt = held_attempt
    elif where == "save":
        from fms_fsdp.checkpoint.save import CheckpointSaver

        write_run_state = CheckpointSaver._write_run_state

        def held_write_run_state(self: Any, tmp: Path, step: int, *args: Any) -> None:
            if step == n and first():
                hold(folder)
            write_run_state(self, tmp, step, *args)

        CheckpointSaver._write_run_state = held_write_run_state  # type: ignore[method-assign]
    elif where == "write":
        from fms_fsdp.checkpoint import writer

        storage_writer = writer.storage_writer

        def held_storage_writer(target: Any) -> Any:
            made = storage_writer(target)
            if re.fullmatch(rf"\.?step_{n}_ckp(\.tmp)?", Path(str(target)).name):
                write_data = made.write_data

                def held_write_data(*args: Any, **kwargs: Any) -> Any:
                    hold(folder)
                    return write_data(*args, **kwargs)

                made.write_data = held_write_data
            return made

        writer.storage_writer = held_storage_writer
    elif where == "agree":
        from fms_fsdp.resilience.triggers import StepTriggers

        poll = StepTriggers.poll

        def held_poll(self: Any, step: int, writing: bool) -> Any:
            agrees = step >= self.next_agreement or step == self.settings.num_steps  # as poll decides
            if step >= n and agrees and first():
                hold(folder)
            return poll(self, step, writing)

        StepTriggers.poll = held_poll  # type: ignore[method-assign]
    else:
        from fms_fsdp.data.prepare import build as prepare

        pieces = itertools.count()

        class HeldShardWriter(prepare.ShardWriter):  # type: ignore[name-defined]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                self.held = next(pieces) != n  # only piece n holds, once

            def add(self, tokens: Any) -> None:
                super().add(tokens)
                if not self.held:
                    self.held = True
                    hold(folder)

        prepare.ShardWriter = HeldShardWriter  # type: ignore[attr-defined]


def main() -> None:
    folder, point, script = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    sys.path[0] = str(Path(script).resolve().parent)  # as `python <script>` sets it, not this file's folder
    sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the checkout's package
    install(folder, point)
    sys.argv = sys.argv[3:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
