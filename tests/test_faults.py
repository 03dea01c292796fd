"""The fault matrix: every way a run or a command can meet bad input or a failing disk, driven for real
(installed commands, real ranks, real tmpfs mounts gone full or read-only, real signals), each asserting
the one line it ends in (or the warning it goes on with), its exit status, and that every checkpoint
that was there before is byte-identical after. docs/troubleshooting.md's table is generated from FAULTS
(scripts/gen_docs.py), so the docs say what the tests saw.

A case's line is a template: `{name}` stands for a value the case knows (a path: matched exactly) or,
when it gives none, for any text (an errno's wording). Cases run a few at a time.
"""

from __future__ import annotations

import hashlib
import importlib
import itertools
import json
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
from test_commands import BIN, COMMANDS

from conftest import ROOT, TINY, flags

pytestmark = pytest.mark.torch_api  # also run on the oldest and newest torch (scripts/test_torch.sh)

DUMMY = [*TINY, "--num_steps=4"]  # a run on synthetic data
LONG = [*TINY, "--num_steps=60", "--checkpoint_interval=2", "--checkpoint_keep=100"]  # stopped before its end


@dataclass
class Job:
    """One launch: a command (a console script) and its flags, on `nproc` ranks (None: one plain
    process; with torchrun=True under torchrun), and what happens to it while it runs."""

    argv: list[str]
    nproc: Optional[int] = None
    env: dict[str, str] = field(default_factory=dict)
    torchrun: bool = False
    during: Optional[Callable[[list["Proc"]], bool]] = None  # polled until it returns True
    held: Optional[tuple[Path, str]] = None  # (folder, point): its processes held there (tests/held_at.py)
    values: dict[str, str] = field(default_factory=dict)  # the template's known values
    keep: list[Path] = field(default_factory=list)  # folders whose files must be byte-identical after
    prelude: Optional["Job"] = None  # run (to its end, any status) before this one
    after: Optional[Callable[[], None]] = None  # more assertions once it ended
    cleanup: Optional[Callable[[], None]] = None


@dataclass(frozen=True)
class Fault:
    what: str  # the fault, as docs/troubleshooting.md lists it
    says: str  # the line: on stderr, the only one, when status != 0; a line of stdout otherwise
    status: int
    make: Callable[["Bench"], Job]


FAULTS: list[Fault] = []


def fault(what: str, says: str, status: int) -> Callable[[Callable[["Bench"], Job]], Callable[["Bench"], Job]]:
    def register(make: Callable[[Bench], Job]) -> Callable[[Bench], Job]:
        FAULTS.append(Fault(what, says, status, make))
        return make

    return register


@dataclass
class Bench:
    """A case's own folder, the shared data and a finished two-rank run to copy checkpoints from."""

    tmp: Path
    data: Path
    source: Path  # the run folder of `uninterrupted`: checkpoints of steps 6 and 12

    @property
    def good(self) -> Path:
        return self.source / "checkpoints" / "step_12_ckp"

    def run_with_checkpoints(self, name: str = "run") -> Path:
        out = self.tmp / name
        shutil.copytree(self.source / "checkpoints", out / "checkpoints")
        return out

    def damaged(self, keep_fraction: float = 0.25, name: str = "damaged") -> Path:
        """A copy of the step-12 checkpoint whose shards lost the rest after `keep_fraction`."""
        folder = self.tmp / name / "step_12_ckp"
        shutil.copytree(self.good, folder)
        for shard in folder.glob("*.distcp"):
            shard.write_bytes(shard.read_bytes()[: int(shard.stat().st_size * keep_fraction)])
        return folder

    def mount(self, name: str, size: str) -> Path:
        """A real filesystem of `size` (tmpfs), unmounted by the case's cleanup."""
        mount = self.tmp / name
        mount.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True)
        if proc.returncode != 0:  # an error, not pytest.skip: the cases run in threads whose handler catches Exception
            raise MountError(f"cannot mount a tmpfs at {mount}: {proc.stderr.decode().strip()}")
        return mount


class MountError(Exception):
    """A case's tmpfs could not be mounted (test_every_fault... checks once, before the cases, that one can)."""


def can_mount_tmpfs(folder: Path) -> Optional[str]:
    """None where a tmpfs can be mounted here (root), else why not."""
    folder.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        return f"cannot mount a tmpfs here (needs root): {proc.stderr.strip()}"
    subprocess.run(["umount", str(folder)], check=True)
    return None


def chosen_faults() -> list[int]:
    """The cases FMS_FAULTS=<text> picks (every case without it); a text that picks none is an error."""
    wanted = os.environ.get("FMS_FAULTS", "")
    chosen = [k for k, f in enumerate(FAULTS) if wanted in f.what]
    if not chosen:
        raise pytest.UsageError(f"FMS_FAULTS={wanted!r} matches none of the {len(FAULTS)} fault cases' names")
    return chosen


def when_held(
    folder: Path, processes: int, act: Callable[[list["Proc"]], Any], signalled: int = 0
) -> Callable[[list["Proc"]], bool]:
    """Once `processes` processes wait at their point (a Job's `held`), act on them; once `signalled` of
    them took a stop signal there (tests/held_at.py), let them go on."""
    acted = False

    def poll(procs: list[Proc]) -> bool:
        nonlocal acted
        if not acted:
            if len(list(folder.glob("held-*"))) < processes:
                return False
            act(procs)
            acted = True
        if len(list(folder.glob("signalled-*"))) < signalled:
            return False
        (folder / "release").touch()
        return True

    return poll


