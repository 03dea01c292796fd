"""Checkpoints: exact resume, resharding, atomicity, keep policy, full disk, SIGTERM, model loading."""

import json
import math
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

import fms_fsdp.train.step
from fms_fsdp.checkpoint.export import export_checkpoint
from fms_fsdp.checkpoint.layout import complete_checkpoints
from fms_fsdp.checkpoint.policy import KeepPolicy
from fms_fsdp.checkpoint.save import CheckpointSaver, write_failure
from fms_fsdp.errors import CheckpointError, ConfigError
from fms_fsdp.ledger import ledger
from fms_fsdp.weights.reader import model_reader, read_model

from conftest import ROOT, STEPS, flags, inspect_data, launch, resume_from, run_here, train_here
from held_at import wait_held

pytestmark = pytest.mark.torch_api  # also run on the oldest and newest torch (scripts/test_torch.sh)


def run(args: list[str], nproc=2, ok=True) -> subprocess.CompletedProcess:
    proc = launch("main_training.py", args, nproc)
    if ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def losses(out: Path) -> dict[int, float]:
    """step -> loss; a step logged twice (before a kill and after the resume) keeps its last value."""
    return {
        r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r
    }  # not the eval records


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return read_model(folder)


def start(args: list[str], nproc=2, held: Optional[tuple[Path, str]] = None) -> subprocess.Popen:
    """main_training.py under torchrun; `held`: (folder, point), its ranks held there (tests/held_at.py)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    hold = [str(ROOT / "tests" / "held_at.py"), str(held[0]), held[1]] if held else []
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *hold,
        str(ROOT / "main_training.py"),
        *args,
    ]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def process_children() -> dict[int, list[int]]:
    """Every process's children now, by parent pid (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return children


