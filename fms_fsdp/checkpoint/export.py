"""The whole model as one safetensors file: at the end of a run (--export_model_at_end, gathered from
every rank's shards) or from a checkpoint folder (scripts/export_model.py, `fms-export-model`).
Written under a temporary name and renamed, so a file of that name is always whole."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fms_fsdp.checkpoint.reader import read_model
from fms_fsdp.errors import CheckpointError, first_line


def write_safetensors(state: dict[str, torch.Tensor], target: Path, metadata: Optional[dict[str, str]] = None) -> Path:
    """One safetensors file, atomically."""
    from safetensors.torch import save_file

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, target)
    return target


def export_trained_model(model: torch.nn.Module, target: Path, step: int, is_main: bool) -> Path:
    """Gather the sharded model to rank 0's CPU one tensor at a time and write it there. Every rank calls it."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if is_main:
        write_safetensors(full, target, metadata={"step": str(step)})
        print(f"checkpoint: exported the model to {target}", flush=True)
    dist.barrier()
    return target


def export_checkpoint(load_path: str, save_path: str) -> str:
    """The model of a checkpoint folder (this project's or fms-fsdp's) as one safetensors file; no GPU,
    no process group, the model held in memory once. Returns a summary line."""
    if not load_path or not Path(load_path).is_dir():
        raise CheckpointError(f"--load_path: {load_path or '(missing)'} is not a checkpoint folder")
    if not save_path.endswith(".safetensors"):
        raise CheckpointError(f"--save_path: {save_path or '(missing)'} must end in .safetensors")
    try:
        state = read_model(Path(load_path))
    except (CheckpointError, RuntimeError, OSError) as e:
        raise CheckpointError(f"--load_path: cannot read {load_path}: {first_line(e)}") from None
    target = write_safetensors(state, Path(save_path))
    return f"wrote {target}: {len(state)} tensors, {sum(v.numel() for v in state.values()) / 1e6:.1f}M parameters"


def main(load_path: str = "", save_path: str = "") -> None:
    """Export the model of checkpoint folder --load_path to the safetensors file --save_path."""
    try:
        print(export_checkpoint(str(load_path), str(save_path)))
    except CheckpointError as e:
        sys.exit(f"error: {e}")


def cli() -> None:
    """`fms-export-model`: main's flags from the command line."""
    import fire

    fire.Fire(main)