def signal_all(sig: signal.Signals) -> Callable[[list["Proc"]], None]:
    return lambda procs: [p.send_signal(sig) for p in procs]


def unmount(mount: Path) -> Callable[[], None]:
    return lambda: subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def owner_record(folder: Path, **fields: object) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    now = time.time()
    record = {"host": socket.gethostname(), "pid": os.getpid(), "job": "", "started": now - 60, "heartbeat": now}
    (folder / "owner.json").write_text(json.dumps({**record, "token": "0" * 32, **fields}))


# ------------------------------------------------------------------------------- flags and files


@fault("a misspelt flag", "error: unknown flag --lerning_rate; did you mean --learning_rate?", 2)
def _typo(b: Bench) -> Job:
    return Job(["fms-train", "--lerning_rate=1"])


@fault("--config names a folder", "error: --config: {config} is a folder, not a config file", 2)
def _config_folder(b: Bench) -> Job:
    (b.tmp / "configs").mkdir()
    return Job(["fms-train", f"--config={b.tmp / 'configs'}"], values={"config": str(b.tmp / "configs")})


@fault("--config holds bytes that are not UTF-8", "error: --config: cannot parse {config}: 'utf-8' codec {why}", 2)
def _config_bytes(b: Bench) -> Job:
    config = b.tmp / "run.yaml"
    config.write_bytes(b"model_variant: tiny\nlearning_rate: \xff\xfe\n")
    return Job(["fms-train", f"--config={config}"], values={"config": str(config)})


@fault(
    "--tokenizer_path is a folder without tokenizer.json",
    "error: --tokenizer_path={tok}: no tokenizer.json there (give a Hugging Face tokenizer folder or file)",
    2,
)
def _tokenizer_folder(b: Bench) -> Job:
    (b.tmp / "tok").mkdir()
    (b.tmp / "tok" / "vocab.txt").write_text("a\n")
    return Job(
        ["fms-train", *DUMMY, f"--tokenizer_path={b.tmp / 'tok'}", f"--ckpt_save_path={b.tmp / 'run'}"],
        values={"tok": str(b.tmp / "tok")},
    )


@fault("--data_path names a file", "error: --data_path: {path} is a file, not a folder of datasets", 2)
def _data_file(b: Bench) -> Job:
    path = next(b.data.rglob("*.arrow"))
    return Job(["fms-train", *flags(path, b.tmp / "run")], values={"path": str(path)})


@fault("--eval_data_path does not exist", "error: --eval_data_path: folder not found: {path}", 2)
def _eval_missing(b: Bench) -> Job:
    path = b.tmp / "missing"
    return Job(
        [
            "fms-evaluate",
            *DUMMY,
            f"--ckpt_load_path={b.good}",
            "--vocab_size=1024",
            f"--eval_data_path={path}",
            f"--ckpt_save_path={b.tmp / 'eval'}",
        ],
        values={"path": str(path)},
    )


@fault("--ckpt_save_path names a file", "error: --ckpt_save_path: {path} is a file, not a folder", 2)
def _save_file(b: Bench) -> Job:
    path = b.tmp / "run.txt"
    path.write_text("notes\n")
    return Job(["fms-train", *DUMMY, f"--ckpt_save_path={path}"], values={"path": str(path)})


@fault("--ckpt_save_path on a read-only disk", "error: --ckpt_save_path: cannot write {path} (OSError: {why})", 2)
def _save_read_only(b: Bench) -> Job:
    mount = b.mount("ro", "1m")
    subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
    return Job(
        ["fms-train", *DUMMY, f"--ckpt_save_path={mount / 'run'}"],
        values={"path": str(mount / "run")},
        cleanup=unmount(mount),
    )


@fault(
    "metrics.jsonl cannot be appended to",
    "error: --ckpt_save_path: cannot append to {path} (IsADirectoryError: {why})",
    2,
)
def _metrics_folder(b: Bench) -> Job:
    out = b.run_with_checkpoints()
    (out / "metrics.jsonl").mkdir()
    return Job(
        ["fms-train", *flags(b.data, out, "--num_steps=13")],
        values={"path": str(out / "metrics.jsonl")},
        keep=[out / "checkpoints"],
    )


@fault("--ckpt_load_path does not exist", "error: --ckpt_load_path: {path} does not exist", 2)
def _load_missing(b: Bench) -> Job:
    path = b.tmp / "nothing"
    return _loading(b, path, synthetic=True, after=lambda: _nothing_written(b.tmp / "run"))


def _nothing_written(out: Path) -> None:
    assert not out.exists() or not any(out.iterdir()), sorted(out.iterdir())


def _loading(b: Bench, path: Path, *extra: str, synthetic: bool = False, **job: Any) -> Job:
    """fms-train from --ckpt_load_path=`path` into b.tmp/run, on the shared data (or synthetic data),
    with the template's {path}; `job`: the rest of the Job."""
    out = b.tmp / "run"
    load = f"--ckpt_load_path={path}"
    run = [*DUMMY, load, f"--ckpt_save_path={out}", *extra] if synthetic else flags(b.data, out, load, *extra)
    return Job(["fms-train", *run], values={"path": str(path)}, **job)


