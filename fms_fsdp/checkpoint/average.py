"""fms-average-checkpoints: the weighted average of the weights of several checkpoints of one run (the
last checkpoints of a WSD run's decay, a model soup), written as a checkpoint of its own.

Run by one process or by every rank of a torchrun launch (gloo, on the CPU): each rank reads, from each
checkpoint in turn, only its own slice of every tensor (the first dimension split over the ranks) and
adds it to its slice of the average: a rank holds about 2/N of the model in fp32 while averaging (the sum
and a read), then the last checkpoint's other state (its optimizer's moments: about 2/N more), and no
rank holds a whole tensor. The output holds the average under `model_state` and everything else of the last
checkpoint given (its optimizer state, weight average, step, scheduler and data positions), so it
resumes (as a run's newest step_N_ckp), initialises a run (--ckpt_load_path) and exports
(fms-export-model, fms-to-hf) as any checkpoint. It is written under a temporary name and renamed
when whole; an existing folder is never written over.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor import empty as sharded_empty

from fms_fsdp.checkpoint.layout import commit, start_save
from fms_fsdp.compat import local_tensor
from fms_fsdp.errors import CheckpointError, ConfigError
from fms_fsdp.parallel.process_group import agreement_group, start_process_group, stop_process_group
from fms_fsdp.storage import COMPLETE, is_remote
from fms_fsdp.versions import check_layout
from fms_fsdp.weights.reader import safe_reader, storage_writer

MODEL = "model_state."  # the prefix of the model's tensors in a checkpoint's DCP metadata


def average_command(checkpoints: list[str], out: str, weights: str) -> None:
    """fms-average-checkpoints: the process group (gloo: this launch's ranks, or this process alone),
    average_checkpoints, rank 0's lines."""
    try:
        chosen = [float(w) for w in weights.split(",")] if weights else None
    except ValueError:
        raise ConfigError(f"--weights={weights}: give numbers separated by commas, one per checkpoint") from None
    shares = check_inputs(checkpoints, out, chosen)
    paths = [Path(c) for c in checkpoints]
    metadata = read_metadata(paths)
    start_process_group(torch.device("cpu"))
    try:
        average_checkpoints(paths, Path(out), shares, metadata, _say)
    finally:
        stop_process_group()


def _say(line: str) -> None:
    if dist.get_rank() == 0:
        print(line, flush=True)


def check_inputs(load_paths: Sequence[str], save_path: str, weights: Optional[Sequence[float]]) -> list[float]:
    """The weights, summing to 1 (equal when not given); ConfigError or CheckpointError in one line for
    inputs that cannot be averaged, before anything is read in full."""
    if len(load_paths) < 2:
        raise ConfigError("give two or more checkpoint folders of one run to average (CKPT CKPT ...)")
    if not save_path:
        raise ConfigError("--out: give the new folder to write the averaged checkpoint to")
    for path in (*load_paths, save_path):
        if is_remote(path):
            raise ConfigError(f"{path}: fms-average-checkpoints reads and writes local folders; copy it here first")
    if Path(save_path).exists():
        raise ConfigError(f"--out={save_path} exists: give a new folder (nothing is written over)")
    for path in load_paths:
        if not all((Path(path) / name).is_file() for name in (COMPLETE, ".metadata", "metadata.pth")):
            raise CheckpointError(f"{path} is not a complete checkpoint folder: give step_N_ckp folders of a run")
    chosen = list(weights) if weights else [1.0] * len(load_paths)
    if len(chosen) != len(load_paths) or any(w < 0 for w in chosen) or sum(chosen) <= 0:
        raise ConfigError(
            f"--weights={','.join(map(str, chosen))}: give one weight of at least 0 per checkpoint "
            f"({len(load_paths)}), not all 0"
        )
    return [w / sum(chosen) for w in chosen]


def model_shapes(metadata: Metadata) -> dict[str, torch.Size]:
    entries = metadata.state_dict_metadata.items()
    return {k: m.size for k, m in entries if k.startswith(MODEL) and isinstance(m, TensorStorageMetadata)}


def read_metadata(paths: Sequence[Path]) -> list[Metadata]:
    """The checkpoints' DCP metadata, once their layouts are known readable and their models the same."""
    for path in paths:
        check_layout(torch.load(path / "metadata.pth", weights_only=True), path)
    metadata = [safe_reader(p).read_metadata() for p in paths]
    check_same_model(paths, metadata)
    return metadata


def check_same_model(paths: Sequence[Path], metadata: Sequence[Metadata]) -> None:
    """CheckpointError naming the first tensor where a checkpoint's model differs from the last one's."""
    last = model_shapes(metadata[-1])
    for path, meta in zip(paths, metadata):
        shapes = model_shapes(meta)
        for key in sorted(shapes.keys() | last.keys()):
            if shapes.get(key) != last.get(key):
                raise CheckpointError(
                    f"{path} and {paths[-1]} hold different models ({key[len(MODEL) :]}: "
                    f"{_shape(shapes.get(key))} against {_shape(last.get(key))}): average checkpoints of one run"
                )


def _shape(size: Optional[torch.Size]) -> str:
    return "missing" if size is None else "x".join(map(str, size)) or "scalar"


def empty_state(metadata: Metadata, mesh: Any) -> dict[str, Any]:
    """Somewhere to load every entry of a checkpoint: each tensor split by its first dimension over the
    ranks (a scalar whole on every rank), each other object a placeholder the load replaces."""
    state: dict[str, Any] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            state[key] = None
        elif len(meta.size) == 0:
            state[key] = torch.empty((), dtype=meta.properties.dtype)
        else:
            state[key] = sharded_empty(*meta.size, dtype=meta.properties.dtype, device_mesh=mesh, placements=[Shard(0)])
    return state


def average_checkpoints(
    paths: Sequence[Path],
    target: Path,
    shares: Sequence[float],
    metadata: Sequence[Metadata],
    log: Callable[[str], None],
) -> Path:
    """Write the average of the checkpoints `paths` (their DCP `metadata`) by `shares`, with the rest of the
    last one's state, to `target`. Every rank of the process group calls it."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = empty_state(metadata[-1], mesh)
    model = {
        k: v for k, v in state.items() if k.startswith(MODEL) and isinstance(v, torch.Tensor) and v.is_floating_point()
    }
    total = {k: torch.zeros_like(local_tensor(v), dtype=torch.float32) for k, v in model.items()}
    paths_of = metadata[-1].planner_data or {}  # each entry's place in the nested state DCP saved
    for path, share in zip(paths, shares):
        dcp.load(nested(model, paths_of), storage_reader=safe_reader(path), process_group=agreement_group())
        for key, value in model.items():
            total[key].add_(local_tensor(value).float(), alpha=share)
        log(f"averaging: read {path} (weight {share:.4g})")
    held = torch.tensor([sum(t.numel() * 4 for t in total.values())], dtype=torch.float64)
    for key, value in model.items():
        local_tensor(value).copy_(total.pop(key))  # the sums freed as they go: the rest is loaded next
    rest = nested({k: v for k, v in state.items() if k not in model}, paths_of)
    dcp.load(rest, storage_reader=safe_reader(paths[-1]), process_group=agreement_group())
    for key, value in model.items():
        place(rest, paths_of.get(key, (key,)), value)
    _write(rest, paths[-1], target, [str(p) for p in paths], list(shares))
    dist.all_reduce(held, op=dist.ReduceOp.MAX, group=agreement_group())
    whole = sum(size.numel() * 4 for size in model_shapes(metadata[-1]).values())
    log(
        f"averaged {len(paths)} checkpoints into {target} on {dist.get_world_size()} rank(s): each held "
        f"{held.item() / 2**20:.1f} MiB of the model's {whole / 2**20:.1f} MiB in fp32 (twice: the average and a read)"
    )
    return target


def nested(flat: dict[str, Any], paths_of: dict[str, tuple]) -> dict[str, Any]:
    """`flat`'s entries at their places (DCP's paths: keys and list indexes) in a nested state, as the
    training state is saved (so the output reads back as the training state does)."""
    root: dict[str, Any] = {}
    for key, value in flat.items():
        place(root, paths_of.get(key, (key,)), value)
    return root


def place(root: Any, path: tuple, value: Any) -> None:
    """Put `value` at `path` under `root`, making the dicts and lists on the way."""
    node = root
    for part, after in zip(path, path[1:]):
        if isinstance(node, list):
            node.extend([None] * (part + 1 - len(node)))
        if (node[part] if isinstance(node, list) else node.get(part)) is None:
            node[part] = [] if isinstance(after, int) else {}
        node = node[part]
    if isinstance(node, list):
        node.extend([None] * (path[-1] + 1 - len(node)))
    node[path[-1]] = value


def _write(state: dict[str, Any], last: Path, target: Path, sources: list[str], shares: list[float]) -> None:
    """The averaged state in DCP under a temporary name beside `target`, the last checkpoint's other
    files copied (its metadata.pth naming the checkpoints averaged), then marked complete and renamed."""
    tmp = target.with_name(f".{target.name}.tmp")
    if dist.get_rank() == 0:
        start_save(tmp)
    dist.barrier(group=agreement_group())
    dcp.save(state, storage_writer=storage_writer(tmp), process_group=agreement_group())
    if dist.get_rank() == 0:
        for path in last.iterdir():
            if path.is_file() and path.suffix == ".pth" and path.name != "metadata.pth":
                shutil.copy2(path, tmp / path.name)
        meta = torch.load(last / "metadata.pth", weights_only=True)
        torch.save({**meta, "averaged_from": {"checkpoints": sources, "weights": shares}}, tmp / "metadata.pth")
        commit(tmp, target)
    dist.barrier(group=agreement_group())
