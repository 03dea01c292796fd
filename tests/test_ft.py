"""Fault tolerance across replica groups (--fault_tolerance, torchft): two groups of 2 real ranks and a real
lighthouse on 127.0.0.1. One group is killed mid-run (SIGKILL) and started again with the same command:
the other trains on alone, and the restarted group heals from it live."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

from fms_fsdp.distributed import free_port
from fms_fsdp.errors import ConfigError
from fms_fsdp.flags import parse_args
from fms_fsdp.ft import FTSettings, wait_for_lighthouse

from conftest import ROOT, TINY, records, run_here

pytest.importorskip("torchft")  # requirements-test.txt installs it: CI runs these

LIGHTHOUSE = Path(sys.executable).parent / "torchft_lighthouse"
SCHEDULE = ["--lr_schedule=constant", "--warmup_steps=2"]  # the same in a run of 4 steps and of 100,000
FT = [*TINY, *SCHEDULE, "--batch_size=2", "--sharding_strategy=fsdp", "--fault_tolerance=True", "--ft_replica_groups=2"]


class Group:
    """One replica group: 2 ranks started as torchrun starts them, output to a file per rank."""

    def __init__(self, index: int, args: list[str], folder: Path, name: str):
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
        }
        self.logs = [folder / f"{name}_rank{r}.log" for r in range(2)]
        self.procs = [
            subprocess.Popen(
                [sys.executable, str(ROOT / "main_training.py"), *args, f"--ft_group_index={index}"],
                cwd=ROOT,
                env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                stdout=log.open("w"),
                stderr=subprocess.STDOUT,
            )
            for r, log in enumerate(self.logs)
        ]

    def output(self) -> str:
        return self.logs[0].read_text()

    def signal(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(sig)

    def wait(self, timeout: float = 120) -> int:
        codes = [p.wait(timeout) for p in self.procs]
        return next((c for c in codes if c), 0)


def until(condition: Callable[[], bool], what: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture
def lighthouse():
    """A lighthouse that drops a group after 1 s without a heartbeat; its address."""
    port = free_port()
    proc = subprocess.Popen(
        [
            str(LIGHTHOUSE),
            "--min_replicas=1",
            f"--bind=[::]:{port}",
            "--heartbeat_timeout_ms=1000",
            "--join_timeout_ms=1000",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    yield f"127.0.0.1:{port}"
    proc.kill()
    proc.wait()


def steps_of(folder: Path) -> list[int]:
    return [r["step"] for r in records(folder)]


def reported(folder: Path) -> int:
    """Metrics records written so far (read while the run writes)."""
    path = folder / "metrics.jsonl"
    return path.read_text().count('"step"') if path.exists() else 0


def test_a_killed_group_is_dropped_and_heals_live_on_return(tmp_path, lighthouse):
    """Group 1 is SIGKILLed after step 6 (its last checkpoint: step 4) and started again: group 0 never
    stops (its steps go on, 1 group, the stall reported), group 1 heals from it at a later step with
    its own data position (its loader has taken exactly the batches of the steps it committed), and
    from then on both groups hold bit-equal weights and optimizer state (the same checkpoint files).
    Before the kill, the two groups train as one rank with the same global batch (HSDP's math)."""
    out = tmp_path / "run"
    args = [
        *FT,
        f"--ft_lighthouse={lighthouse}",
        "--num_steps=100000",
        "--checkpoint_interval=4",
        "--checkpoint_keep=100",
    ]
    args += [f"--ckpt_save_path={out}"]
    first, second = Group(0, args, tmp_path, "g0"), Group(1, args, tmp_path, "g1")
    until(lambda: reported(out / "group_1") >= 6, "step 6")
    second.signal(signal.SIGKILL)
    second.wait()
    killed_at = steps_of(out / "group_1")[-1]
    again = Group(1, args, tmp_path, "g1b")
    until(lambda: "healed from a live group" in again.output(), "the heal")
    healed_at = int(re.search(r"healed from a live group at step (\d+)", again.output()).group(1))
    common = (healed_at // 4 + 1) * 4  # the first checkpoint both groups write after the heal
    both = [out / f"group_{g}" / "checkpoints" / f"step_{common}_ckp" for g in (0, 1)]
    until(lambda: all(c.exists() for c in both), "a checkpoint after the heal")
    first.signal(signal.SIGTERM)
    again.signal(signal.SIGTERM)
    assert first.wait() == 0 and again.wait() == 0, first.output()[-2000:] + again.output()[-2000:]

    log = first.output()
    dropped = int(re.search(r"ft: step (\d+): group 1 dropped: 1 of 2 groups", log).group(1))
    assert f"ft: step {healed_at + 1}: group 1 joined: 2 of 2 groups" in log
    history = records(out / "group_0")
    assert [r["step"] for r in history] == list(range(1, len(history) + 1))  # one run: it never stopped
    alone = [r for r in history if dropped <= r["step"] <= healed_at]
    assert alone and all(r["ft_groups"] == 1 for r in alone) and history[-1]["ft_groups"] == 2
    stall = max(r["step_time"] for r in history[dropped - 2 : dropped + 1])
    print(
        f"group 1 killed after step {killed_at}, dropped at step {dropped} (stall {stall:.2f} s), healed at {healed_at}"
    )
    assert dropped <= killed_at + 2 and healed_at > killed_at

    files = sorted(p.name for p in both[0].glob("*.distcp"))
    assert files and all((both[0] / f).read_bytes() == (both[1] / f).read_bytes() for f in files)
    taken = [torch.load(c / "loader_state_0.pth", weights_only=True)["loader"]["batches_seen"] for c in both]
    assert taken == [common, (dropped - 1) + (common - healed_at)]  # no batch lost or repeated

    reference = tmp_path / "reference"  # the global batch of 8 lines on one rank
    run_here(
        [
            *TINY,
            *SCHEDULE,
            "--num_steps=4",
            "--batch_size=8",
            "--checkpoint_interval=0",
            f"--ckpt_save_path={reference}",
        ]
    )
    want = {r["step"]: r["loss"] for r in records(reference)}
    got = {s: (a["loss"] + b["loss"]) / 2 for s, a, b in zip(range(1, 5), history, records(out / "group_1"))}
    assert all(got[s] == pytest.approx(want[s], abs=1e-5) for s in want), (got, want)


def test_start_up_errors_name_the_flag(tmp_path, lighthouse):
    base = [*FT, "--num_steps=1", f"--ckpt_save_path={tmp_path}", f"--ft_lighthouse={lighthouse}"]
    cases = {
        "--ft_group_index=2": "--ft_group_index=2 must be below --ft_replica_groups=2",
        "--ft_min_replicas=3 --ft_group_index=0": "--ft_min_replicas=3 is more than the 2 replica groups",
        "--ft_group_index=0": "each group shards with FSDP over its own ranks (at least 2; this group has 1",
    }
    for flag, message in cases.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            run_here([*base, *flag.split()])
    with pytest.raises(ConfigError, match=r"needs --ft_group_index \(or \$REPLICA_GROUP_ID\)"):
        run_here(base)
    cfg = parse_args([*base, "--ft_group_index=0", "--ft_lighthouse=127.0.0.1:1", "--ft_timeout_seconds=1"])
    with pytest.raises(
        ConfigError, match=re.escape("--ft_lighthouse=http://127.0.0.1:1: nothing answers there after 1 s")
    ):
        wait_for_lighthouse(FTSettings.of(cfg))