@fault(
    "--ckpt_load_path is a file of another kind",
    "error: --ckpt_load_path: {path} is not a model file (.safetensors, .pth, .pt), a checkpoint folder or a "
    "Hugging Face folder",
    2,
)
def _load_text(b: Bench) -> Job:
    path = b.tmp / "weights.txt"
    path.write_text("0.1 0.2\n")
    return _loading(b, path, synthetic=True)


@fault(
    "--ckpt_load_path is a run folder",
    "error: --ckpt_load_path: {path} is a run folder: give one of its checkpoints, {path}/checkpoints/step_<N>_ckp, "
    "or one of its exports",
    2,
)
def _load_run_folder(b: Bench) -> Job:
    return _loading(b, b.source)


@fault(
    "--ckpt_load_path is an empty folder",
    "error: --ckpt_load_path: {path} is neither a checkpoint folder (no .metadata) nor a Hugging Face folder "
    "(no config.json)",
    2,
)
def _load_empty_folder(b: Bench) -> Job:
    (b.tmp / "empty").mkdir()
    return _loading(b, b.tmp / "empty", synthetic=True)


@fault("--ckpt_load_path is a zero-byte .safetensors", "error: --ckpt_load_path: {path} is empty (0 bytes)", 2)
def _load_zero_safetensors(b: Bench) -> Job:
    path = b.tmp / "model.safetensors"
    path.write_bytes(b"")
    return _loading(b, path, synthetic=True)


@fault(
    "--tokenizer_path is a file that is not a tokenizer",
    "error: --tokenizer_path: cannot load {path} ({why})",
    2,
)
def _tokenizer_file(b: Bench) -> Job:
    path = b.tmp / "tokenizer.json"
    path.write_text("not json\n")
    return Job(
        ["fms-train", *DUMMY, f"--tokenizer_path={path}", f"--ckpt_save_path={b.tmp / 'run'}"],
        values={"path": str(path)},
    )


@fault("--eval_data_path names a file", "error: --eval_data_path: {path} is a file, not a folder of datasets", 2)
def _eval_file(b: Bench) -> Job:
    path = next(b.data.rglob("*.arrow"))
    return Job(
        ["fms-train", *flags(b.data, b.tmp / "run", f"--eval_data_path={path}", "--eval_interval=2")],
        values={"path": str(path)},
    )


# ------------------------------------------------------------------------------- damaged checkpoints


@fault(
    "--ckpt_load_path: a checkpoint with truncated shards",
    "error: --ckpt_load_path: {path}: {shard} is truncated ({n} of {m} bytes) (and 1 more); the checkpoint is damaged",
    1,
)
def _load_truncated(b: Bench) -> Job:
    path = b.damaged()
    return _loading(b, path, after=lambda: _absent(b.tmp / "run" / "config.yaml"))  # a failed start writes none


@fault(
    "--ckpt_load_path: a checkpoint with a zero-byte shard",
    "error: --ckpt_load_path: {path}: {shard} is truncated (0 of {m} bytes); the checkpoint is damaged",
    1,
)
def _load_zero_shard(b: Bench) -> Job:
    path = b.damaged(1.0)
    (path / "__1_0.distcp").write_bytes(b"")
    return _loading(b, path)


@fault(
    "--ckpt_load_path: a checkpoint with a zero-byte .metadata",
    "error: --ckpt_load_path: {path}: its .metadata is damaged or truncated (EOFError: Ran out of input)",
    1,
)
def _load_zero_metadata(b: Bench) -> Job:
    path = b.damaged(1.0)
    (path / ".metadata").write_bytes(b"")
    return _loading(b, path)


@fault(
    "--ckpt_load_path: a truncated .safetensors",
    "error: --ckpt_load_path: {path} is truncated ({n} of {m} bytes)",
    1,
)
def _load_truncated_safetensors(b: Bench) -> Job:
    from safetensors.torch import save_file

    from fms_fsdp.weights.reader import read_model

    path = b.tmp / "model.safetensors"
    save_file(read_model(b.good), str(path))
    path.write_bytes(path.read_bytes()[:5000])
    return _loading(b, path)


def _hf_folder(b: Bench, name: str = "hf", **changes: Any) -> Path:
    """A Hugging Face folder of `tiny` (DUMMY's vocabulary) in several files with an index; `changes` to
    its model (its config.json stays tiny's), or to its rotary scaling (rope_scaling_factor)."""
    import torch

    from fms_fsdp.model.variants import build_model, get_model_config
    from fms_fsdp.weights.hf import write_hf_config, write_hf_folder
    from fms_fsdp.weights.reader import Tensors

    factor = changes.pop("rope_scaling_factor", None)
    config = get_model_config("tiny", 256, None, 1, None, factor)
    state = build_model(config.updated(**changes), torch.device("cpu")).state_dict()
    folder = b.tmp / name
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    tensors = Tensors({k: v.shape for k, v in state.items()}, lambda key, a, b: state[key][a:b])
    write_hf_folder(config.updated(**changes), tensors, shapes, str(folder), torch.float32, None, None,
                    max_shard_bytes=2**20)  # fmt: skip
    write_hf_config(folder, config, torch.float32, None, None)
    return folder


