"""Ctrl-C and a rank's error under torchrun: SIGINT is a stop (the ranks agree, save and print one
line; a second one stops them at once), and the package's launcher (fms-torchrun, scripts/train.sh) ends
in the rank's line and its status instead of torchrun's traceback and summary."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fms_fsdp.checkpoint.layout import complete_checkpoints

from conftest import ROOT, flags
from held_at import wait_held

pytestmark = pytest.mark.torch_api  # also run on the oldest and newest torch (scripts/test_torch.sh)
STOP_LINE = re.compile(
    r"stopping after step (\d+) on SIGINT: the checkpoint is saved, resume by running the same command"
)


def start(launcher: list[str], args: list[str], held: Path) -> subprocess.Popen:
    """main_training.py on 2 ranks under `launcher`, each rank held at its first agreement from step 4 on,
    where a stop signal sent meanwhile is agreed (tests/held_at.py)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    hold = [str(ROOT / "tests" / "held_at.py"), str(held), "agree:4"]
    cmd = [*launcher, "--standalone", "--nproc_per_node=2", *hold, str(ROOT / "main_training.py"), *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def interrupt(proc: subprocess.Popen, held: Path, times: int = 1) -> tuple[int, str]:
    """Ctrl-C as a terminal sends it to torchrun (its ranks are in sessions of their own) while both ranks
    are held, `times` times; then let them go. (status, output)."""
    wait_held(held, 2, [proc])
    for _ in range(times):
        proc.send_signal(signal.SIGINT)
        wait_held(held, 2, [proc], files="signalled-*")  # torchrun passed it on to both ranks
    (held / "release").touch()
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, out


TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
FMS_TORCHRUN = [sys.executable, "-c", "from fms_fsdp.cli import torchrun; torchrun()"]


@pytest.mark.slow  # a 2-rank launch held at an agreement: the slow tier (the launcher's own case stays)
def test_ctrl_c_under_plain_torchrun_saves_and_the_ranks_print_one_line_and_no_traceback(data, tmp_path):
    out = tmp_path / "run"
    status, output = interrupt(start(TORCHRUN, flags(data, out), tmp_path / "held"), tmp_path / "held")
    stops = STOP_LINE.findall(output)
    assert len(stops) == 1, output[-3000:]
    assert "KeyboardInterrupt" not in output
    assert output.count("Traceback") <= 1 and "SignalException" in output  # torchrun's own, its status 1
    assert status == 1
    assert [s for s, _ in complete_checkpoints(out / "checkpoints")] == [int(stops[0])]


@pytest.mark.pinned_torch  # the package's own launcher (plain torchrun's Ctrl-C runs on every torch)
def test_ctrl_c_under_the_launcher_ends_in_the_stop_line_and_status_130(data, tmp_path):
    out = tmp_path / "run"
    status, output = interrupt(start(FMS_TORCHRUN, flags(data, out), tmp_path / "held"), tmp_path / "held")
    last = STOP_LINE.fullmatch(output.rstrip().splitlines()[-1])
    assert last is not None, output[-3000:]
    assert "Traceback" not in output and status == 130
    assert [s for s, _ in complete_checkpoints(out / "checkpoints")] == [int(last.group(1))]


@pytest.mark.pinned_torch  # the package's own second-signal handling
@pytest.mark.slow  # a 2-rank launch held at an agreement: the slow tier (the launcher's own case stays)
def test_a_second_ctrl_c_stops_at_once_without_saving_or_a_traceback(data, tmp_path):
    out, held = tmp_path / "run", tmp_path / "held"
    proc = start(FMS_TORCHRUN, flags(data, out, "--checkpoint_interval=2"), held)
    wait_held(held, 2, [proc])
    before = [s for s, _ in complete_checkpoints(out / "checkpoints")]
    began = time.monotonic()
    status, output = interrupt(proc, held, times=2)
    assert status == 130 and time.monotonic() - began < 60
    assert "Traceback" not in output and "stopping after step" not in output, output[-3000:]
    assert before and [s for s, _ in complete_checkpoints(out / "checkpoints")] == before  # nothing saved since


@pytest.mark.pinned_torch  # the package's own launch script
def test_a_rank_error_under_the_launch_script_is_the_last_line_with_its_status(data, tmp_path):
    # the script runs `python` from PATH, as with this environment activated
    path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NPROC_PER_NODE": "2", "PATH": path}
    missing = tmp_path / "nowhere"
    argv = ["bash", str(ROOT / "scripts" / "train.sh"), *flags(data, tmp_path / "run"), f"--ckpt_load_path={missing}"]
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    lines = (proc.stdout + proc.stderr).rstrip().splitlines()
    assert lines[-1] == f"error: --ckpt_load_path: {missing} does not exist", lines[-20:]
    assert proc.returncode == 2 and "ChildFailedError" not in proc.stderr


@pytest.mark.slow
def test_ctrl_c_before_the_ranks_exist_ends_the_launcher_at_once(tmp_path):
    """While the rendezvous waits for a node that never comes (its store, which the launcher hosts, takes
    connections), Ctrl-C ends fms-torchrun: status 130."""
    from fms_fsdp.parallel.process_group import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    port = free_port()
    cmd = [*FMS_TORCHRUN, "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d"]
    cmd += [f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=alone", str(ROOT / "main_training.py"), "--help"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not listening(port):
        assert proc.poll() is None and time.monotonic() < deadline, "the launcher never reached its rendezvous"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "Traceback" not in out, out[-3000:]


def listening(port: int) -> bool:
    """Whether something on this machine accepts connections on `port`."""
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
