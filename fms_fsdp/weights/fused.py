"""Checkpoints keep fms's fused keys (qkv_fused, wg1_fused) for a model built unfused (tensor parallel).

Each fused key is handed to DCP as a ShardedTensor whose local shards are views of this rank's pieces
of the parts (q, k, v; gate, up), placed at their rows in the fused tensor: no copy, no collective.
DCP writes the fused tensor as a model built fused would, and loads any checkpoint's fused tensor
into the views in place, whatever the tensor-parallel size it was written at. (A DTensor cannot
place three pieces of one tensor on a rank; DCP's ShardedTensor handling warns that it is
deprecated at every save and load, which the commands quiet: cli.quiet_library_noise.) The same goes for the
optimizer's moments; the parts' step counts and parameter-group names map to and from the fused ones.
"""

from __future__ import annotations

import itertools
from functools import lru_cache
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from fms_fsdp.compat import (
    Shard,
    ShardedTensor,
    ShardedTensorMetadata,
    ShardMetadata,
    TensorProperties,
    local_shape_and_offset_at,
    local_tensor,
)
from fms_fsdp.model.variants import fused_parts
from fms_fsdp.optim import low_bit_state

Groups = dict[str, list[tuple[str, int]]]  # fused name -> [(part name, first row)]


def plain_tensor(value: torch.Tensor) -> torch.Tensor:
    """A state-dict tensor as checkpoints hold it: a wrapper subclass (the weights of float8 training
    with float8 all-gather) becomes the plain tensor it wraps, sharing its storage, so a checkpoint is
    the same with and without float8 and loads into either; torchao's low-bit optimizer state becomes a
    copy of its fp32 values (loaded back by optim.load_low_bit_states), so a checkpoint holds fp32 states
    whatever --optimizer_state_dtype."""
    if isinstance(value, DTensor):
        local = plain_tensor(local_tensor(value))
        if local is local_tensor(value):
            return value
        return DTensor.from_local(
            local, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
        )
    if type(value) not in (torch.Tensor, torch.nn.Parameter) and hasattr(value, "__tensor_flatten__"):
        if low_bit_state(value):
            return value.dequantize()
        names, _ = value.__tensor_flatten__()
        return getattr(value, names[0])
    return value


