"""A process that uses the loader with workers always ends, and leaves no worker behind, however the
iterator is held or dropped: sys.exit, an exception in the caller's loop, Ctrl-C, a REPL, garbage
collection, a finished generator. Each ending runs in its own interpreter under a time limit.

Workers ignore stop signals meant for their rank (Slurm signals every process of a job step), but obey
their rank's own SIGTERM, which is how multiprocessing ends daemonic children at interpreter exit.
A worker that dies is started again from the last batch taken, as if it had lived; workers that die
again and again end the run in one line."""

import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from fms_fsdp.data.loader import fork_safely
from fms_fsdp.data.stream import LineReader
from fms_fsdp.errors import DataError

from conftest import data_loader
from test_data import cfg, make_docs, write_dataset

ROOT = Path(__file__).resolve().parents[1]

# takes 5 batches from a loader with 2 workers, holding the iterator in `it`; prints the workers' pids
IMPORTS = """
import gc, multiprocessing, os, signal, sys, time
sys.path.insert(0, {tests!r})
from pathlib import Path
from test_data import cfg
from conftest import data_loader
"""
SETUP = (
    IMPORTS
    + """loader = data_loader(cfg(Path({data!r}), num_workers=2), 0, 2)
it = iter(loader)
for _ in range(5):
    next(it)
print("workers", *[p.pid for p in multiprocessing.active_children()], flush=True)
"""
)

# the process goes on after dropping iterators: a generator that finished, then the held one, collected
DROPPED = """
first = {p.pid for p in multiprocessing.active_children()}
def five():
    g = iter(loader)
    for _ in range(5):
        yield next(g)
assert len(list(five())) == 5
print('after the generator', len({p.pid for p in multiprocessing.active_children()} - first), flush=True)
del it
gc.collect()
print('after collection', len(multiprocessing.active_children()), flush=True)
"""


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("exit_data")
    write_dataset(root, "web", make_docs(10, 200, 1))
    return root


def _setup(shards: Path) -> str:
    return SETUP.format(tests=str(Path(__file__).parent), data=str(shards))


def _gone(pids: list[int], within_s: float = 5.0) -> bool:
    """Whether every pid has ended (or is a zombie awaiting its reaper) within `within_s`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        alive = [
            p
            for p in pids
            if Path(f"/proc/{p}").exists() and "State:\tZ" not in Path(f"/proc/{p}/status").read_text(errors="replace")
        ]
        if not alive:
            return True
        time.sleep(0.1)
    return False


def _workers(stdout: str) -> list[int]:
    line = next(line for line in stdout.splitlines() if line.startswith("workers"))
    pids = [int(p) for p in line.split()[1:]]
    assert len(pids) == 2, stdout
    return pids


def _python(shards: Path, code: str, *flags: str, stdin: str = "") -> subprocess.CompletedProcess:
    """The setup, then `code`, in a new interpreter under a time limit."""
    return subprocess.run(
        [sys.executable, *flags, "-c", _setup(shards) + code],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def sys_exit(shards: Path) -> None:
    proc = _python(shards, "sys.exit(3)")
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert _gone(_workers(proc.stdout))


def exception_in_the_loop(shards: Path) -> None:
    proc = _python(shards, "for i, batch in enumerate(it):\n    if i == 2:\n        raise RuntimeError('boom')")
    assert proc.returncode == 1 and "RuntimeError: boom" in proc.stderr, proc.stderr[-2000:]
    assert _gone(_workers(proc.stdout))


def dropped_iterators(shards: Path) -> None:
    """The process goes on: the workers of a finished generator's iterator, then of a collected one,
    are gone at once."""
    proc = _python(shards, DROPPED)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "after the generator 0\nafter collection 0\n" in proc.stdout, proc.stdout
    assert _gone(_workers(proc.stdout), within_s=0.5)


def repl(shards: Path) -> None:
    """`python -i`: the script's globals (the iterator among them) live until the REPL reads end of input."""
    proc = _python(shards, "", "-i", stdin="print('in the repl', next(it)[0].shape)\n")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "in the repl torch.Size([2, 16])" in proc.stdout
    assert _gone(_workers(proc.stdout))


