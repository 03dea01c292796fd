"""Which versions wrote a checkpoint, and which checkpoints this code reads: the checkpoint layout (what a
checkpoint holds, LAYOUT), the package's version and git commit. Each checkpoint's metadata.pth records
them (`stamp`); a resume or a conversion refuses a layout newer than this code's (`check_layout`).

Every layout keeps metadata.pth, readable by torch.load(weights_only=True) and holding `layout`: it is where
a checkpoint names its layout, so that an older release can refuse it instead of taking it for damaged.

Layouts, each with a checkpoint of it kept as test data (tests/kept_checkpoints.py):
  1: the model and optimizer in DCP under fms's fused names, metadata.pth (step, tokens, scheduler,
     world size, config), one loader_state_<rank>.pth per data-parallel rank; checkpoints written before
     layouts were recorded hold this layout.
  2: and a sparse model's experts: per block `ff_sub_layer.gate.weight` [experts, dim], and
     `ff_sub_layer.cond_ffn.w13` [experts, 2 x width, dim] and `.w2` [experts, dim, width] (ibm-fms's
     MOEFeedForward names, whole across ranks), with the moe_* flags in metadata.pth's config. A dense
     model's checkpoint is as in layout 1.
  3: and, with --ema_decay, the weight average under `ema_state` (the model's names and shapes, sharded as
     its weights). A checkpoint without it resumes with the average started at its weights.
"""

from __future__ import annotations

import io
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from fms_fsdp.errors import CheckpointError

LAYOUT = 3  # raised at any change of what a checkpoint holds (docs/checkpoints.md, Upgrades)


def installed(package: str) -> str:
    """The installed version of `package` ("not installed" when it is not)."""
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def code_commit() -> str:
    """The git commit of the code that runs (with '+ changes' when its tracked files differ from it)."""
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10).stdout

    try:
        top = git("rev-parse", "--show-toplevel").strip()
        if not top or Path(top).resolve() != root:  # installed inside some other checkout (a venv in one)
            return "unknown (not a git checkout)"
        commit = git("rev-parse", "HEAD").strip()
        changed = bool(git("status", "--porcelain", "--untracked-files=no").strip())
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + (" + changes" if changed else "")


def stamp() -> dict[str, Any]:
    """What metadata.pth records of the code that writes a checkpoint."""
    return {"layout": LAYOUT, "package_version": installed("fms-fsdp"), "commit": code_commit()}


def layout_of(meta: dict[str, Any]) -> int:
    """The layout of a checkpoint, from its metadata.pth (1 for one written before layouts were recorded)."""
    return int(meta.get("layout", 1))


def check_layout(meta: dict[str, Any], where: Path) -> None:
    """CheckpointError in one line when the checkpoint `where` (its metadata.pth: `meta`) has a layout newer
    than this code reads."""
    layout = layout_of(meta)
    if layout > LAYOUT:
        raise CheckpointError(
            f"{where} has checkpoint layout {layout}, written by fms-fsdp {meta.get('package_version', '?')}; "
            f"this fms-fsdp ({installed('fms-fsdp')}) reads layouts up to {LAYOUT}: upgrade it to resume or "
            "convert this checkpoint"
        )


def check_folder_layout(folder: Path) -> None:
    """check_layout of the checkpoint `folder`, from its metadata.pth (nothing to check without one)."""
    meta = folder / "metadata.pth"
    if meta.is_file():
        with meta.open("rb") as f:
            check_layout(torch.load(io.BytesIO(f.read()), weights_only=True), folder)