def kill_tree(pid: int, sig: signal.Signals) -> None:
    """Signal a process and all its descendants (torchrun's workers run in sessions of their own)."""
    children = process_children()
    todo = [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def test_killed_and_resumed_run_equals_the_uninterrupted_one(data, uninterrupted, tmp_path):
    out, held = tmp_path / "run", tmp_path / "held"
    proc = start(flags(data, out, "--checkpoint_interval=6"), held=(held, "step:7"))
    wait_held(held, 2, [proc])  # both ranks before step 7: step 6 is saved and committed, its record written
    kill_tree(proc.pid, signal.SIGKILL)  # a hard stop of every process, six steps before the next checkpoint
    proc.wait()
    assert max(losses(out)) == 6
    assert [s for s, _ in complete_checkpoints(out / "checkpoints")] == [6]
    proc = run(flags(data, out, "--checkpoint_interval=6"))  # the same command resumes
    assert "step_6_ckp at step 6" in proc.stdout
    ref, got = losses(uninterrupted), losses(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert all(got[s] == ref[s] for s in ref), (ref, got)
    a, b = weights(uninterrupted / "checkpoints" / "step_12_ckp"), weights(out / "checkpoints" / "step_12_ckp")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the ledgers (fms-inspect-data --ledger) of the two runs' last checkpoints: the same documents, tokens alike
    (x, _), (y, _) = (ledger(str(run / "checkpoints" / "step_12_ckp")) for run in (uninterrupted, out))
    assert [d.name for d in x] == [d.name for d in y] == ["code", "web"]
    assert all(np.array_equal(p.seen, q.seen) and np.array_equal(p.tokens, q.tokens) for p, q in zip(x, y))


@pytest.mark.pinned_torch  # the resume checked on every torch by test_killed_and_resumed_run_equals_the_uninterrupted_one
@pytest.mark.slow  # the SIGKILL case above stays in the default tier
def test_a_run_stopped_by_sigterm_resumes_to_the_ledger_of_the_uninterrupted_one(data, uninterrupted, tmp_path):
    """SIGTERM to both ranks while they wait before step 4 (a preemption): at the ranks' next agreement (a few
    seconds on) they save and stop; the same command resumes there. Its losses, and the ledger of its last
    checkpoint (which documents, how many of their tokens), are those of the run never stopped: no document
    read twice, none skipped."""
    out, held = tmp_path / "run", tmp_path / "held"
    proc = start(flags(data, out, "--checkpoint_interval=6"), held=(held, "step:4"))
    wait_held(held, 2, [proc])
    for rank in (0, 1):
        os.kill(int((held / f"held-{rank}").read_text()), signal.SIGTERM)
    wait_held(held, 2, [proc], files="signalled-*")  # taken while held
    (held / "release").touch()
    stopped, _ = proc.communicate(timeout=120)
    found = re.search(r"stopping after step (\d+) on SIGTERM: the checkpoint is saved", stopped)
    assert proc.returncode == 0 and found, stopped[-3000:]
    at = int(found.group(1))
    assert 4 <= at < STEPS and at in [s for s, _ in complete_checkpoints(out / "checkpoints")], stopped[-3000:]
    resumed = run(flags(data, out, "--checkpoint_interval=6"))
    assert f"step_{at}_ckp at step {at}" in resumed.stdout
    ref, got = losses(uninterrupted), losses(out)
    assert sorted(got) == list(range(1, STEPS + 1)) and all(got[s] == ref[s] for s in ref), (ref, got)
    (x, _), (y, _) = (ledger(str(run / "checkpoints" / "step_12_ckp")) for run in (uninterrupted, out))
    assert [d.name for d in x] == [d.name for d in y] == ["code", "web"]
    for p, q in zip(x, y):
        assert np.array_equal(p.seen, q.seen) and np.array_equal(p.tokens, q.tokens), p.name


# 2 -> 1 rank resumes and trains on (2 -> 4 ranks: tests/test_meshes.py, in its 4-rank launch;
# training on from a rescaled loader state is this launch again, and the rescale is tests/test_data.py's)
def test_resume_on_another_world_size_and_strategy(data, uninterrupted, tmp_path):
    out = resume_from(uninterrupted, 6, tmp_path / "run")
    output = run_here(flags(data, out, *RESUME_EXPORT, "--sharding_strategy=fsdp"))
    assert "resumed from" in output and "nothing to train: the checkpoint is at step 6" in output
    assert_exported_step_6(uninterrupted, out)
    # and training goes on from there, the data position rescaled to the new world size
    run_here(flags(data, out, "--num_steps=8", "--sharding_strategy=fsdp"))
    assert sorted(losses(out)) == [7, 8]


RESUME_EXPORT = ["--num_steps=6", "--export_model_at_end=True"]  # resume step 6, train nothing, export


def assert_exported_step_6(uninterrupted: Path, out: Path) -> None:
    """`out`'s export at the end is the uninterrupted run's checkpoint of step 6, tensor for tensor."""
    exported = load_file(str(out / "model_step_6.safetensors"))
    saved = weights(uninterrupted / "checkpoints" / "step_6_ckp")
    assert exported.keys() == saved.keys()
    assert not [k for k in saved if not torch.equal(exported[k], saved[k])]


def test_an_unfinished_or_unreadable_newest_checkpoint_is_not_resumed(data, uninterrupted, tmp_path):
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    shutil.copytree(uninterrupted / "checkpoints", ckpts)
    # a save killed midway: its temporary folder, and a step folder without the completion marker
    shutil.copytree(ckpts / "step_12_ckp", ckpts / ".step_18_ckp.tmp")
    shutil.copytree(ckpts / "step_12_ckp", ckpts / "step_15_ckp")
    (ckpts / "step_15_ckp" / "COMPLETE").unlink()
    # the newest complete one is unreadable (a shard truncated after the fact)
    shard = next((ckpts / "step_12_ckp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    proc = run(flags(data, out, "--num_steps=7", "--checkpoint_interval=100"))
    assert "cannot resume from" in proc.stdout and "step_6_ckp at step 6" in proc.stdout
    assert sorted(losses(out)) == [7]
    assert not (ckpts / ".step_18_ckp.tmp").exists()  # cleaned at the next save


def test_the_best_checkpoints_by_the_monitored_metric_are_kept_too():
    policy = KeepPolicy.parse(1, "", best=2, monitor="eval_loss")
    assert policy.to_delete([2, 4, 6, 8, 10], {2: 3.0, 4: 2.5, 6: 2.7, 8: 2.9}) == [2, 8]  # 10 latest, 4 and 6 best
    assert policy.to_delete([2, 4, 6], {}) == [2, 4]  # nothing measured: nothing ranked
    higher = KeepPolicy.parse(1, "", best=1, monitor="eval_accuracy")  # higher is better but for losses and ppl
    assert higher.to_delete([2, 4, 6], {2: 0.3, 4: 0.5, 6: 0.1}) == [2]


def test_keep_best_ranks_checkpoints_by_their_evaluation_across_a_resume(data, tmp_path):
    """Learning rate 0: every evaluation is the same, so the earliest checkpoint is the best (a tie goes
    to the earlier step); the resumed run ranks by the evaluations before it too (metrics.jsonl)."""
    out = tmp_path / "run"
    best = ["--checkpoint_interval=2", "--checkpoint_keep=1", "--checkpoint_keep_best=1", "--learning_rate=0"]
    evals = [f"--eval_data_path={data}", "--eval_interval=2", "--eval_batches=1"]
    run_here(flags(data, out, "--num_steps=4", *best, *evals))
    assert [s for s, _ in complete_checkpoints(out / "checkpoints")] == [2, 4]
    run_here(flags(data, out, "--num_steps=6", *best, *evals))
    scores = [
        r["eval_loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "eval_loss" in r
    ]
    assert len(scores) == 3 and len(set(scores)) == 1
    assert [s for s, _ in complete_checkpoints(out / "checkpoints")] == [2, 6]


def test_max_run_minutes_ends_the_run_with_a_checkpoint_that_resumes(tmp_path):
    out = tmp_path / "run"
    limit = ["--num_steps=100000", "--checkpoint_interval=100000", "--max_run_minutes=0.04"]  # 2.4 s
    log = run_here([*limit, f"--ckpt_save_path={out}"])
    stopped = re.search(r"stopping after step (\d+) on --max_run_minutes=0.04: the checkpoint is saved", log)
    assert stopped, log[-2000:]
    step = int(stopped.group(1))
    assert 1 <= step < 100000 and [s for s, _ in complete_checkpoints(out / "checkpoints")] == [step]
    again = run_here([f"--num_steps={step + 2}", f"--ckpt_save_path={out}"])
    assert f"at step {step}" in again and sorted(losses(out))[-2:] == [step + 1, step + 2]


def test_keep_policy():
    policy = KeepPolicy.parse(2, "every 9 until 18, then every 15")
    assert [s for s in range(1, 61) if policy.permanent(s)] == [9, 18, 30, 45, 60]
    assert policy.to_delete([3, 6, 9, 12, 15, 18, 21]) == [3, 6, 12, 15]
    assert KeepPolicy.parse(1, "").to_delete([5]) == []
    with pytest.raises(ConfigError, match="--checkpoint_keep_policy: cannot read 'each 10'"):
        KeepPolicy.parse(2, "each 10")


def test_keep_policy_over_12_steps(tmp_path):
    out = tmp_path / "run"
    run_here(
        [
            "--num_steps=12",
            "--checkpoint_interval=2",
            "--checkpoint_keep=2",
            "--report_interval=6",
            "--checkpoint_keep_policy=every 4 until 8, then every 6",
            f"--ckpt_save_path={out}",
        ]
    )
    assert [p.name for _, p in complete_checkpoints(out / "checkpoints")] == [
        "step_4_ckp",
        "step_8_ckp",
        "step_10_ckp",
        "step_12_ckp",
    ]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step_10_ckp",
        "step_12_ckp",
        "step_4_ckp",
        "step_8_ckp",
    ]


@pytest.fixture
def small_disk(tmp_path):
    """A real 24 MB filesystem (tmpfs)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)])


def test_on_checkpoint_error_warn_skips_write_failures_only(small_disk, tmp_path, monkeypatch):
    """Real DCP failures: a full disk is a write failure; an object that cannot be pickled (a bug)
    is not, and stops even a --on_checkpoint_error=warn run."""
    with pytest.raises(dcp.CheckpointException) as full:
        dcp.save({"w": torch.zeros(8 * 2**20)}, checkpoint_id=str(small_disk / "big"), no_dist=True)  # 32 MiB
    assert write_failure(full.value)
    with pytest.raises(dcp.CheckpointException) as bug:
        dcp.save({"f": lambda: 0}, checkpoint_id=str(tmp_path / "bug"), no_dist=True)
    assert not write_failure(bug.value)
    own_state = CheckpointSaver.own_state
    monkeypatch.setattr(CheckpointSaver, "own_state", lambda self: {**own_state(self), "bug": lambda: 0})
    out = tmp_path / "run"
    with pytest.raises(CheckpointError, match="checkpoint save to .* failed: .*Error: .*pickle") as e:
        run_here(["--num_steps=2", "--checkpoint_interval=1", f"--ckpt_save_path={out}", "--on_checkpoint_error=warn"])
    assert "\n" not in str(e.value)
    assert not list((out / "checkpoints").iterdir())  # the unfinished save is removed


@pytest.mark.slow  # 12 s: three short runs, one of two ranks
def test_model_initialised_from_files_and_folders(data, uninterrupted, tmp_path):
    """A checkpoint folder and a .pth file on one rank; a .safetensors file on two, each rank reading only
    its shards' rows of it; a file of another model is one error naming the tensor that does not fit."""
    src = uninterrupted / "checkpoints" / "step_12_ckp"
    reference = weights(src)
    assert "tensors" in export_checkpoint(str(src), str(tmp_path / "m.safetensors"))
    torch.save({"model_state": reference}, tmp_path / "m.pth")
    for path in (src, tmp_path / "m.safetensors", tmp_path / "m.pth"):
        out = tmp_path / f"from_{path.name}"
        # learning rate 0: one step leaves the loaded weights as they are, to compare exactly
        args = flags(data, out, f"--ckpt_load_path={path}", "--num_steps=1", "--learning_rate=0")
        if path.suffix == ".safetensors":
            run([*args, "--export_model_at_end=True"])
        else:
            run_here([*args, "--export_model_at_end=True"])
        got = load_file(str(out / "model_step_1.safetensors"))
        assert all(torch.equal(got[k], reference[k]) for k in reference), path
    with pytest.raises(CheckpointError) as other:
        run_here([*args, "--vocab_size=2048", f"--ckpt_save_path={tmp_path / 'other'}"])
    assert str(other.value) == (
        f"--ckpt_load_path: {path} does not fit --model_variant=tiny (vocab 2048): base_model.embedding.weight "
        "is [1024, 256] there, the model's base_model.embedding.weight [2048, 256]"
    )


@pytest.mark.slow  # 12 s: a run with background saves and exports
def test_async_checkpoints_and_exports_hold_the_state_of_their_step(data, uninterrupted, tmp_path):
    """Training goes on while the files are written; what is written is the state at the save. So
    for periodic exports, written the same way (2 ranks' shards, then rank 0's file)."""
    out = tmp_path / "run"
    proc = run(
        flags(data, out, "--checkpoint_interval=6", "--async_checkpoint=True", "--export_interval=4", "--export_keep=1")
    )
    assert proc.stdout.count("checkpoint: saved") == 2
    for step in (6, 12):
        a = weights(uninterrupted / "checkpoints" / f"step_{step}_ckp")
        b = weights(out / "checkpoints" / f"step_{step}_ckp")
        assert all(torch.equal(a[k], b[k]) for k in a), step
    assert [p.name for p in (out / "exports").iterdir()] == ["step_12"]
    exported = load_file(str(out / "exports" / "step_12" / "model.safetensors"))
    assert exported.keys() == a.keys() and all(torch.equal(a[k], exported[k]) for k in a)
    assert all(
        "checkpoint_stall_s" in r
        for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        if r["step"] in (6, 12)
    )


def test_a_model_file_is_read_by_rows_in_every_format(tmp_path):
    """weights/reader.model_reader: rows of a .safetensors file and of a .pth file, in torch's zip
    format (memory-mapped) and its legacy one (read whole), are the tensor's rows."""
    state = {"w": torch.arange(12.0).view(4, 3), "b": torch.arange(5.0).bfloat16()}
    save_file(state, str(tmp_path / "m.safetensors"))
    torch.save({"model_state": state}, tmp_path / "zip.pth")
    torch.save(state, tmp_path / "legacy.pth", _use_new_zipfile_serialization=False)
    for name in ("m.safetensors", "zip.pth", "legacy.pth"):
        tensors = model_reader(tmp_path / name)
        assert {k: tuple(v) for k, v in tensors.shapes.items()} == {"w": (4, 3), "b": (5,)}, name
        assert torch.equal(tensors.rows("w", 1, 3), state["w"][1:3]), name
        assert torch.equal(tensors.rows("b", 2, 5), state["b"][2:5]), name


def test_reading_a_checkpoint_never_runs_code_from_it(uninterrupted, tmp_path):
    evil = tmp_path / "evil_ckp"
    shutil.copytree(uninterrupted / "checkpoints" / "step_6_ckp", evil)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    (evil / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(pickle.UnpicklingError, match="refusing posix.system"):
        read_model(evil)

    class Sneaky:  # getattr is admitted for enum members only, not to walk to a function's globals
        def __reduce__(self):
            from torch.distributed.checkpoint.metadata import Metadata

            return getattr, (Metadata, "__init__")

    (evil / ".metadata").write_bytes(pickle.dumps(Sneaky()))
    with pytest.raises(pickle.UnpicklingError, match="refusing getattr"):
        read_model(evil)
    assert not marker.exists()
    assert weights(uninterrupted / "checkpoints" / "step_6_ckp")  # real metadata still reads


def test_a_checkpoint_resumes_under_any_activation_checkpointing(tmp_path):
    """Saved with per-op checkpointing of every block, resumed with whole-block checkpointing of half of
    them, then with every block's activations offloaded, then with none: the steps equal those of a run
    that never checkpointed activations."""
    base = ["--checkpoint_interval=2", "--batch_size=2", "--lr_schedule=constant"]  # the same LR at any --num_steps
    reference = train_here(tmp_path / "ref", [*base, "--num_steps=8"])
    out = tmp_path / "run"
    for step, ac in (
        (2, ["--fsdp_activation_checkpointing=True", "--ac_mode=op"]),
        (4, ["--fsdp_activation_checkpointing=True", "--selective_checkpointing=1/2"]),
        (6, ["--fsdp_activation_checkpointing=True", "--ac_mode=offload"]),
        (8, []),
    ):
        run_here([*base, f"--num_steps={step}", f"--ckpt_save_path={out}", *ac])
    resumed = losses(out)
    assert sorted(resumed) == list(range(1, 9))
    assert all(resumed[r["step"]] == pytest.approx(r["loss"], rel=1e-5) for r in reference)


def test_time_based_saves(tmp_path):
    out = tmp_path / "run"
    run_here(
        [
            "--num_steps=3",
            "--checkpoint_interval=100",
            "--checkpoint_minutes=0",
            "--checkpoint_keep=5",
            f"--ckpt_save_path={out}",
        ]
    )
    assert [s for s, _ in complete_checkpoints(out / "checkpoints")] == [1, 2, 3]


def auto_intervals(output: str) -> list[tuple[float, float]]:
    """(seconds between saves, save stall in seconds) that --checkpoint_interval=auto logged, in order."""
    pattern = r"checkpoint interval \(auto\): ([\d.e+-]+) s = sqrt\(2 x ([\d.e+-]+) s save stall"
    return [(float(every), float(stall)) for every, stall in re.findall(pattern, output)]


def test_auto_checkpoint_interval_follows_the_measured_save_stall(tmp_path, monkeypatch):
    """Young's interval sqrt(2 x stall x MTBF): it starts from an assumed 30 s stall, moves to the
    measured one, and a slower save (an artificial 0.5 s stall) gives a longer interval. Only the
    slow run's stall has a floor (the sleep): a plain save's stall on a loaded machine is noise."""
    mtbf_h, sleep = 1e-7, 0.5
    args = [
        "--num_steps=8",
        "--checkpoint_interval=auto",
        f"--expected_hours_between_failures={mtbf_h}",
        "--checkpoint_keep=1",
        "--report_interval=8",
    ]
    fast = auto_intervals(run_here([*args, f"--ckpt_save_path={tmp_path / 'fast'}"]))
    write_run_state = CheckpointSaver._write_run_state

    def slow_write(self, *args):
        time.sleep(sleep)
        write_run_state(self, *args)

    monkeypatch.setattr(CheckpointSaver, "_write_run_state", slow_write)
    slow = auto_intervals(run_here([*args, f"--ckpt_save_path={tmp_path / 'slow'}"]))

    def young(stall: float) -> float:
        return math.sqrt(2 * stall * mtbf_h * 3600)

    assert fast[0] == slow[0] == (pytest.approx(young(30), rel=1e-2), 30)
    assert len(fast) >= 2 and len(slow) >= 2, (fast, slow)
    for every, stall in fast + slow:
        assert every == pytest.approx(young(stall), rel=2e-2)  # the interval follows the stall it logs
    assert all(stall < 30 for _, stall in fast[1:] + slow[1:])  # measured, not the assumed 30 s
    assert all(stall >= sleep for _, stall in slow[1:])  # the slow saves' stall holds the sleep


def descendants(pid: int) -> list[int]:
    """Every process below `pid`."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            children.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
        except OSError:
            continue
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for a parent that is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.pinned_torch  # the package's own parent watch (fms_fsdp/lifetime.py)
@pytest.mark.slow  # 18 s: kills a launcher and a rank mid-run
def test_nothing_outlives_a_killed_launcher_or_rank(data, tmp_path):
    """kill -9 of torchrun: its ranks get a signal from the kernel and stop as on a preemption (save),
    then fail in one line; their loader workers get SIGKILL once the ranks are gone; the same command
    resumes.
    kill -9 of one rank: the other loses its peer in a collective and ends with one line, its loader
    workers shut down on the way out (at exit they would wait forever: they leave SIGTERM to the rank)."""
    out = tmp_path / "run"
    args = flags(data, out, "--num_steps=400", "--checkpoint_interval=1000", "--num_workers=2")
    proc = start(args)
    deadline = time.time() + 240
    while not (out / "metrics.jsonl").exists() or not losses(out):  # training: the loader workers are up
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.05)
    tree = descendants(proc.pid)
    assert len(tree) >= 6, tree  # 2 ranks, 2 loader workers each
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 15
    while any(alive(p) for p in tree) and time.time() < deadline:
        time.sleep(0.2)
    assert not [p for p in tree if alive(p)], "processes of the run outlived its launcher"
    output = proc.stdout.read()  # the ranks wrote to the launcher's pipe
    assert "error: stopped after step " in output, output[-3000:]
    assert "the launcher (torchrun) of a rank died; the checkpoint is saved" in output
    ((step, _),) = complete_checkpoints(out / "checkpoints")
    assert 1 <= step < 400
    # the same command resumes; kill -9 one of its ranks: the other stops in one line, nothing is left
    proc = start(args)
    deadline = time.time() + 120
    while max(losses(out)) <= step + 1:
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.05)
    tree = descendants(proc.pid)
    os.kill(
        max(p for p in tree if Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1] == str(proc.pid)),
        signal.SIGKILL,
    )  # rank 1: the later of torchrun's two children
    deadline = time.time() + 15
    while (proc.poll() is None or any(alive(p) for p in tree)) and time.time() < deadline:
        time.sleep(0.2)
    assert proc.poll() not in (None, 0) and not [p for p in tree if alive(p)], "processes outlived a killed rank"
    output = proc.stdout.read()
    assert f"at step {step}" in output
    assert "error: lost contact with another rank (" in output and "run the same command again" in output, output[
        -3000:
    ]


def test_an_unexpected_error_stops_the_loader_workers_at_once(data, tmp_path, monkeypatch):
    """A bug raised mid-run: the loader workers are shut down before the error leaves training, while
    its traceback is still held (an uncaught error keeps it until exit, where workers that leave
    SIGTERM to their rank would hold the process forever)."""

    def broken(*args):
        raise ValueError("a bug")

    monkeypatch.setattr(fms_fsdp.train.step, "clip_gradients", broken)
    before = set(descendants(os.getpid()))  # an earlier test's forkserver and resource tracker stay
    with pytest.raises(ValueError, match="a bug") as error:
        run_here(flags(data, tmp_path / "run", "--num_workers=2"))
    assert error.traceback  # still held here
    left = [p for p in descendants(os.getpid()) if p not in before and alive(p)]
    assert not left, [Path(f"/proc/{p}/cmdline").read_bytes() for p in left]


@pytest.mark.pinned_torch  # the package's own command over checkpoints that other tests resume
@pytest.mark.slow  # 12 s: the ledger command four times
def test_the_command_reports_compares_and_lists_a_runs_checkpoints(uninterrupted, data):
    """The two-rank run on `data` (12 steps of 2 x 4 lines of 129 tokens, checkpoints at 6 and 12)."""
    six, twelve = (str(uninterrupted / "checkpoints" / f"step_{n}_ckp") for n in (6, 12))
    proc = inspect_data(f"--ledger={twelve}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == f"ledger of {twelve} (step 12): the data positions of 2 of 2 data-parallel ranks"
    framed = [int(line.split("; ")[1].split(" tokens")[0].replace(",", "")) for line in lines[1:]]
    assert sum(framed) == 12 * 2 * 4 * 129, lines
    web = next(line for line in lines if line.startswith("web:"))  # in its first epoch (code, weighted 2: its third)
    assert ": 400 documents: " in web and " 0 twice, 0 more often, " in web, lines
    proc = inspect_data(f"--ledger={six}", f"--compare={twelve}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(", 0 only in the first, " in line for line in proc.stdout.splitlines()[2:]), proc.stdout
    proc = inspect_data(f"--ledger={six}", "--list_documents=True", f"--data_path={data}")
    listed = [line.split() for line in proc.stdout.splitlines()[4:]]
    assert {name for name, *_ in listed} == {"web", "code"}, listed[:5]
    assert all(
        where.startswith(f"{name}/") and int(times) >= 1 and int(tokens) >= 1 for name, where, times, tokens in listed
    )
    assert all(times == "1" for name, _, times, _ in listed if name == "web")