def ctrl_c(shards: Path) -> None:
    """SIGINT to the whole process group, as a terminal's Ctrl-C sends it, while the loop waits. The
    process takes SIGINT as a terminal's would even where the suite's own shell ignores it (a shell's
    background job does, and its children inherit that)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _setup(shards) + "print('ready', flush=True)\ntime.sleep(60)"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("ready"):
            break
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode in (-signal.SIGINT, 1, 130), err[-2000:]
    assert "KeyboardInterrupt" in err
    assert _gone(_workers("".join(lines)))


def a_stop_signal_for_the_job(shards: Path) -> None:
    """SIGTERM sent to a worker by anyone but its rank (Slurm signals every process of a job step) is
    left to the rank: the workers keep delivering batches."""
    code = (
        "import subprocess\nfor p in multiprocessing.active_children():\n"
        "    subprocess.run(['kill', '-TERM', str(p.pid)], check=True)\ntime.sleep(1)\n"
        "print('alive', len(multiprocessing.active_children()), next(it)[0].shape, flush=True)"
    )
    proc = _python(shards, code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "alive 2 torch.Size([2, 16])" in proc.stdout


@pytest.mark.slow  # every way a run can end, each with its loader workers (about 25 s): the slow tier
def test_no_ending_hangs_or_leaves_a_worker(shards):
    """Each ending in its own interpreter, a few at a time; an assertion names its ending."""
    endings = (sys_exit, exception_in_the_loop, dropped_iterators, repl, ctrl_c, a_stop_signal_for_the_job)
    with ThreadPoolExecutor(3) as pool:
        running = [pool.submit(ending, shards) for ending in endings]
    for result in running:
        result.result()


def _batches(it, n: int) -> list:
    return [torch.cat(next(it), dim=1) for _ in range(n)]


@pytest.mark.slow  # a death is found at torch's 5 s check of the workers
def test_a_killed_worker_is_started_again_from_the_last_batch_taken(shards, capfd):
    """A worker killed while the rank computes (not while it waits for a batch) costs nothing: the
    batches go on as if it had lived, and the rank says so in one line."""
    expected = _batches(iter(data_loader(cfg(shards, num_workers=2), 0, 2)), 9)
    it = iter(data_loader(cfg(shards, num_workers=2), 0, 2))
    found = _batches(it, 3)
    os.kill(multiprocessing.active_children()[0].pid, signal.SIGKILL)
    time.sleep(1)  # the rank's step: torch's SIGCHLD handler would raise in it
    found += _batches(it, 6)
    assert all(torch.equal(a, b) for a, b in zip(found, expected, strict=True))
    assert "warning: rank 0: a data loader worker died (signal 9); started again from the last batch taken" in (
        capfd.readouterr().err
    )


def _die(*args, **kwargs) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.slow  # 4 deaths, each found at torch's 5 s check of the workers
def test_workers_that_die_again_and_again_end_the_run_in_one_line(shards, monkeypatch):
    monkeypatch.setattr(LineReader, "next_line", _die)  # in the workers, forked from here: each dies at once
    with pytest.raises(DataError, match=r"^the data loader's workers died 4 times in a row \(signal 9; out of memory"):
        next(iter(data_loader(cfg(shards, num_workers=1), 0, 2)))


# a gloo group of this process dropped in a reference cycle just before the loader forks its workers (a
# run in the process leaves one), and each forked process collecting its garbage at once (when it does is
# chance: here it is made certain)
DROPPED_GROUP = """
import torch, torch.distributed as dist
from fms_fsdp.parallel.process_group import free_port
loader = data_loader(cfg(Path({data!r}), num_workers=2), 0, 2)
gc.disable()
os.register_at_fork(after_in_child=gc.collect)
group = dist.ProcessGroupGloo(dist.TCPStore("127.0.0.1", free_port(), 1, True), 0, 1)
group.allreduce([torch.ones(1)]).wait()
cycle = [group]
cycle.append(cycle)
del group, cycle
it = iter(loader)
for _ in range(5):
    next(it)
print("five batches", flush=True)
"""


def test_a_process_group_dropped_before_the_workers_start_does_not_hang_them(shards):
    """A worker that freed the rank's dropped process group would wait forever on the rank's gloo threads,
    which it does not have: the rank frees its garbage before it forks them, and they never free theirs."""
    code = (IMPORTS + DROPPED_GROUP).format(tests=str(Path(__file__).parent), data=str(shards))
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        out = proc.communicate(timeout=30)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the process and its hung workers
        pytest.fail("the loader's workers hung freeing the rank's dropped process group")
    assert proc.returncode == 0 and "five batches" in out, out[-3000:]


def test_the_workers_start_thaws_what_it_froze_and_keeps_the_callers_own_freeze():
    """The rank's objects are frozen while its workers fork and thawed after, unless the caller had frozen
    objects of its own: those stay frozen."""
    assert gc.get_freeze_count() == 0, "this process already froze objects: the test cannot tell whose they are"
    during = fork_safely(gc.get_freeze_count)
    assert during > 0 and gc.get_freeze_count() == 0
    gc.freeze()
    try:
        own = gc.get_freeze_count()
        fork_safely(gc.get_freeze_count)
        # undone, the count is 0; kept, it is `own` less the frozen objects freed since (a few)
        assert gc.get_freeze_count() > own // 2, "the caller's own gc.freeze() was undone"
    finally:
        gc.unfreeze()
