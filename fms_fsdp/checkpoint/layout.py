"""Where checkpoints live and how one becomes visible: step folders, discovery, commit, deletion.

<ckpt_save_path>/checkpoints/step_<N>_ckp/ is fms-fsdp's layout. A folder named like a step is a
checkpoint only when it holds the COMPLETE marker, written last. On disk a save writes into a hidden
.step_<N>_ckp.tmp folder, and `commit` puts the marker inside and renames it into place. Object storage
has no rename: there the step's own prefix is the temporary one, flagged SAVING when the save
starts, until the marker is uploaded (as Orbax commits on GCS). Deleting unmarks first. Plain file
work without collectives: the caller picks the rank that runs it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

from fms_fsdp.atomic import fsync_path
from fms_fsdp.storage import COMPLETE, is_remote, remove_tree

SAVING = "SAVING"  # object storage: a step folder this package is writing
_STEP_DIR = re.compile(r"^step_(\d+)_ckp$")


def step_folder(root: Path, step: int) -> Path:
    return root / f"step_{step}_ckp"


def temp_folder(root: Path, step: int) -> Path:
    """Where the save of `step` is written before its commit (in object storage: its step folder)."""
    return step_folder(root, step) if is_remote(root) else root / f".step_{step}_ckp.tmp"


def start_save(tmp: Path) -> None:
    """An empty folder for a save (what an earlier attempt left there is deleted, in object storage
    unmarked first); in object storage flagged SAVING, so that an unfinished save is known as this
    package's."""
    remove_tree(tmp)
    if is_remote(tmp):
        (tmp / SAVING).write_text("")
    else:
        tmp.mkdir(parents=True)


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
    the same step from an earlier attempt), flushed to disk; in object storage, upload the marker."""
    if is_remote(final):
        (final / COMPLETE).write_text("ok\n")
        return
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
    """Unmark, then (on disk) move aside, then delete: a checkpoint is never half there and marked
    complete."""
    (path / COMPLETE).unlink(missing_ok=True)
    if is_remote(path):
        remove_tree(path)
        return
    doomed = path.with_name(f".{path.name}.deleting")
    os.replace(path, doomed)
    remove_tree(doomed)


def set_aside(path: Path) -> Optional[Path]:
    """Rename a checkpoint that cannot be read to <name>.unreadable[.<n>], kept whole but no longer a
    checkpoint (never resumed from, replaced or counted by the keep policy); returns the new path. Object
    storage cannot rename: there it stays (None)."""
    if is_remote(path):
        return None
    target, n = path.with_name(f"{path.name}.unreadable"), 1
    while target.exists():
        target, n = path.with_name(f"{path.name}.unreadable.{n}"), n + 1
    os.replace(path, target)
    fsync_path(path.parent)
    return target


def remove_stale(root: Path) -> None:
    """What saves and deletions that never finished (a crash, a kill) left: temporary folders on disk,
    step folders flagged SAVING without their COMPLETE marker in object storage (a step folder of
    another tool, without either, is left alone)."""
    if is_remote(root):
        stale = (
            [
                p
                for p in root.iterdir()
                if _STEP_DIR.match(p.name) and (p / SAVING).is_file() and not (p / COMPLETE).is_file()
            ]
            if root.is_dir()
            else []
        )
    else:
        stale = [*root.glob(".step_*_ckp.tmp*"), *root.glob(".step_*_ckp.deleting")]
    for p in stale:
        remove_tree(p)
