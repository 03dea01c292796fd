"""Run a script of the package with fms-prepare-data's pieces held at a known point, so that a test's kill
lands mid-build every time instead of racing the workers:

    python tests/held_pieces.py <tickets folder> <first held ticket> scripts/prepare_data.py [its arguments]
    python tests/held_pieces.py <tickets folder> <first held ticket> -m fms_fsdp.data.prepare.beside [...]

Each piece takes the next ticket (a folder made atomically in <tickets folder>, shared by every process and
Ray worker of the run). A piece whose ticket is below <first held ticket> is tokenized at once; any other
writes `held-<ticket>` (its pid and Slurm array task) and waits until `<tickets folder>/release` exists, then
is tokenized, or until the command that started it ends (or GIVE_UP_S pass), then its worker exits without
writing anything.
The real piece function runs in every case; only its start is held."""

from __future__ import annotations

import os
import runpy
import sys
import time
from pathlib import Path

GIVE_UP_S = 300.0


def take_ticket(tickets: Path) -> int:
    """The lowest number no other piece has taken (mkdir is atomic, also across machines' processes)."""
    n = 0
    while True:
        try:
            (tickets / f"ticket-{n}").mkdir()
            return n
        except FileExistsError:
            n += 1


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def hold(tickets: Path, first_held: int, driver: int) -> None:
    """Take a ticket; from `first_held` on, wait for the release (or exit once the driver has ended)."""
    ticket = take_ticket(tickets)
    if ticket < first_held:
        return
    task = os.environ.get("SLURM_ARRAY_TASK_ID", "")
    (tickets / f".held-{ticket}").write_text(f"{os.getpid()} {task}\n")
    (tickets / f".held-{ticket}").rename(tickets / f"held-{ticket}")  # whole when seen
    deadline = time.monotonic() + GIVE_UP_S
    while not (tickets / "release").exists():
        if not alive(driver) or time.monotonic() > deadline:  # a failed test leaves nothing waiting
            os._exit(1)
        time.sleep(0.05)


class HeldPiece:
    """process_piece, held, in this machine's processes: in this one (--workers=1) or in a process pool's
    workers, which get it pickled and run their own (unheld) module's piece function once let go."""

    def __init__(self, work, tickets: Path, first_held: int, driver: int) -> None:
        self.work, self.tickets, self.first_held, self.driver = work, tickets, first_held, driver

    def __getstate__(self) -> dict:
        return {**self.__dict__, "work": None}

    def __call__(self, job):
        hold(self.tickets, self.first_held, self.driver)
        if self.work is None:
            from fms_fsdp.data.prepare import build as prepare

            return prepare.process_piece(job)
        return self.work(job)


def held_on_ray(tickets: Path, first_held: int, driver: int):
    """process_piece_with, held, as a Ray task: the worker's own (unheld) module does the piece."""

    def held_task(job, tokenizer):
        hold(tickets, first_held, driver)
        from fms_fsdp.data.prepare import build as prepare

        return prepare.process_piece_with(job, tokenizer)

    return held_task


def main() -> None:
    tickets, first_held, script = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    tickets.mkdir(parents=True, exist_ok=True)
    from held_pieces import HeldPiece  # by its own name, so that a pool's workers can unpickle it

    from fms_fsdp.data.prepare import build as prepare

    driver = os.getpid()
    prepare.process_piece = HeldPiece(prepare.process_piece, tickets, first_held, driver)
    prepare.process_piece_with = held_on_ray(tickets, first_held, driver)
    if script == "-m":
        sys.argv = sys.argv[4:]  # the module's name, then its arguments
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[3:]
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