def fuse(state: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's {"model_state", "optimizer_state", "ema_state" (both optional)} under fms's fused
    names: views of `state`'s tensors, or `state` itself for a model built fused."""
    groups = fused_groups(state["model_state"])
    if not groups:
        return state
    out = {**state, "model_state": fuse_model_state(state["model_state"], groups)}
    if "ema_state" in state:
        out["ema_state"] = fuse_model_state(state["ema_state"], groups)
    if "optimizer_state" in state:
        out["optimizer_state"] = fuse_optimizer_state(state["optimizer_state"], groups)
    return out


class FusingStager(AsyncStager):
    """A background save's staging: `inner` (torch's stager, which copies plain tensors and DTensors
    but not ShardedTensors) copies the state under the model's own names, then the copy is fused."""

    def __init__(self, inner: AsyncStager):
        self.inner = inner

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self.inner.should_synchronize_after_execute

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:  # type: ignore[override]
        staged = self.inner.stage(state_dict)
        assert isinstance(staged, dict), "staged synchronously"
        return fuse(staged)

    def synchronize_staging(self) -> None:
        self.inner.synchronize_staging()

    def close(self) -> None:
        """The inner stager's buffers are its owner's to free."""


def fused_groups(model_state: dict[str, Any]) -> Groups:
    """The fused keys of a model state dict built unfused (empty when built fused)."""
    return fused_parts({k: v.shape for k, v in model_state.items() if isinstance(v, torch.Tensor)})


def fuse_model_state(model_state: dict[str, Any], groups: Groups) -> dict[str, Any]:
    """The model state with each group's parts replaced by one fused view."""
    parts = {m for members in groups.values() for m, _ in members}
    out = {k: v for k, v in model_state.items() if k not in parts}
    for fused, members in groups.items():
        out[fused] = _fused_view([(model_state[m], row) for m, row in members])
    return out


def fuse_optimizer_state(optim_state: dict[str, Any], groups: Groups) -> dict[str, Any]:
    """The optimizer state (torch's FQN-keyed form) under fused names: the moments as fused views, the
    step count the first part's (the parts step together), parameter groups naming the fused keys."""
    state, parts = optim_state["state"], {m for members in groups.values() for m, _ in members}
    fused_state = {k: v for k, v in state.items() if k not in parts}
    for fused, members in groups.items():
        if members[0][0] not in state:
            continue
        first = state[members[0][0]]
        fused_state[fused] = {
            key: _fused_view([(state[m][key], row) for m, row in members])
            if isinstance(value, DTensor) and value.dim() > 0
            else value
            for key, value in first.items()
        }
    renamed = {members[0][0]: fused for fused, members in groups.items()}
    param_groups = [
        {**g, "params": [renamed.get(p, p) for p in g["params"] if p not in parts or p in renamed]}
        for g in optim_state["param_groups"]
    ]
    return {"state": fused_state, "param_groups": param_groups}


def unfuse_loaded_optimizer(loaded: dict[str, Any], optim_state: dict[str, Any], groups: Groups) -> None:
    """After DCP loaded into fuse_optimizer_state's views: give the parts the loaded step counts and
    `optim_state` the loaded parameter groups' settings."""
    for fused, members in groups.items():
        for key, value in loaded["state"].get(fused, {}).items():
            if not isinstance(value, ShardedTensor):  # each its own: the optimizer steps each in place
                for m, _ in members:
                    optim_state["state"][m][key] = value.clone() if isinstance(value, torch.Tensor) else value
    # torch matches the loaded groups' parameters to the optimizer's by position: keep its own order
    if len(loaded["param_groups"]) != len(optim_state["param_groups"]):
        raise RuntimeError(
            f"the checkpoint's optimizer has {len(loaded['param_groups'])} parameter groups, this run's "
            f"{len(optim_state['param_groups'])} (--weight_decay_norms_and_embeddings changed?)"
        )
    optim_state["param_groups"] = [
        {**g, "params": own["params"]} for g, own in zip(loaded["param_groups"], optim_state["param_groups"])
    ]


def _fused_view(parts: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """The fused tensor of `parts` (sharded DTensors, each at its first row), as a ShardedTensor of
    views of this rank's pieces. Its metadata tiles the fused tensor with the pieces of the ranks that
    share this rank's coordinates on replicated mesh dimensions (torch checks the tiling, not who else
    holds a copy; DCP writes a piece several ranks hold once)."""
    first = parts[0][0]
    assert isinstance(first, DTensor), "a model built unfused is sharded"
    me = torch.distributed.get_rank()
    size = torch.Size([parts[-1][1] + parts[-1][0].shape[0], *first.shape[1:]])
    device = first.to_local().device
    shards, tiles = [], []
    for part, row in parts:
        assert isinstance(part, DTensor)
        for rank, meta in _tile_metadata(
            part.shape, _grid(part.device_mesh), tuple(part.placements), me, row, str(device)
        ):
            tiles.append(meta)
            if rank == me:
                shards.append(Shard(part.to_local(), meta))
    properties = TensorProperties(dtype=first.dtype, requires_grad=False, pin_memory=first.to_local().is_pinned())
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, ShardedTensorMetadata(tiles, size, properties)
    )


Grid = tuple[tuple[int, ...], tuple[int, ...]]  # a mesh's shape and its ranks in row-major order


def _grid(mesh: DeviceMesh) -> Grid:
    """The mesh's geometry, the key of the caches below (a DeviceMesh would keep its process groups
    alive in them past the end of the process group)."""
    return tuple(mesh.shape), tuple(int(r) for r in mesh.mesh.flatten().tolist())


@lru_cache(maxsize=1024)
def _tile_metadata(
    shape: torch.Size, grid: Grid, placements: tuple[Placement, ...], me: int, row: int, device: str
) -> list[tuple[int, ShardMetadata]]:
    """_tiles as torch's shard metadata at `row` of the fused tensor, made once per save's shapes (at a
    thousand ranks, making them is most of the cost of a fused view)."""
    return [
        (rank, ShardMetadata([row + offset[0], *offset[1:]], list(local), f"rank:{rank}/{device}"))
        for rank, offset, local in _tiles(shape, grid, placements, me)
    ]


@lru_cache(maxsize=256)
def _tiles(
    shape: torch.Size, grid: Grid, placements: tuple[Placement, ...], me: int
) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """(rank, offset, shape) of each distinct non-empty piece of a DTensor of `shape` over the mesh
    `grid`: this rank's own piece under its own rank, every other under the first rank that holds it."""
    mesh_shape, ranks = grid
    held: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    rank_at = dict(zip(itertools.product(*map(range, mesh_shape)), ranks))
    for coordinate in sorted(rank_at, key=lambda c: rank_at[c] != me):
        local, offset = local_shape_and_offset_at(shape, mesh_shape, list(coordinate), placements)
        if all(local):
            held.setdefault((tuple(offset), tuple(local)), rank_at[coordinate])
    return [(rank, offset, local) for (offset, local), rank in held.items()]