@fault(
    "--ckpt_load_path: a Hugging Face folder missing a shard its index names",
    "error: --ckpt_load_path: {shard} is missing (named in model.safetensors.index.json)",
    1,
)
def _hf_missing_shard(b: Bench) -> Job:
    folder = _hf_folder(b)
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.unlink()
    job = _loading(b, folder, synthetic=True)
    job.values["shard"] = str(shard)
    return job


@fault(
    "--ckpt_load_path: a Hugging Face folder with a truncated .safetensors",
    "error: --ckpt_load_path: {shard} is truncated ({n} of {m} bytes)",
    1,
)
def _hf_truncated_shard(b: Bench) -> Job:
    folder = _hf_folder(b)
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    job = _loading(b, folder, synthetic=True)
    job.values["shard"] = str(shard)
    return job


@fault(
    "--ckpt_load_path: a Hugging Face folder whose tensors do not fit the variant",
    "error: --ckpt_load_path: {path}/{file}: {tensor} is {shape}, which does not fit the model's {key} {want}; "
    "choose the matching --model_variant (and --vocab_size)",
    1,
)
def _hf_other_shapes(b: Bench) -> Job:
    return _loading(b, _hf_folder(b, hidden_grow_factor=3.0), synthetic=True)


@fault(
    "--ckpt_load_path: a Hugging Face folder with other rotary settings (checked at start-up)",
    "error: --ckpt_load_path: {path}: rope_theta {theta} and rope_scaling {scaling}, but the run has rope_theta "
    "{ours} and rope_scaling None; choose the matching --model_variant (or --rope_theta, --rope_scaling_factor)",
    2,
)
def _hf_other_rope(b: Bench) -> Job:
    return _loading(b, _hf_folder(b, rope_scaling_factor=4), synthetic=True)


@fault(
    "--ckpt_load_path: a truncated .pth",
    "error: --ckpt_load_path: {path}: a file is damaged or truncated ({why})",
    1,
)
def _load_truncated_pth(b: Bench) -> Job:
    import torch

    from fms_fsdp.weights.reader import read_model

    path = b.tmp / "model.pth"
    torch.save({"model_state": read_model(b.good)}, path)
    path.write_bytes(path.read_bytes()[:5000])
    return _loading(b, path)


@fault(
    "--ckpt_load_path: a checkpoint of another model",
    "error: --ckpt_load_path: {path} does not fit --model_variant=tiny (vocab 2048): {why}",
    1,
)
def _load_other_model(b: Bench) -> Job:
    return _loading(b, b.good, "--vocab_size=2048")


@fault(
    "a checkpoint with truncated shards given to fms-export-model",
    "error: --load_path: {path}: {shard} is truncated ({n} of {m} bytes) (and 1 more); the checkpoint is damaged",
    1,
)
def _export_truncated(b: Bench) -> Job:
    path = b.damaged()
    return Job(
        ["fms-export-model", f"--load_path={path}", f"--save_path={b.tmp / 'model.safetensors'}"],
        values={"path": str(path)},
        after=lambda: _absent(b.tmp / "model.safetensors"),
    )


def _absent(path: Path) -> None:
    assert not path.exists(), path


@fault(
    "a checkpoint with truncated shards given to fms-to-hf",
    "error: --load_path: {path}: {shard} is truncated ({n} of {m} bytes) (and 1 more); the checkpoint is damaged",
    1,
)
def _hf_truncated(b: Bench) -> Job:
    path = b.damaged()
    return Job(
        ["fms-to-hf", f"--load_path={path}", f"--save_path={b.tmp / 'hf'}"],
        values={"path": str(path)},
        after=lambda: _absent(b.tmp / "hf"),
    )


@fault(
    "the newest checkpoint's metadata.pth is zero bytes: the run resumes from the one before",
    "warning: cannot resume from {newest} ({newest}/metadata.pth: {why}); trying {older}",
    0,
)
def _resume_zero_metadata(b: Bench) -> Job:
    out = b.run_with_checkpoints()
    newest = out / "checkpoints" / "step_12_ckp"
    (newest / "metadata.pth").write_bytes(b"")
    return Job(
        ["fms-train", *flags(b.data, out, "--num_steps=7", "--checkpoint_interval=100")],
        nproc=2,
        values={"newest": str(newest), "older": str(out / "checkpoints" / "step_6_ckp")},
        keep=[out / "checkpoints" / "step_6_ckp"],
        after=lambda: _present(out / "checkpoints" / "step_12_ckp.unreadable" / "COMPLETE"),
    )


def _present(path: Path) -> None:
    assert path.exists(), path


