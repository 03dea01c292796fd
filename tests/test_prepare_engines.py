"""fms-prepare-data's process pool (the local engine, also a training rank's cache build): a worker that
dies costs only time, one that keeps dying ends in one line, and the workers are not forked from the
calling process (whose threads, a tracker's for one, can abort a forked child)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from fms_fsdp.data.prepare.engines import POOL_RESTARTS, run_local
from fms_fsdp.errors import DataError


def no_setup(tokenizer: str | None) -> None:
    """The pool's worker set-up (the tokenizer's load): nothing here."""


def dies_once_at_every_third(job: tuple[int, str]) -> tuple[int, dict]:
    """Jobs 0, 3 and 6 SIGKILL their worker the first time they run."""
    n, folder = job
    marker = Path(folder) / f"died-{n}"
    if n % 3 == 0 and not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return n, {"parent": os.getppid()}


def reads_the_environment(job: str) -> tuple[str, dict]:
    return job, {"value": os.environ.get(job)}


def always_dies(job: int) -> tuple[int, dict]:
    os.kill(os.getpid(), signal.SIGKILL)
    return job, {}


def test_a_killed_worker_costs_only_time_and_the_workers_are_not_forked_from_the_caller(tmp_path, capfd):
    jobs = [(n, str(tmp_path)) for n in range(8)]
    done = dict(run_local(dies_once_at_every_third, no_setup, jobs, None, 2))
    assert sorted(done) == list(range(8))  # every job, each once
    assert sorted(p.name for p in tmp_path.iterdir()) == ["died-0", "died-3", "died-6"]
    assert all(info["parent"] != os.getpid() for info in done.values())  # the fork server's children
    assert "warning: a worker of the process pool died; " in capfd.readouterr().err


def test_workers_that_keep_dying_end_in_one_line():
    with pytest.raises(DataError, match=f"workers died {POOL_RESTARTS + 1} times .*run the same command again"):
        list(run_local(always_dies, no_setup, [1, 2, 3], None, 2))


def test_the_workers_have_the_callers_environment_of_now(monkeypatch):
    """Object storage's keys set after the fork server started (it keeps the environment of its start)."""
    list(run_local(reads_the_environment, no_setup, ["HOME", "HOME"], None, 2))  # the fork server is up
    monkeypatch.setenv("FMS_TEST_BUCKET_KEY", "set later")
    done = dict(run_local(reads_the_environment, no_setup, ["FMS_TEST_BUCKET_KEY", "HOME"], None, 2))
    assert done["FMS_TEST_BUCKET_KEY"] == {"value": "set later"}
