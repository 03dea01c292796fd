"""Fault tolerance across replica groups (--fault_tolerance, torchft): two groups of 2 real ranks and a real
lighthouse on 127.0.0.1. One group is killed mid-run (SIGKILL) and started again with the same command:
the other trains on alone, and the restarted group catches up from it live."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from fms_fsdp.checkpoint.layout import complete_checkpoints
from fms_fsdp.console import Labelled
from fms_fsdp.parallel.process_group import free_port
from fms_fsdp.resilience.ft import Watchdog, short_cause
from fms_fsdp.resilience.ft_settings import fingerprint
from fms_fsdp.settings import SHARED_FLAGS, shared_of

from conftest import ROOT, TINY, inspect_data, launch, records, run_here

# torchft over torch's collectives: also run on the oldest and newest torch (scripts/test_torch.sh), but for
# the ledger's and the local launcher's tests, which add nothing of torch's to the others
TORCH_API = pytest.mark.torch_api

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


def start_lighthouse(port: int) -> subprocess.Popen:
    """A lighthouse that drops a group after 1 s without a heartbeat."""
    return subprocess.Popen(
        [str(LIGHTHOUSE), "--min_replicas=1", f"--bind=[::]:{port}", "--heartbeat_timeout_ms=1000"]
        + ["--join_timeout_ms=1000"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@pytest.fixture(scope="module")
def lighthouse():
    """A lighthouse of this module's tests; its address."""
    port = free_port()
    proc = start_lighthouse(port)
    yield f"127.0.0.1:{port}"
    proc.kill()
    proc.wait()


def steps_of(folder: Path) -> list[int]:
    return [r["step"] for r in records(folder)]


def reported(folder: Path) -> int:
    """Metrics records written so far (read while the run writes)."""
    path = folder / "metrics.jsonl"
    return path.read_text().count('"step"') if path.exists() else 0


