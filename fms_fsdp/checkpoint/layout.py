"""Where checkpoints live and how one becomes visible: step folders, discovery, commit, deletion.

<ckpt_save_path>/checkpoints/step_<N>_ckp/ is fms-fsdp's layout. A save writes into a hidden
.step_<N>_ckp.tmp folder; `commit` puts a COMPLETE marker inside and renames it into place, so a
folder named like a step and holding the marker is always whole. Deleting unmarks first. Plain
filesystem work without collectives: the caller picks the rank that runs it.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from fms_fsdp.atomic import fsync_path

COMPLETE = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d+)_ckp$")


def checkpoint_root(ckpt_save_path: str) -> Path:
    """The folder holding a run's step folders."""
    return Path(ckpt_save_path) / "checkpoints"


def step_folder(root: Path, step: int) -> Path:
    return root / f"step_{step}_ckp"


def temp_folder(root: Path, step: int) -> Path:
    """Where the save of `step` is written before its commit."""
    return root / f".step_{step}_ckp.tmp"


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint under root, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / COMPLETE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def commit(tmp: Path, final: Path) -> None:
    """Mark a fully written checkpoint complete and rename it into place (replacing a checkpoint of
    the same step from an earlier attempt), flushed to disk."""
    with open(tmp / COMPLETE, "w") as f:
        f.write("ok\n")
        f.flush()
        os.fsync(f.fileno())
    fsync_path(tmp)
    if final.exists():
        delete_checkpoint(final)
    os.replace(tmp, final)
    fsync_path(final.parent)


def delete_checkpoint(path: Path) -> None:
    """Unmark, then move aside, then delete: a checkpoint is never half there and marked complete."""
    (path / COMPLETE).unlink(missing_ok=True)
    doomed = path.with_name(f".{path.name}.deleting")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def remove_stale(root: Path) -> None:
    """Temporary folders of saves and deletions that never finished (a crash, a kill)."""
    for p in [*root.glob(".step_*_ckp.tmp*"), *root.glob(".step_*_ckp.deleting")]:
        shutil.rmtree(p, ignore_errors=True)