@fault(
    "every checkpoint is damaged (a truncated loader state, a truncated shard)",
    "error: no checkpoint under {ckpts} can be read (last error: {shard} is truncated ({n} of {m} bytes); the "
    "checkpoint is damaged); "
    "if this run's settings changed on purpose, start it with a new --ckpt_save_path",
    1,
)
def _resume_all_damaged(b: Bench) -> Job:
    out = b.run_with_checkpoints()
    ckpts = out / "checkpoints"
    state = ckpts / "step_12_ckp" / "loader_state_1.pth"
    state.write_bytes(state.read_bytes()[:100])
    shard = next((ckpts / "step_6_ckp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    return Job(
        ["fms-train", *flags(b.data, out, "--num_steps=13")], nproc=2, values={"ckpts": str(ckpts)}, keep=[ckpts]
    )


# ------------------------------------------------------------------------------- data


@fault("a data shard that is not Arrow", "error: {path}: not a readable arrow shard{why}", 2)
def _bad_shard(b: Bench) -> Job:
    data = b.tmp / "data"
    for name in ("code", "web"):
        (data / name).mkdir(parents=True)
        (data / name / "part0.arrow").write_bytes(b"ARROW1 but not really")
    return Job(["fms-train", *flags(data, b.tmp / "run")], values={"path": str(data / "code" / "part0.arrow")})


@fault("a truncated data shard", "error: {path}: not a readable arrow shard{why}", 2)
def _truncated_shard(b: Bench) -> Job:
    data = b.tmp / "data"
    shutil.copytree(b.data, data)
    path = next((data / "web").rglob("*.arrow"))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return Job(["fms-train", *flags(data, b.tmp / "run")], values={"path": str(path)})


@fault("a zero-byte data shard", "error: {path}: not a readable arrow shard{why}", 2)
def _zero_shard(b: Bench) -> Job:
    data = b.tmp / "data"
    shutil.copytree(b.data, data)
    path = next((data / "web").rglob("*.arrow"))
    path.write_bytes(b"")
    return Job(["fms-train", *flags(data, b.tmp / "run")], values={"path": str(path)})


@fault(
    "the data is deleted mid-run (two loader workers): the files they opened stay readable, the run ends well",
    "step 8 | loss {rest}",
    0,
)
def _data_gone(b: Bench) -> Job:
    data = b.tmp / "data"
    shutil.copytree(b.data, data)
    out, held = b.tmp / "run", b.tmp / "held"
    return Job(
        ["fms-train", *flags(data, out, "--num_steps=8", "--num_workers=2", "--checkpoint_interval=2")],
        held=(held, "step:3"),  # deleted after step 2's checkpoint, before step 3: mid-run every time
        during=when_held(held, 1, lambda procs: shutil.rmtree(data)),
        keep=[out / "checkpoints" / "step_2_ckp"],
    )


# ------------------------------------------------------------------------------- disks that fail mid-run


@fault(
    "the disk fills up at a save",
    "error: not enough space in {ckpts} for a checkpoint: {free} GiB free, about {need} GiB needed; free space or "
    "set --ckpt_save_path",
    1,
)
def _full_disk(b: Bench) -> Job:
    mount = b.mount("disk", "24m")  # a checkpoint of tiny is about 37 MB
    out = mount / "run"
    return Job(
        ["fms-train", *DUMMY, "--checkpoint_interval=2", f"--ckpt_save_path={out}"],
        nproc=2,
        values={"ckpts": str(out / "checkpoints")},
        cleanup=unmount(mount),
    )


@fault(
    "the disk fills up during the export at the end",
    "error: export to {target} failed: {free} GiB free at {folder}, {needed} GiB needed (every rank's shards, then "
    "the file); the run's checkpoints are kept: export one with fms-export-model",
    1,
)
def _full_disk_export(b: Bench) -> Job:
    mount = b.mount("disk", "8m")  # tiny's weights are 12 MB: every rank's shards (a DCP folder) do not fit
    out = mount / "run"
    return Job(
        [
            "fms-train",
            *DUMMY,
            "--num_steps=2",
            "--checkpoint_interval=0",
            "--export_model_at_end=True",
            f"--ckpt_save_path={out}",
        ],
        values={"target": str(out / "model_step_2.safetensors")},
        cleanup=unmount(mount),
        after=lambda: _absent(out / "model_step_2.safetensors"),
    )


@fault(
    "the disk turns read-only mid-run",
    "error: checkpoint save to {ckpts} failed: [Errno 30] Read-only file system: {why}",
    1,
)
def _read_only_mid_run(b: Bench) -> Job:
    mount = b.mount("disk", "200m")
    out, held = mount / "run", b.tmp / "held"
    return Job(
        ["fms-train", *LONG, f"--ckpt_save_path={out}"],
        nproc=2,
        values={"ckpts": str(out / "checkpoints")},
        held=(held, "step:3"),  # step 2 saved and committed: step 4's save is the one that fails
        during=when_held(held, 2, lambda procs: subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)),
        cleanup=unmount(mount),
    )


@fault(
    "the disk turns read-only mid-run, with --on_checkpoint_error=warn",
    "warning: checkpoint save to {ckpts} failed: [Errno 30] Read-only file system: {why}; training goes on "
    "(--on_checkpoint_error=warn)",
    0,
)
def _read_only_warn(b: Bench) -> Job:
    mount = b.mount("disk", "200m")
    out, held = mount / "run", b.tmp / "held"
    return Job(
        ["fms-train", *LONG, "--num_steps=6", "--on_checkpoint_error=warn", f"--ckpt_save_path={out}"],
        nproc=2,
        values={"ckpts": str(out / "checkpoints")},
        held=(held, "step:3"),  # step 2 saved and committed; read-only before step 4's save, every time
        during=when_held(held, 2, lambda procs: subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)),
        keep=[out / "checkpoints" / "step_2_ckp"],
        cleanup=unmount(mount),
    )


# ------------------------------------------------------------------------------- signals


@fault(
    "SIGTERM during a save (a preemption)",
    "stopping after step {n} on SIGTERM: the checkpoint is saved, resume by running the same command",
    0,
)
def _sigterm_in_save(b: Bench) -> Job:
    return _stopped_in_save(b, signal.SIGTERM)


