"""`sbatch scripts/train.slurm` against a real Slurm (munged, slurmctld and slurmd started here on
localhost): the job trains, saves on the time-limit signal, requeues itself and resumes; a SIGTERM
to every process (preemption, scancel) ends it cleanly with a checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import pytest

from conftest import ROOT, TINY

SBIN = "/usr/sbin:/sbin"
NEEDED = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _slurm_conf(folder: Path, host: str) -> str:
    return "\n".join(
        [
            "ClusterName=test",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={folder / 'munge.sock'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "ReturnToService=2",
            "JobRequeue=1",
            f"StateSaveLocation={folder / 'state'}",
            f"SlurmdSpoolDir={folder / 'spool'}",
            f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
            f"SlurmdPidFile={folder / 'slurmd.pid'}",
            f"SlurmctldLogFile={folder / 'slurmctld.log'}",
            f"SlurmdLogFile={folder / 'slurmd.log'}",
            f"NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN",
            f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


def _wait(what: str, check: Callable[[], bool], timeout: float, log: Optional[Path] = None) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            tail = log.read_text()[-4000:] if log is not None and log.exists() else ""
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{tail}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A one-node Slurm cluster on this machine; yields the environment its commands need."""
    path = f"{os.environ.get('PATH', '')}:{SBIN}"
    missing = [b for b in NEEDED if shutil.which(b, path=path) is None]
    if missing:
        pytest.skip(
            f"Slurm is not installed ({', '.join(missing)} not found); as root: "
            "apt-get install slurm-wlm munge (CI's .ci/run does this)"
        )
    if os.geteuid() != 0:
        pytest.skip("starting slurmctld, slurmd and munged on localhost needs root")
    folder = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (folder / sub).mkdir()
    key = folder / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    host = socket.gethostname().split(".")[0]
    conf = folder / "slurm.conf"
    conf.write_text(_slurm_conf(folder, host))
    env = {**os.environ, "PATH": path, "SLURM_CONF": str(conf)}
    try:
        socket.gethostbyname(host)
    except OSError:  # a machine whose own name does not resolve: rendezvous on the loopback address
        env["RDZV_HOST"] = "127.0.0.1"
    run = lambda *cmd: subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)  # noqa: E731
    run(
        "munged",
        "--force",
        f"--key-file={key}",
        f"--socket={folder / 'munge.sock'}",
        f"--pid-file={folder / 'munged.pid'}",
        f"--log-file={folder / 'munged.log'}",
        f"--seed-file={folder / 'munged.seed'}",
    )
    try:
        run("slurmctld", "-f", str(conf))
        run("slurmd", "-f", str(conf))

        def idle() -> bool:
            return (
                subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True).stdout.strip()
                == "idle"
            )

        _wait("the Slurm node to be idle", idle, 60, folder / "slurmctld.log")
        yield env
    finally:
        subprocess.run(["scancel", "--full", "--user=root"], env=env, capture_output=True)
        time.sleep(1)
        subprocess.run(["scontrol", "shutdown"], env=env, capture_output=True)
        subprocess.run(["munged", "--stop", f"--socket={folder / 'munge.sock'}"], env=env, capture_output=True)


def _job_state(env: dict[str, str], job: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True).stdout
    fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
    return fields.get("JobState", "UNKNOWN")


def _records(metrics: Path) -> list[dict]:
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []


@pytest.mark.slow
def test_sbatch_saves_on_time_limit_requeues_resumes_and_stops_cleanly_on_sigterm(
    slurm: dict[str, str], tmp_path: Path
):
    run, log = tmp_path / "run", tmp_path / "job.out"
    metrics = run / "metrics.jsonl"
    env = {
        **slurm,
        "NPROC_PER_NODE": "2",
        "OMP_NUM_THREADS": "1",
        "PATH": f"{Path(sys.executable).parent}:{slurm['PATH']}",
    }
    job = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--nodes=1",
            "--gres=none",
            f"--cpus-per-task={os.cpu_count()}",
            "--time=10",
            f"--output={log}",
            "scripts/train.slurm",
            *TINY,
            "--report_interval=5",
            "--checkpoint_interval=100000",
            "--num_steps=100000",
            f"--ckpt_save_path={run}",
        ],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    text = lambda: log.read_text() if log.exists() else ""  # noqa: E731

    _wait("the first metrics", lambda: len(_records(metrics)) > 0, 120, log)
    # what `#SBATCH --signal=B:USR1@180` delivers to the batch script before the time limit
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=slurm, check=True)
    _wait("the requeue", lambda: "requeueing job" in text(), 120, log)
    stopped = int(text().split("stopping after step ")[1].split()[0])

    # A requeued job waits two minutes before it may start again; the test lets it start sooner, but
    # not within the second of the requeue: slurmd refuses job credentials as old as its revocation.
    time.sleep(3)

    def started_again() -> bool:
        """Lift the requeue hold (again, until the job starts: the hold may be set after a first lift)."""
        if "start 1 on" in text():
            return True
        if _job_state(slurm, job) == "PENDING":
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=slurm, capture_output=True)
        return False

    _wait("the requeued job to start", started_again, 120, log)
    _wait("the second attempt's metrics", lambda: _records(metrics)[-1]["step"] > stopped, 120, log)
    # a preemption: SIGTERM to every process of the job's steps (torchrun included)
    subprocess.run(["scancel", "--signal=TERM", job], env=slurm, check=True)
    _wait("the job to end", lambda: _job_state(slurm, job) in ("COMPLETED", "FAILED", "CANCELLED"), 120, log)

    out = text()
    assert _job_state(slurm, job) == "COMPLETED", out[-4000:]  # exit status 0: torchrun waited for the save
    assert "on SIGUSR1" in out and "start 1 on" in out and "on SIGTERM" in out, out[-4000:]
    assert f"resumed from {run / 'checkpoints' / f'step_{stopped}_ckp'} at step {stopped}" in out, out[-4000:]
    terminated = int(out.split("stopping after step ")[2].split()[0])
    records = _records(metrics)
    assert [r["step"] for r in records][-1] == terminated > stopped
    assert min(r["step"] for r in records if r["step"] > stopped) <= stopped + 5  # went on from the checkpoint
    assert records[-1]["tokens_seen"] == terminated * 2 * 64 * 2  # batch 2 x seq 64 x 2 ranks, none lost
    saved = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert saved == sorted([f"step_{stopped}_ckp", f"step_{terminated}_ckp"]), saved
