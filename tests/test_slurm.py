"""`sbatch scripts/train.slurm` against a real Slurm (munged, slurmctld and slurmd started here on
localhost): the job trains, saves on the time-limit signal, requeues itself and resumes; a SIGTERM
to every process (preemption, scancel) ends it cleanly with a checkpoint."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_cluster import job_state, submit, wait_for

from conftest import TINY


def _records(metrics: Path) -> list[dict]:
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []


def sbatch_train(slurm: dict[str, str], log: Path, *flags: str) -> str:
    """`sbatch scripts/train.slurm` of 2 ranks on this node with `flags`, its output in `log`: the job id."""
    env = {
        **slurm,
        "NPROC_PER_NODE": "2",
        "OMP_NUM_THREADS": "1",
        "PATH": f"{Path(sys.executable).parent}:{slurm['PATH']}",
    }
    sbatch = ("--nodes=1", "--gres=none", f"--cpus-per-task={os.cpu_count()}", "--time=10", f"--output={log}")
    return submit(env, *sbatch, "scripts/train.slurm", *TINY, *flags)


def wait_for_the_end(slurm: dict[str, str], job: str, log: Path) -> str:
    """The job's state once it has ended."""
    ended = ("COMPLETED", "FAILED", "CANCELLED")
    wait_for("the job to end", lambda: job_state(slurm, job) in ended, 300, log)
    return job_state(slurm, job)


@pytest.mark.slow
def test_sbatch_saves_on_time_limit_requeues_resumes_and_stops_cleanly_on_sigterm(
    slurm: dict[str, str], tmp_path: Path
):
    run, log = tmp_path / "run", tmp_path / "job.out"
    metrics = run / "metrics.jsonl"
    job = sbatch_train(
        slurm,
        log,
        "--report_interval=5",
        "--checkpoint_interval=100000",
        "--num_steps=100000",
        f"--ckpt_save_path={run}",
    )
    text = lambda: log.read_text() if log.exists() else ""  # noqa: E731

    wait_for("the first metrics", lambda: len(_records(metrics)) > 0, 300, log)
    # what `#SBATCH --signal=B:USR1@180` delivers to the batch script before the time limit
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=slurm, check=True)
    wait_for("the requeue", lambda: "requeueing job" in text(), 300, log)
    stopped = int(text().split("stopping after step ")[1].split()[0])

    # A requeued job waits two minutes before it may start again; the test lets it start sooner, but
    # not within the second of the requeue: slurmd refuses job credentials as old as its revocation.
    time.sleep(3)

    def started_again() -> bool:
        """Lift the requeue hold (again, until the job starts: the hold may be set after a first lift)."""
        if "start 1 on" in text():
            return True
        if job_state(slurm, job) == "PENDING":
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=slurm, capture_output=True)
        return False

    wait_for("the requeued job to start", started_again, 300, log)
    wait_for("the second attempt's metrics", lambda: _records(metrics)[-1]["step"] > stopped, 300, log)
    # a preemption: SIGTERM to every process of the job's steps (torchrun included)
    subprocess.run(["scancel", "--signal=TERM", job], env=slurm, check=True)
    state, out = wait_for_the_end(slurm, job, log), text()
    assert state == "COMPLETED", out[-4000:]  # exit status 0: torchrun waited for the save
    assert "on SIGUSR1" in out and "start 1 on" in out and "on SIGTERM" in out, out[-4000:]
    assert f"resumed from {run / 'checkpoints' / f'step_{stopped}_ckp'} at step {stopped}" in out, out[-4000:]
    terminated = int(out.split("stopping after step ")[2].split()[0])
    records = _records(metrics)
    assert [r["step"] for r in records][-1] == terminated > stopped
    assert min(r["step"] for r in records if r["step"] > stopped) <= stopped + 5  # went on from the checkpoint
    assert records[-1]["tokens_seen"] == terminated * 2 * 64 * 2  # batch 2 x seq 64 x 2 ranks, none lost
    saved = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert saved == sorted([f"step_{stopped}_ckp", f"step_{terminated}_ckp"]), saved


@pytest.mark.slow
def test_a_rank_error_under_sbatch_is_the_jobs_last_line_and_its_status(slurm: dict[str, str], tmp_path: Path):
    """A run whose data is missing: the job fails with the rank's one line last in its log."""
    log = tmp_path / "job.out"
    missing = [f"--data_path={tmp_path / 'missing'}", "--use_dummy_dataset=False"]
    job = sbatch_train(slurm, log, *missing, f"--ckpt_save_path={tmp_path / 'run'}")
    state, lines = wait_for_the_end(slurm, job, log), log.read_text().strip().splitlines()
    assert state == "FAILED" and lines[-1].startswith("error: "), "\n".join(lines)
    assert str(tmp_path / "missing") in lines[-1] and "Traceback" not in log.read_text(), lines[-10:]


@pytest.mark.slow
def test_ctrl_c_to_a_jobs_steps_saves_and_ends_in_the_stop_line(slurm: dict[str, str], tmp_path: Path):
    """SIGINT to every process of the job's steps (Ctrl-C at an interactive srun, or scancel --signal=INT):
    the ranks agree, save and stop, and the job's last line is the stop line, with no traceback."""
    run, log = tmp_path / "run", tmp_path / "job.out"
    job = sbatch_train(
        slurm,
        log,
        "--report_interval=1",
        "--checkpoint_interval=100000",
        "--num_steps=100000",
        f"--ckpt_save_path={run}",
    )
    wait_for("the first metrics", lambda: len(_records(run / "metrics.jsonl")) > 0, 300, log)
    subprocess.run(["scancel", "--signal=INT", job], env=slurm, check=True)
    wait_for_the_end(slurm, job, log)
    out = log.read_text()
    stopped = re.fullmatch(r"stopping after step (\d+) on SIGINT: the checkpoint is saved, .*", out.splitlines()[-1])
    assert stopped is not None and "Traceback" not in out, out[-4000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step_{stopped.group(1)}_ckp"]