@fault(
    "Ctrl-C (SIGINT) during a save",
    "stopping after step {n} on SIGINT: the checkpoint is saved, resume by running the same command",
    0,
)
def _sigint_in_save(b: Bench) -> Job:
    return _stopped_in_save(b, signal.SIGINT)  # as a terminal's Ctrl-C reaches every process of the ranks


def _stopped_in_save(b: Bench, sig: signal.Signals) -> Job:
    """A run sent `sig` inside step 4's save (.step_4_ckp.tmp made): each rank takes the signal there."""
    out, held = b.tmp / "run", b.tmp / "held"
    ckpts = out / "checkpoints"
    return Job(
        ["fms-train", *LONG, f"--ckpt_save_path={out}"],
        nproc=2,
        held=(held, "save:4"),
        during=when_held(held, 2, signal_all(sig), signalled=2),
        after=lambda: _resumable(ckpts),
    )


def _resumable(ckpts: Path) -> None:
    """The save the signal came in finished, as did the stop's; nothing unfinished is left."""
    from fms_fsdp.checkpoint.layout import complete_checkpoints

    steps = [s for s, _ in complete_checkpoints(ckpts)]
    assert 4 in steps and steps[-1] >= 4 and not list(ckpts.glob(".*.tmp")), sorted(p.name for p in ckpts.iterdir())


@fault(
    "kill -9 during an async save: the next start resumes from the last complete checkpoint",
    "checkpoint: resumed from {ckpts}/step_{n}_ckp at step {n}",
    0,
)
def _kill_in_async_save(b: Bench) -> Job:
    out, held = b.tmp / "run", b.tmp / "held"
    ckpts = out / "checkpoints"
    argv = ["fms-train", *LONG, "--async_checkpoint=True", f"--ckpt_save_path={out}"]
    # killed while each rank's background write of step 4 has written nothing: step 2 is the last checkpoint
    killed = Job(argv, nproc=2, held=(held, "write:4"), during=when_held(held, 2, signal_all(signal.SIGKILL)))
    resume = [*argv[:-1], "--num_steps=5", f"--ckpt_save_path={out}"]
    return Job(resume, nproc=2, prelude=killed, values={"ckpts": str(ckpts), "n": "2"})


# ------------------------------------------------------------------------------- the run lease


@fault(
    "a second run into the folder of a running one",
    "error: --ckpt_save_path: {path} belongs to a running run (pid {pid} on {host}, started {t}, heartbeat {s} s ago); "
    "give this run another --ckpt_save_path, or stop that run first",
    2,
)
def _second_run(b: Bench) -> Job:
    out, held = b.tmp / "run", b.tmp / "held"
    ckpts = out / "checkpoints"
    # the first run waits before step 3 (step 2 saved) until the second has ended: it is running throughout
    first = start(["fms-train", *LONG, f"--ckpt_save_path={out}"], None, b.tmp, held=(held, "step:3"))
    deadline = time.monotonic() + 120
    while not (held / "held-0").exists():
        assert first[0].poll() is None and time.monotonic() < deadline, "the first run did not save"
        time.sleep(0.05)

    def stop_first() -> None:
        signal_all(signal.SIGTERM)(first)
        while not (held / "signalled-0").exists():  # taken while still held
            assert first[0].poll() is None and time.monotonic() < deadline + 60, first[0].output()
            time.sleep(0.02)
        (held / "release").touch()
        assert first[0].wait(60) == 0
        assert "on SIGTERM: the checkpoint is saved" in first[0].output()[0]

    return Job(
        ["fms-train", *LONG, "--learning_rate=1e-4", f"--ckpt_save_path={out}"],
        values={"path": str(out)},
        keep=[ckpts / "step_2_ckp"],
        after=stop_first,
        cleanup=lambda: [p.kill() for p in first],
    )


