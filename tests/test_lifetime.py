"""fms_fsdp/lifetime.py: a program started with dying_with_parent (the job's `ray start --block`) ends
when the process that started it is SIGKILLed. Real processes."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARENT = (
    "import subprocess, time; from fms_fsdp.lifetime import dying_with_parent; "
    "child = subprocess.Popen(dying_with_parent(['sleep', '300'])); print(child.pid, flush=True); time.sleep(300)"
)


def running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_program_started_dying_with_its_parent_ends_when_the_parent_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        deadline = time.monotonic() + 10
        while not Path(f"/proc/{child}/cmdline").read_bytes().startswith(b"sleep\0") and time.monotonic() < deadline:
            time.sleep(0.05)  # until it is the program (exec'd)
        assert running(child) and Path(f"/proc/{child}/cmdline").read_bytes().startswith(b"sleep\0")
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running(child), "the child outlived its SIGKILLed parent"
    finally:
        parent.kill()
        if running(child):
            os.kill(child, signal.SIGKILL)
