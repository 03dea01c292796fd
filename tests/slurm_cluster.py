"""A one-node Slurm cluster on this machine (munged, slurmctld and slurmd started on localhost), for
the tests that submit jobs to a real Slurm (tests/test_slurm.py, tests/test_prepare_cluster.py)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import pytest

from fms_fsdp.parallel.process_group import free_port

SBIN = "/usr/sbin:/sbin"
NEEDED = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo")


def _slurm_conf(folder: Path, host: str) -> str:
    return "\n".join(
        [
            "ClusterName=test",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
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


def wait_for(what: str, check: Callable[[], bool], timeout: float, log: Optional[Path] = None) -> None:
    """Poll `check` until it holds; fail naming `what` (and `log`'s tail) after `timeout` seconds. The
    timeouts are hang guards, not budgets: sized for a 2-core machine whose other test worker runs 4-rank
    launches (a Ray cluster and 2 ranks took over 120 s there to reach their first piece)."""
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

        wait_for("the Slurm node to be idle", idle, 180, folder / "slurmctld.log")
        yield env
    finally:
        subprocess.run(["scancel", "--full", "--user=root"], env=env, capture_output=True)
        time.sleep(1)
        subprocess.run(["scontrol", "shutdown"], env=env, capture_output=True)
        subprocess.run(["munged", "--stop", f"--socket={folder / 'munge.sock'}"], env=env, capture_output=True)


def job_state(env: dict[str, str], job: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True).stdout
    fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
    return fields.get("JobState", "UNKNOWN")


def submit(env: dict[str, str], *args: str) -> str:
    """`sbatch --parsable args` from the repository root; the job's id."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        ["sbatch", "--parsable", *args], cwd=root, env=env, check=True, capture_output=True, text=True
    )
    return done.stdout.strip()