@fault(
    "a lease left by a run killed on this host (its process gone, or a zombie not reaped yet)",
    "note: took over {lease} from a run that ended without releasing it (pid {pid} on {host} is gone)",
    0,
)
def _dead_owner(b: Bench) -> Job:
    out = b.run_with_checkpoints()
    killed = subprocess.Popen(["sleep", "60"])
    killed.kill()  # and not reaped until the case ends: a zombie, as a killed rank whose parent died
    while Path(f"/proc/{killed.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.01)
    owner_record(out, pid=killed.pid)
    return Job(
        ["fms-train", *flags(b.data, out, "--num_steps=13")],
        values={"lease": str(out / "owner.json")},
        keep=[out / "checkpoints" / "step_12_ckp"],
        after=lambda: _absent(out / "owner.json"),
        cleanup=killed.wait,
    )


@fault(
    "a lease of another host whose heartbeat stopped",
    "note: took over {lease} from a run that ended without releasing it (no heartbeat for {s} s)",
    0,
)
def _stale_owner(b: Bench) -> Job:
    out = b.tmp / "run"
    owner_record(out, host="node-that-died", heartbeat=time.time() - 3600)
    return Job(["fms-train", *DUMMY, f"--ckpt_save_path={out}"], values={"lease": str(out / "owner.json")})


@fault(
    "a live lease of a run on another host",
    "error: --ckpt_save_path: {path} belongs to a running run (pid {pid} on other-node, started {t}, heartbeat {s} s "
    "ago); give this run another --ckpt_save_path, or stop that run first",
    2,
)
def _live_owner_elsewhere(b: Bench) -> Job:
    out = b.tmp / "run"
    owner_record(out, host="other-node")
    return Job(["fms-train", *DUMMY, f"--ckpt_save_path={out}"], values={"path": str(out)})


@fault(
    "a Slurm requeue of the same job takes its lease back at once",
    "note: took over {lease} from a run that ended without releasing it (Slurm job 4242 started again (a requeue))",
    0,
)
def _requeue(b: Bench) -> Job:
    out = b.tmp / "run"
    owner_record(out, host="node-before-requeue", job="4242")
    return Job(
        ["fms-train", *DUMMY, f"--ckpt_save_path={out}"],
        env={"SLURM_JOB_ID": "4242"},
        values={"lease": str(out / "owner.json")},
    )


# ------------------------------------------------------------------------------- torchrun


@fault(
    "any of these under torchrun: the rank's line is torchrun's root cause; torchrun exits 1",
    "error: --ckpt_load_path: {path} does not exist",
    1,
)
def _torchrun(b: Bench) -> Job:
    path = b.tmp / "nothing"
    return _loading(b, path, synthetic=True, nproc=2, torchrun=True)


# ------------------------------------------------------------------------------- running the matrix


# the commands run in processes forked from a server that imported the package once (as a process
# started by torchrun or the console script, from its first line: no import time per launch); the
# torchrun case runs the installed command under torchrun itself
SERVER = multiprocessing.get_context("forkserver")
SERVER.set_forkserver_preload(
    ["fms_fsdp.cli", "fms_fsdp.train.loop", "fms_fsdp.evaluation.evaluate", "fms_fsdp.weights.hf"]
)
LAUNCHED = itertools.count()  # names the processes' output files
# multiprocessing's forkserver processes are not thread-safe: two threads polling one process (and
# Process.start polls every live child) can both see it end, and the one that reads second gets EOF
# and reports status 255 for a rank that exited 0 or 2. The matrix's threads start and poll under
# this lock.
SERVER_LOCK = threading.Lock()
ENTRY_POINTS = {e.name: e.value for e in entry_points(group="console_scripts") if e.value.startswith("fms_fsdp.")}


def _command(
    name: str, args: list[str], env: dict[str, str], out: str, err: str, held: Optional[tuple[Path, str]] = None
) -> None:
    """A command's process: its environment, stdout and stderr, then its console script's function
    (`held`: held at that point, tests/held_at.py). Its loader workers start as a console script's would
    (the platform's default start method), not from the forkserver it inherited (on 3.11 that one's
    start fails now and then, unexpected EOF)."""
    multiprocessing.set_start_method(None, force=True)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    import torch

    torch.set_num_threads(1)
    if held is not None:
        from held_at import install

        install(*held)
    module, function = ENTRY_POINTS[name].split(":")
    getattr(importlib.import_module(module), function)(args)


class Proc:
    """One process of a launch: a forked command, or torchrun."""

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        folder: Path,
        torchrun: Optional[int] = None,
        held: Optional[tuple[Path, str]] = None,
    ):
        self.out = folder / f"{next(LAUNCHED)}.out"
        self.err = self.out.with_suffix(".err")
        if torchrun:
            runner = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}"]
            with self.out.open("w") as o, self.err.open("w") as e:
                self.popen: Optional[subprocess.Popen] = subprocess.Popen(
                    [*runner, str(BIN / argv[0]), *argv[1:]], env=env, cwd=ROOT, stdout=o, stderr=e
                )
            self.pid = self.popen.pid
            return
        self.popen = None
        self.process = SERVER.Process(
            target=_command, args=(argv[0], argv[1:], env, str(self.out), str(self.err), held)
        )
        with SERVER_LOCK:
            self.process.start()
        self.pid = self.process.pid

    def poll(self) -> Optional[int]:
        if self.popen:
            return self.popen.poll()
        with SERVER_LOCK:
            return self.process.exitcode

    def send_signal(self, sig: signal.Signals) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        if self.popen:
            return self.popen.wait(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.02)
        return self.poll()

    def output(self) -> tuple[str, str]:
        return self.out.read_text(errors="replace"), self.err.read_text(errors="replace")