def kill_and_catch_up(tmp: Path, lighthouse: str, *extra: str) -> dict[str, Any]:
    """Two groups; group 1 SIGKILLed after step 3 (its last checkpoint: step 2) and started again with
    the same command; both SIGKILLed once they committed a checkpoint after the catch-up."""
    out = tmp / "run"
    args = [*FT, "--num_steps=100000", "--checkpoint_interval=2", "--checkpoint_keep=10", f"--ckpt_save_path={out}"]
    args += [f"--ft_lighthouse={lighthouse}", *extra]
    first, second = Group(0, args, tmp, "g0"), Group(1, args, tmp, "g1")
    until(lambda: reported(out / "group_1") >= 3, "step 3")
    second.signal(signal.SIGKILL)
    second.wait()
    killed_at = steps_of(out / "group_1")[-1]
    again = Group(1, args, tmp, "g1b")
    until(lambda: "caught up from a live group" in again.output(), "the catch-up")
    caught_up_at = int(re.search(r"caught up from a live group at step (\d+)", again.output()).group(1))
    common = (caught_up_at // 2 + 1) * 2  # the first checkpoint both groups write after the catch-up
    both = [out / f"group_{g}" / "checkpoints" / f"step_{common}_ckp" for g in (0, 1)]
    until(lambda: all(c.exists() for c in both), "a checkpoint after the catch-up")
    assert all(p.poll() is None for p in first.procs + again.procs), first.output()[-2000:] + again.output()[-2000:]
    first.signal(signal.SIGKILL)
    again.signal(signal.SIGKILL)
    first.wait(), again.wait()
    return {
        "out": out,
        "tmp": tmp,
        "log": first.output(),
        "killed_at": killed_at,
        "caught_up_at": caught_up_at,
        "common": common,
        "both": both,
    }


@pytest.fixture(scope="module")
def caught_up(tmp_path_factory, lighthouse) -> dict[str, Any]:
    """kill_and_catch_up on synthetic lines (the same global batch on one rank: the reference)."""
    return kill_and_catch_up(tmp_path_factory.mktemp("ft"), lighthouse)


@TORCH_API
@pytest.mark.slow
def test_a_killed_group_is_dropped_and_catches_up_live_on_return(caught_up):
    """Group 0 never stops (its steps go on, 1 group, the stall reported); group 1 catches up from it at a
    later step with its own data position (its loader has taken exactly the batches of the steps it
    committed), and from then on both groups hold bit-equal weights and optimizer state (the same
    checkpoint files). Before the kill, the two groups train as one rank with the same global batch
    (HSDP's math)."""
    out, log, caught_up_at, common, both = (caught_up[k] for k in ("out", "log", "caught_up_at", "common", "both"))
    # one line of ours says it, with the cause in a few words (not gloo's text); every line of ours is
    # labelled with its group, and torchft's HTTP access log of the live transfer is not on the console
    drop = re.search(
        r"^\[group 0\] ft: step (\d+): group 1 dropped( \(([a-z' ]+)\))?: 1 of 2 groups train on$", log, re.M
    )
    assert drop and "GLHF" not in log and ".cpp" not in log and "HTTP/1.1" not in log, log[-3000:]
    torchft = (out / "group_0" / "torchft.log").read_text()  # torchft's own lines, each with its rank
    assert {"rank 0", "rank 1"} <= set(re.findall(r"rank \d", torchft)) and "torchft.manager" in torchft, torchft
    assert "torchft.manager" not in log, log[-3000:]
    dropped = int(drop.group(1))
    ours = [line for line in log.splitlines() if re.search(r"\| loss |ft: |checkpoint: |^model ", line)]
    assert ours and all(line.startswith("[group 0] ") for line in ours), ours
    out_for = caught_up_at + 1 - dropped
    assert (
        f"[group 0] ft: step {caught_up_at + 1}: group 1 joined (out for {out_for} steps): 2 of 2 groups train on"
        in log
    )
    history = records(out / "group_0")
    assert [r["step"] for r in history] == list(range(1, len(history) + 1))  # one run: it never stopped
    alone = [r for r in history if dropped <= r["step"] <= caught_up_at]
    assert alone and all(r["ft_groups"] == 1 for r in alone) and history[-1]["ft_groups"] == 2
    assert sum(r["ft_dropped"] for r in history) == 1 and sum(r["ft_joined"] for r in history) == 1
    stall = max(r["step_time"] for r in history[dropped - 2 : dropped + 1])
    print(
        f"group 1 killed after step {caught_up['killed_at']}, dropped at {dropped} (stall {stall:.2f} s), caught up at "
        f"{caught_up_at}: {drop.group(0)}"
    )
    assert dropped <= caught_up["killed_at"] + 2 and caught_up_at > caught_up["killed_at"]

    files = sorted(p.name for p in both[0].glob("*.distcp"))
    assert files and all((both[0] / f).read_bytes() == (both[1] / f).read_bytes() for f in files)
    taken = [torch.load(c / "loader_state_0.pth", weights_only=True)["loader"]["batches_seen"] for c in both]
    assert taken == [common, (dropped - 1) + (common - caught_up_at)]  # no batch lost or repeated

    reference = caught_up["tmp"] / "reference"  # the global batch of 8 lines on one rank
    run_here(
        [
            *TINY,
            *SCHEDULE,
            "--num_steps=3",
            "--batch_size=8",
            "--checkpoint_interval=0",
            f"--ckpt_save_path={reference}",
        ]
    )
    want = {r["step"]: r["loss"] for r in records(reference)}
    got = {s: (a["loss"] + b["loss"]) / 2 for s, a, b in zip(range(1, 4), history, records(out / "group_1"))}
    assert all(got[s] == pytest.approx(want[s], abs=1e-5) for s in want), (got, want)


@pytest.mark.slow
def test_the_ledger_of_both_groups_after_a_catch_up_holds_every_document_once(tmp_path, lighthouse, data):
    """The same kill and catch-up on `data`: fms-inspect-data --ledger over both groups' checkpoints of the
    step after the catch-up covers the job's 4 data ranks, sees no document twice, and counts exactly
    the tokens of the batches the ranks took (2 lines of 33 tokens each: the run stays in its first epoch)."""
    on_data = ["--use_dummy_dataset=False", f"--data_path={data}", "--datasets=web", "--file_type=auto"]
    on_data += ["--vocab_size=1024", "--seq_length=32", "--logical_shards=16", "--num_workers=1"]
    ran = kill_and_catch_up(tmp_path, lighthouse, *on_data)
    both = ",".join(str(c) for c in ran["both"])
    proc = inspect_data(f"--ledger={both}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].endswith(f"(step {ran['common']}): the data positions of 4 of 4 data-parallel ranks"), lines
    assert len(lines) == 2 and " 0 twice, 0 more often, " in lines[1], lines
    taken = [  # each group's checkpoint holds its own ranks' states
        torch.load(c / f"loader_state_{r}.pth", weights_only=True)["loader"]["batches"]
        for c in ran["both"]
        for r in (0, 1)
    ]
    read = sum(int(line.split("; ")[1].split(" tokens")[0].replace(",", "")) for line in lines[1:])
    assert read == sum(taken) * 2 * 33, (taken, lines)


# what runs inside each replica group (2 ranks), and the mesh of the same run as one torchrun of 4 ranks
# whose replicate dimension plays the groups' part (HSDP's math: the groups average their gradients)
COMPOSED = {
    "tensor parallel, async checkpoints, evaluation, exports": (
        ["--tensor_parallel_size=2", "--async_checkpoint=True", "--eval_interval=2", "--export_interval=2"],
        ["--sharding_strategy=hsdp", "--sharding_group_size=1"],
    ),
    "context parallel, float8, offloaded state and activations": (
        ["--context_parallel_size=2", "--float8=True", "--float8_min_size=16", "--batch_size=1", "--cpu_offload=True"]
        + ["--fsdp_activation_checkpointing=True", "--ac_mode=offload"],
        ["--sharding_strategy=hsdp", "--sharding_group_size=1"],
    ),
}


@TORCH_API
@pytest.mark.slow
@pytest.mark.composition  # 1 minute a torch release: run on the pinned one only
@pytest.mark.parametrize("case", COMPOSED)
def test_replica_groups_compose_with_the_features_inside_them(case, tmp_path, lighthouse, data):
    """Two replica groups of 2 ranks, each running `case`'s features, train to the losses and evaluation
    losses of the same mesh as one torchrun (within fp32 reduction order); their checkpoints, background
    ones included, and exports are written by every group."""
    inside, mesh = COMPOSED[case]
    common = [*TINY, *SCHEDULE, "--batch_size=2", "--vocab_size=1024", "--num_steps=4", "--checkpoint_interval=2"]
    common += [f"--eval_data_path={data}", "--eval_batches=2"] if "--eval_interval=2" in inside else []
    out, reference = tmp_path / "run", tmp_path / "reference"
    ft = ["--fault_tolerance=True", "--ft_replica_groups=2", f"--ft_lighthouse={lighthouse}"]
    groups = [Group(g, [*common, *inside, *ft, f"--ckpt_save_path={out}"], tmp_path, f"g{g}") for g in (0, 1)]
    statuses = [g.wait(timeout=240) for g in groups]
    assert statuses == [0, 0], groups[0].output()[-3000:] + groups[1].output()[-3000:]
    proc = launch("main_training.py", [*common, *inside, *mesh, f"--ckpt_save_path={reference}"], 4)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    want = {r["step"]: r for r in records(reference)}
    got = [{r["step"]: r for r in records(out / f"group_{g}")} for g in (0, 1)]
    # a group reports the loss of its own lines (the reference: of both replicas'); each evaluates alike
    losses = [((got[0][s]["loss"] + got[1][s]["loss"]) / 2, want[s]["loss"]) for s in want if "loss" in want[s]]
    evaluated = [(g[s]["eval_loss"], want[s]["eval_loss"]) for s in want if "eval_loss" in want[s] for g in got]
    assert len(losses) >= 2 and all(a == pytest.approx(b, rel=1e-4) for a, b in losses + evaluated), (losses, evaluated)
    assert bool(evaluated) == ("--eval_interval=2" in inside)
    for g in (0, 1):
        folder = out / f"group_{g}"
        assert [s for s, _ in complete_checkpoints(folder / "checkpoints")] == [2, 4]
        if "--export_interval=2" in inside:
            assert sorted(p.name for p in (folder / "exports").iterdir()) == ["step_2", "step_4"]


@pytest.mark.slow  # the package's own checks of the groups (not torch_api: the same on every torch)
def test_a_group_with_another_model_and_then_too_few_groups_end_in_one_line_each(tmp_path, lighthouse):
    """Group 1 runs another batch size: it ends at its first step in the one line naming what to compare.
    Group 0 (the lowest-numbered) is not the one that differs, but with --ft_min_replicas=2 it is left
    alone: its steps do not commit, and after --ft_step_timeout_seconds it ends in the one line naming
    that flag."""
    args = [*FT, f"--ft_lighthouse={lighthouse}", "--num_steps=3", "--ft_timeout_seconds=10", "--ft_min_replicas=2"]
    args += [f"--ckpt_save_path={tmp_path / 'run'}", "--ft_step_timeout_seconds=1"]
    first, odd = Group(0, args, tmp_path, "g0"), Group(1, [*args, "--batch_size=4"], tmp_path, "g1")
    assert odd.wait() == 2 and first.wait() == 1, first.output()[-2000:] + odd.output()[-2000:]
    assert (
        "error: --fault_tolerance: group 1 runs another model, mesh or flags than group 0: every group must run the "
        "same flags" in odd.output()
    ), odd.output()[-2000:]
    line = r"error: --fault_tolerance: fewer than --ft_min_replicas=2 groups took part \(1\) for \d+ s \(--ft_step_"
    assert re.search(line, first.output()), first.output()[-2000:]
    assert "Traceback" not in odd.output() + first.output()
    assert reported(tmp_path / "run" / "group_0") == 0  # no step committed


@TORCH_API
def test_the_fingerprint_tells_apart_groups_whose_updates_would_differ():
    """Each flag that sets a group's batches or updates (seed, learning rate, schedule...) changes the
    fingerprint, so such a group ends in the one line above; paths (the data's too) and logging may differ."""
    from fms_fsdp.config import train_config

    cfg = train_config()
    base = fingerprint(shared_of(cfg), "llama", "mesh")

    def changed(flag: str, value: Any) -> str:
        other = train_config()
        setattr(other, flag, value)
        return fingerprint(shared_of(other), "llama", "mesh")

    assert all(hasattr(cfg, f) for f in SHARED_FLAGS)
    assert {f for f in SHARED_FLAGS if changed(f, ("another", getattr(cfg, f))) == base} == set()
    assert {"seed", "learning_rate", "warmup_steps", "lr_schedule", "batch_size"} <= set(SHARED_FLAGS)
    for flag, value in (("ckpt_save_path", "/b"), ("data_path", "/b"), ("ft_group_index", 3), ("report_interval", 7)):
        assert changed(flag, value) == base, flag
    assert (
        fingerprint(shared_of(cfg), "llama", "another mesh")
        != base
        != fingerprint(shared_of(cfg), "another model", "mesh")
    )


@TORCH_API
def test_the_watchdog_ends_a_hung_step_in_one_line():
    """A step armed and never finished (a hang: the process is alive, torchft's thread would keep
    heartbeating) ends the process with status 1 (os._exit, here recorded) once the deadline passes;
    a step that finishes in time does not (one whose disarm came, measured, before its deadline: on a
    loaded machine whose sleep overran it, a new watchdog tries again)."""
    for _ in range(5):
        said, ended = [], []
        dog = Watchdog(0.4, said.append, ended.append)
        armed = time.monotonic()
        dog.arm(6)  # its deadline: armed + 0.4 s or later
        time.sleep(0.2)
        dog.disarm()
        if time.monotonic() - armed < 0.4:
            break
    else:
        pytest.fail("no step of 0.2 s finished within 0.4 s here, five times: the machine is too loaded")
    time.sleep(0.4)  # past the deadline, which the disarm took away
    assert ended == [] and said == []
    dog.arm(7)
    until(lambda: ended == [1], "the watchdog", timeout=5)
    assert said == [
        "error: --fault_tolerance: step 7 made no progress in 0.4 s (--ft_step_timeout_seconds); this group "
        "exits so that the others drop it"
    ]


@TORCH_API
def test_a_failed_collective_is_said_in_a_few_words_and_each_group_labels_its_lines():
    gloo = (
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:538] Connection closed by peer [127.0.0.1]:4321 "
        "GLHF! \U0001f3d6\ufe0f"
    )
    assert short_cause(RuntimeError(gloo)) == "a group's connection broke"
    assert short_cause(RuntimeError("Timed out waiting 10000ms for recv")) == "a collective timed out"
    assert short_cause(RuntimeError("something new")) == "a collective failed"
    out = io.StringIO()
    stream = Labelled(out, "[group 1] ")
    stream.write("step 1 | loss 2\nstep 2")
    stream.write(" | loss 1\n\nerror: x\n")
    assert out.getvalue() == "[group 1] step 1 | loss 2\n[group 1] step 2 | loss 1\n[group 1] \n[group 1] error: x\n"


@TORCH_API
def test_a_labelled_line_reaches_the_shared_console_in_one_write():
    """print() writes a line's text and its end apart: the other groups' lines must not land in between."""
    writes: list[str] = []
    console = io.StringIO()
    console.write = lambda text: writes.append(text) or len(text)  # type: ignore[method-assign]
    stream = Labelled(console, "[group 0] ")
    print("step 2 | loss 8.4", file=stream)
    print("step 4", end="", file=stream)
    assert writes == ["[group 0] step 2 | loss 8.4\n"]
    stream.flush()  # a progress bar's unfinished line shows at a flush, its rest is not labelled again
    print(" | loss 8.3", file=stream)
    assert writes[1:] == ["[group 0] step 4", " | loss 8.3\n"]


@pytest.mark.slow
def test_the_local_launcher_keeps_the_lighthouse_off_the_console_and_labels_each_group(tmp_path):
    """scripts/train_ft.sh local, as docs/launching.md runs it: the console holds our lines, each group's
    labelled; the lighthouse's quorum lines are in its log file."""
    lighthouse_log = tmp_path / "lighthouse.log"
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "OMP_NUM_THREADS": "1",
        "FT_LIGHTHOUSE": f"localhost:{free_port()}",
        "FT_LIGHTHOUSE_LOG": str(lighthouse_log),
        "FT_GROUPS": "2",
        "NPROC_PER_NODE": "2",
        "RUST_LOG": "warn",  # a caller's own setting: the lighthouse's log still gets its quorum lines
    }
    flags = ["--config=scripts/quickstart.yaml", "--num_steps=4", "--report_interval=2", "--seq_length=64"]
    proc = subprocess.run(
        ["bash", "scripts/train_ft.sh", "local", *flags, "--batch_size=2", f"--ckpt_save_path={tmp_path / 'run'}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console[-3000:]
    assert "torchft::lighthouse" not in console, console[-3000:]
    assert "Quorum status" in lighthouse_log.read_text()
    steps = [line for line in console.splitlines() if "| loss " in line]
    assert sorted(line.split(" | ")[0] for line in steps) == [
        f"[group {g}] step {s}" for g in (0, 1) for s in (2, 4)
    ], console[-3000:]