def start(
    argv: list[str],
    nproc: Optional[int],
    folder: Path,
    env: Optional[dict[str, str]] = None,
    torchrun: bool = False,
    held: Optional[tuple[Path, str]] = None,
) -> list[Proc]:
    """The processes of a launch: one, or `nproc` ranks started as torchrun starts them (or torchrun);
    `held`: (folder, point), each held there (tests/held_at.py; not under torchrun)."""
    from fms_fsdp.parallel.process_group import free_port

    base = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        base.pop(name, None)
    if nproc is None or torchrun:
        assert held is None or not torchrun
        return [Proc(argv, base, folder, torchrun=nproc if torchrun else None, held=held)]
    world = {
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    return [
        Proc(argv, {**base, **world, "RANK": str(r), "LOCAL_RANK": str(r)}, folder, held=held) for r in range(nproc)
    ]


def finish(job: Job, folder: Path, timeout: float = 90) -> tuple[int, str, str]:
    """Run a job to its end: (status, stdout, stderr); a failed rank ends the others, as torchrun does."""
    procs = start(job.argv, job.nproc, folder, job.env, job.torchrun, job.held)
    deadline, acted, failed_at = time.monotonic() + timeout, job.during is None, None
    while any(p.poll() is None for p in procs):
        if not acted:
            acted = job.during(procs)
        if failed_at is None and (any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > 2:
            for p in procs:
                p.kill()
        time.sleep(0.02)
    codes = [p.wait() for p in procs]
    assert acted, f"the job ended (status {codes}) before what happens to it while it runs was done"
    status = next((c for c in codes if c != 0), 0)
    outputs = [p.output() for p in procs]
    return status, "".join(o for o, _ in outputs), "".join(e for _, e in outputs)


def pattern(says: str, values: dict[str, str]) -> re.Pattern:
    """The template as a regex: known values exactly, other {names} as any text."""
    parts = re.split(r"(\{\w+\})", says)
    regex = "".join(
        (re.escape(values[p[1:-1]]) if p[1:-1] in values else ".+?") if re.fullmatch(r"\{\w+\}", p) else re.escape(p)
        for p in parts
    )
    return re.compile(regex)


def hashes(folders: list[Path]) -> dict[str, str]:
    return {
        str(p): hashlib.sha256(p.read_bytes()).hexdigest()
        for folder in folders
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def check(f: Fault, b: Bench) -> Optional[str]:
    """Run one case; a description of what did not hold, or None."""
    job = f.make(b)
    try:
        if job.prelude is not None:
            finish(job.prelude, b.tmp)
        before = hashes(job.keep)
        status, out, err = finish(job, b.tmp)
        if job.after is not None:
            job.after()
    finally:
        if job.cleanup is not None:
            job.cleanup()
    regex = pattern(f.says, job.values)
    if job.torchrun:
        cause = err.split("Root Cause (first observed failure):", 1)[-1]
        ok = (
            status == f.status
            and re.search(r"exitcode\s*: 2 ", cause)
            and re.search("traceback : " + regex.pattern, cause)
        )
        return None if ok else f"status {status}, root cause:\n{cause[-2000:]}"
    if f.status != 0:
        lines = [line for line in err.splitlines() if line.strip()]
        ok = status == f.status and len(lines) == 1 and regex.fullmatch(lines[0])
    else:  # and nothing on stderr: no traceback, no warning of a library
        ok = status == 0 and any(regex.fullmatch(line) for line in out.splitlines()) and not err.strip()
    if not ok:
        return f"status {status}\n--- stdout\n{out[-600:]}\n--- stderr\n{err[-3000:]}"
    after = hashes(job.keep)
    changed = [p for p in before if before[p] != after.get(p)]
    return f"changed or lost: {changed}" if changed else None


@pytest.fixture
def server():
    """The fork server, stopped after the matrix with the resource tracker it started (no process of
    this test outlives it)."""
    yield SERVER
    for helper in (multiprocessing.forkserver._forkserver, multiprocessing.resource_tracker._resource_tracker):
        stop = getattr(helper, "_stop", None)  # Python has no public way
        if stop is not None:
            stop()


@pytest.mark.slow
def test_every_fault_ends_in_its_one_line_and_status_and_keeps_every_checkpoint(server, data, uninterrupted, tmp_path):
    assert {p.name for p in BIN.iterdir()} >= set(COMMANDS), "the package's commands are installed (scripts/setup.sh)"
    assert len(FAULTS) >= 25
    if (why := can_mount_tmpfs(tmp_path / "can-mount")) is not None:  # here, not in a case's thread
        pytest.skip(why)

    def one(k: int) -> Optional[str]:
        folder = tmp_path / f"case{k}"
        folder.mkdir()
        t = time.monotonic()
        try:
            return check(FAULTS[k], Bench(folder, data, uninterrupted))
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        finally:
            print(f"{time.monotonic() - t:6.1f}s  {FAULTS[k].what}", flush=True)

    chosen = chosen_faults()
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(one, chosen))
    failed = [f"{FAULTS[k].what}: {r}" for k, r in zip(chosen, results) if r is not None]
    assert not failed, "\n\n".join(failed)


def troubleshooting_table() -> str:
    """The markdown table of docs/troubleshooting.md (scripts/gen_docs.py)."""
    rows = ["| what happened | what you see | exit status |", "|---|---|---|"]
    for f in FAULTS:
        line = re.sub(r"\{(\w+)\}", r"<\1>", f.says).replace("|", "\\|")
        rows.append(f"| {f.what} | `{line}` | {f.status} |")
    return "\n".join(rows)


@pytest.mark.slow  # the matrix's own harness, with the matrix
def test_the_matrix_reads_each_status_while_threads_poll(server, tmp_path):
    """The matrix's threads poll its processes at once (and starting one polls them all): each
    status is still the one the process exited with (without the lock, some read 255)."""
    procs = [Proc(["fms-train", "--no_such_flag=1" if k % 2 else "--help"], {}, tmp_path) for k in range(12)]
    stop = threading.Event()

    def poll_all() -> None:
        while not stop.is_set():
            for p in procs:
                p.poll()

    pollers = [threading.Thread(target=poll_all) for _ in range(3)]
    for t in pollers:
        t.start()
    codes = [p.wait(60) for p in procs]
    stop.set()
    for t in pollers:
        t.join()
    assert codes == [2 if k % 2 else 0 for k in range(12)]
