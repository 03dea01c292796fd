"""Checkpoints that never lose a run.

Layout (fms-fsdp's): <ckpt_save_path>/checkpoints/step_<N>_ckp/ holds torch.distributed.checkpoint
files (.distcp, .metadata) with `model_state` and `optimizer_state`, metadata.pth (step, tokens_seen,
scheduler, config) and one loader_state_<rank>.pth per rank (data position, RNG). A checkpoint is
written under a hidden temporary name and renamed, with a COMPLETE marker inside, only after every
rank has finished, so a half-written checkpoint is never taken for a good one. Old checkpoints are
deleted by the keep policy only after a newer one is complete; free space is checked before each
save; a failed save stops the run unless --on_checkpoint_error=warn.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import signal
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from fms_fsdp.atomic import fsync_path
from fms_fsdp.config import ConfigError, first_line, to_dict, train_config
from fms_fsdp.parallel import DistInfo

COMPLETE = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d+)_ckp$")
_POLICY_PART = re.compile(r"^every (\d+)(?: until (\d+))?$")
_DISK_MARGIN = 1.05  # a checkpoint's files take a little more than its tensors
# a whole model from one file: read on rank 0 only, each rank receives its shards
_FROM_RANK0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message names the path."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP .metadata file, refusing every global but the plain data types it holds,
    so reading a checkpoint never runs code from it."""

    _CLASSES = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
                ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):  # some Python versions pickle enum members so
            return _public_attribute
        if module == "torch.distributed.checkpoint.metadata" or (module, name) in self._CLASSES:
            found = super().find_class(module, name)
            if isinstance(found, type) or (module, name) in self._CLASSES:
                return found
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing {module}.{name} in checkpoint metadata")


def _public_attribute(obj: Any, name: str) -> Any:
    """getattr for the metadata unpickler: public names of the types it admits (enum members), nothing
    that could reach a function's globals."""
    if name.startswith("_") or not isinstance(obj, type) or obj.__module__ != "torch.distributed.checkpoint.metadata":
        raise pickle.UnpicklingError(f"refusing getattr({obj!r}, {name!r}) in checkpoint metadata")
    return getattr(obj, name)


class SafeReader(dcp.FileSystemReader):
    """FileSystemReader whose metadata is read without running code."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp.Metadata:
        with open(Path(self.path) / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


@dataclass(frozen=True)
class KeepPolicy:
    """Which complete checkpoints survive: the latest `latest`, plus permanent ones by step, e.g.
    'every 1000 until 10000, then every 5000' (Levanter's keep list)."""

    latest: int
    rules: tuple[tuple[int, Optional[int]], ...] = ()

    @classmethod
    def parse(cls, latest: int, text: str) -> "KeepPolicy":
        rules = []
        for part in filter(None, (p.strip().removeprefix("then ").strip() for p in text.split(","))):
            m = _POLICY_PART.match(part)
            if not m or int(m.group(1)) < 1:
                raise ConfigError(f"--checkpoint_keep_policy: cannot read {part!r}; write e.g. "
                                  "'every 1000 until 10000, then every 5000'")
            rules.append((int(m.group(1)), int(m.group(2)) if m.group(2) else None))
        return cls(latest, tuple(rules))

    def permanent(self, step: int) -> bool:
        start = 0
        for every, until in self.rules:
            if until is None or step <= until:
                return step > start and step % every == 0
            start = until
        return False

    def to_delete(self, steps: list[int]) -> list[int]:
        """Steps of complete checkpoints to delete (never the newest)."""
        ordered = sorted(steps)
        keep = set(ordered[-max(1, self.latest):]) | {s for s in ordered if self.permanent(s)}
        return [s for s in ordered if s not in keep]


def checkpoint_root(cfg: train_config) -> Path:
    return Path(cfg.ckpt_save_path) / "checkpoints"


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


def _delete_checkpoint(path: Path) -> None:
    """Unmark, then move aside, then delete: a checkpoint is never half there and marked complete."""
    (path / COMPLETE).unlink(missing_ok=True)
    doomed = path.with_name(f".{path.name}.deleting")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _to_torch(obj: Any) -> Any:
    """numpy arrays -> tensors, so torch.load(weights_only=True) reads the file back."""
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(obj))
    if isinstance(obj, dict):
        return {k: _to_torch(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_torch(v) for v in obj)
    return obj


def _save_file(obj: Any, path: Path) -> None:
    """torch.save, flushed to disk."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


class StopRequest:
    """SIGTERM / SIGUSR1 (Slurm preemption) set a flag the loop polls at step boundaries."""

    def __init__(self) -> None:
        self.requested: Optional[str] = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = signal.Signals(signum).name


class Checkpointer:
    """Saves and restores the whole training state; every rank calls every method."""

    def __init__(self, cfg: train_config, info: DistInfo, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: Any, loader: Any):
        self.cfg, self.info = cfg, info
        self.model, self.optimizer, self.scheduler, self.loader = model, optimizer, scheduler, loader
        self.root = checkpoint_root(cfg)
        self.policy = KeepPolicy.parse(cfg.checkpoint_keep, cfg.checkpoint_keep_policy)
        # checkpoint collectives run on gloo, also when training runs on NCCL (async saves need it)
        self.group = dist.new_group(backend="gloo")
        # background saves get a group of their own: their collectives run in another thread, and
        # sharing a group with the step-boundary all-reduce could pair collectives across ranks wrongly
        self.async_group = dist.new_group(backend="gloo") if cfg.async_checkpoint else None
        self.pending: Optional[tuple[int, Path, Future]] = None
        self.last_save_time = time.monotonic()
        self.stall_seconds = 0.0

    # ---------------------------------------------------------------- decisions

    def due(self, step: int, stop: StopRequest) -> tuple[bool, bool]:
        """(save now, then stop) at this step boundary, agreed by every rank."""
        by_time = (self.cfg.checkpoint_minutes is not None and self.info.is_main
                   and time.monotonic() - self.last_save_time >= 60 * self.cfg.checkpoint_minutes)
        writing = self.pending is not None and not self.pending[2].done()
        flags = torch.tensor([float(stop.requested is not None), float(by_time), float(writing)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        if self.pending is not None and not flags[2]:  # every rank's background write is done: commit now
            self.finish_pending()
        stopping = bool(flags[0])
        interval = step % self.cfg.checkpoint_interval == 0 or step == self.cfg.num_steps
        return stopping or bool(flags[1]) or interval, stopping

    # ---------------------------------------------------------------- save

    def _estimate_bytes(self) -> int:
        """Bytes of one checkpoint: model and optimizer shards of one replica (DCP writes each once)."""
        mesh = next(self.model.parameters()).device_mesh
        local = 0
        if mesh.get_coordinate()[0] == 0:  # the first replica along the mesh's 'replicate' dimension
            local = sum(t.numel() * t.element_size() for t in _tensors(self.model.state_dict()))
            local += sum(t.numel() * t.element_size() for t in _tensors(self.optimizer.state_dict()))
        total = torch.tensor([local], dtype=torch.float64)
        dist.all_reduce(total, group=self.group)
        return int(total.item() * _DISK_MARGIN)

    def _make_room(self, needed: int) -> None:
        """Prune by the policy until `needed` bytes are free; CheckpointError if they can't be."""
        self.root.mkdir(parents=True, exist_ok=True)
        free = torch.tensor([0.0])
        error: Optional[OSError] = None
        if self.info.is_main:
            try:
                free[0] = float(self._prune_for(needed))
            except OSError as e:
                error = e
        self._agree(error)
        dist.broadcast(free, src=0, group=self.group)
        if free[0] < needed:
            raise CheckpointError(f"not enough space in {self.root} for a checkpoint: {free[0] / 2**30:.2f} GiB "
                                  f"free, about {needed / 2**30:.2f} GiB needed; free space or set --ckpt_save_path")

    def _prune_for(self, needed: int) -> int:
        """(rank 0) Delete what the keep policy would, then the oldest, until `needed` bytes are free or
        only the newest complete checkpoint is left; returns the bytes free."""
        self._remove_stale()
        free = shutil.disk_usage(self.root).free
        complete = complete_checkpoints(self.root)
        deletable = [p for s, p in complete if s in self.policy.to_delete([s for s, _ in complete])]
        deletable += [p for _, p in complete[:-1] if p not in deletable]
        for path in deletable:
            if free >= needed:
                break
            print(f"checkpoint: {free / 2**30:.2f} GiB free, {needed / 2**30:.2f} GiB needed: deleting {path}",
                  flush=True)
            _delete_checkpoint(path)
            free = shutil.disk_usage(self.root).free
        return free

    def _agree(self, error: Optional[BaseException]) -> None:
        """Raise on every rank if any rank failed (so none waits in a collective for it)."""
        failed = torch.tensor([float(error is not None)])
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.group)
        if failed[0]:
            raise error if error is not None else OSError("another rank failed to write its part")

    def _remove_stale(self) -> None:
        """Temporary folders of saves that never completed (a crash, a kill)."""
        for p in [*self.root.glob(".step_*_ckp.tmp*"), *self.root.glob(".step_*_ckp.deleting")]:
            shutil.rmtree(p, ignore_errors=True)

    def save(self, step: int, tokens_seen: int) -> None:
        """Write a checkpoint of `step`; with --async_checkpoint the tensors are written in the
        background and the checkpoint is committed at the first step boundary after every rank's write
        is done (see due())."""
        start = time.monotonic()
        self.finish_pending()
        final = self.root / f"step_{step}_ckp"
        tmp = self.root / f".step_{step}_ckp.tmp"
        try:
            self._make_room(self._estimate_bytes())
            error: Optional[BaseException] = None
            try:
                if self.info.is_main:
                    shutil.rmtree(tmp, ignore_errors=True)
                    tmp.mkdir(parents=True)
            except OSError as e:
                error = e
            self._agree(error)  # also the barrier: the folder exists for every rank
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            state = {"model_state": model_sd, "optimizer_state": optim_sd}
            try:
                rank_state = {"loader": _to_torch(self.loader.state_dict()), "rng": torch.get_rng_state()}
                if self.info.device.type == "cuda":
                    rank_state["cuda_rng"] = torch.cuda.get_rng_state(self.info.device)
                _save_file(rank_state, tmp / f"loader_state_{self.info.rank}.pth")
                if self.info.is_main:
                    _save_file({"step": step, "tokens_seen": tokens_seen, "scheduler": self.scheduler.state_dict(),
                                "world_size": self.info.world_size, "config": to_dict(self.cfg)},
                               tmp / "metadata.pth")
            except OSError as e:
                error = e
            self._agree(error)
            if self.cfg.async_checkpoint:
                future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.async_group)
                self.pending = (step, tmp, future)
            else:
                dcp.save(state, checkpoint_id=str(tmp), process_group=self.group)
                self._commit(tmp, final)
        except (OSError, RuntimeError, dcp.CheckpointException) as e:
            self._failed(tmp, e)
        self.stall_seconds = time.monotonic() - start
        self.last_save_time = time.monotonic()

    def finish_pending(self) -> None:
        """Wait for a background save and commit it."""
        if self.pending is None:
            return
        step, tmp, future = self.pending
        self.pending = None
        error: Optional[BaseException] = None
        try:
            future.result()
        except (OSError, RuntimeError, dcp.CheckpointException) as e:
            error = e
        try:
            self._agree(error)
            self._commit(tmp, self.root / f"step_{step}_ckp")
        except (OSError, RuntimeError, dcp.CheckpointException) as e:
            self._failed(tmp, e)

    def _commit(self, tmp: Path, final: Path) -> None:
        """Every rank has written its part: mark complete, rename into place, apply the policy."""
        dist.barrier(group=self.group)
        error: Optional[BaseException] = None
        if self.info.is_main:
            try:
                with open(tmp / COMPLETE, "w") as f:
                    f.write("ok\n")
                    f.flush()
                    os.fsync(f.fileno())
                fsync_path(tmp)
                if final.exists():  # a checkpoint of this step from an earlier attempt
                    _delete_checkpoint(final)
                os.replace(tmp, final)
                fsync_path(self.root)
                steps = [s for s, _ in complete_checkpoints(self.root)]
                for s in self.policy.to_delete(steps):
                    _delete_checkpoint(self.root / f"step_{s}_ckp")
                print(f"checkpoint: saved {final}", flush=True)
            except OSError as e:
                error = e
        self._agree(error)

    def _failed(self, tmp: Path, error: BaseException) -> None:
        if self.info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        message = f"checkpoint save to {tmp.parent} failed: {first_line(error)}"
        if isinstance(error, CheckpointError):
            message = str(error)
        if self.cfg.on_checkpoint_error == "warn":
            if self.info.is_main:
                print(f"warning: {message}; training goes on (--on_checkpoint_error=warn)", flush=True)
            return
        raise CheckpointError(message) from None

    # ---------------------------------------------------------------- load

    def resume(self) -> Optional[tuple[int, int]]:
        """Restore the newest complete checkpoint under ckpt_save_path (the previous one if it can't
        be read): (step, tokens_seen), or None when there is none. Rank 0 lists the candidates and every
        rank agrees on each attempt, so all resume from the same one."""
        box: list[Any] = [[str(p) for _, p in reversed(complete_checkpoints(self.root))] if self.info.is_main else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        last_error = ""
        for path in map(Path, box[0]):
            error: Optional[BaseException] = None
            try:
                result = self._load(path)
            except (OSError, RuntimeError, KeyError, pickle.UnpicklingError, dcp.CheckpointException) as e:
                error, last_error = e, first_line(e)
            failed = torch.tensor([float(error is not None)])
            dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.group)
            if not failed[0]:
                return result
            if self.info.is_main:
                print(f"warning: cannot resume from {path} ({last_error or 'failed on another rank'}); "
                      "trying an older one", flush=True)
        if box[0]:
            raise CheckpointError(f"no checkpoint under {self.root} can be read (last error: {last_error}); if this "
                                  "run's settings changed on purpose, start it with a new --ckpt_save_path")
        return None

    def _load(self, path: Path) -> tuple[int, int]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model_state": model_sd, "optimizer_state": optim_sd}
        dcp.load(state, storage_reader=SafeReader(str(path)), process_group=self.group)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model_state"],
                       optim_state_dict=state["optimizer_state"])
        meta = torch.load(path / "metadata.pth", weights_only=True)
        self.scheduler.load_state_dict(meta["scheduler"])
        ranks = sorted(path.glob("loader_state_*.pth"), key=lambda p: int(p.stem.rsplit("_", 1)[1]))
        rank_states = [torch.load(p, weights_only=True) for p in ranks]
        self.loader.load_state_dict([r["loader"] for r in rank_states])  # every rank's: any world size
        if len(rank_states) == self.info.world_size:
            own = rank_states[self.info.rank]
            torch.set_rng_state(own["rng"])
            if "cuda_rng" in own and self.info.device.type == "cuda":
                torch.cuda.set_rng_state(own["cuda_rng"], self.info.device)
        if self.info.is_main:
            print(f"checkpoint: resumed from {path} at step {meta['step']}", flush=True)
        return int(meta["step"]), int(meta["tokens_seen"])

    def load_model(self, path: str) -> None:
        """Initialise the model only from --ckpt_load_path: a checkpoint folder (this project's or
        fms-fsdp's), or a single .pth / .safetensors file holding the model."""
        p = Path(path)
        if not p.exists():
            raise CheckpointError(f"--ckpt_load_path: {path} does not exist")
        try:
            if p.is_dir() and (p / "config.json").is_file():  # a Hugging Face Llama folder
                from fms_fsdp.hf import check_hf_config, read_hf_config, read_hf_model

                check_hf_config(read_hf_config(str(p)), self.model.config, str(p))  # on every rank: same verdict
                full = read_hf_model(str(p), self.model.config) if self.info.is_main else {}
                set_model_state_dict(self.model, full, options=_FROM_RANK0)
            elif p.is_dir():
                state = {"model_state": get_model_state_dict(self.model)}
                dcp.load(state, storage_reader=SafeReader(str(p)), process_group=self.group)
                set_model_state_dict(self.model, state["model_state"])
            else:
                full = _read_model_file(p) if self.info.is_main else {}
                set_model_state_dict(self.model, full, options=_FROM_RANK0)
        except (pickle.UnpicklingError, ValueError) as e:  # including HFError: a config that does not fit
            raise CheckpointError(f"--ckpt_load_path: {path}: {e}") from None
        except (RuntimeError, KeyError, dcp.CheckpointException) as e:
            raise CheckpointError(f"--ckpt_load_path: {path} does not fit --model_variant={self.cfg.model_variant}"
                                  f" (vocab {self.model.config.src_vocab_size}): {first_line(e)}") from None
        if self.info.is_main:
            print(f"checkpoint: model initialised from {path}", flush=True)

    # ---------------------------------------------------------------- export

    def export(self, step: int) -> Path:
        """The whole model as one safetensors file, gathered to rank 0's CPU one tensor at a time."""
        from safetensors.torch import save_file

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        target = Path(self.cfg.ckpt_save_path) / f"model_step_{step}.safetensors"
        if self.info.is_main:
            tmp = target.with_name(f".{target.name}.tmp")
            save_file({k: v.contiguous() for k, v in full.items()}, str(tmp), metadata={"step": str(step)})
            os.replace(tmp, target)
            print(f"checkpoint: exported the model to {target}", flush=True)
        dist.barrier(group=self.group)
        return target


def read_model_keys(folder: str) -> dict[str, torch.Size]:
    """Model tensor names and shapes of a checkpoint folder, from its metadata."""
    metadata = SafeReader(folder).read_metadata()
    keys = {key.removeprefix("model_state."): meta.size for key, meta in metadata.state_dict_metadata.items()
            if key.startswith("model_state.") and hasattr(meta, "size")}
    if not keys:
        raise CheckpointError(f"{folder}: no model_state in this checkpoint")
    return keys


def read_model_part(folder: str, keys: list[str]) -> dict[str, torch.Tensor]:
    """Some model tensors of a checkpoint folder, whole, in one process without a process group."""
    metadata = SafeReader(folder).read_metadata().state_dict_metadata
    state = {k: torch.empty(metadata[f"model_state.{k}"].size, dtype=metadata[f"model_state.{k}"].properties.dtype)
             for k in keys}
    if state:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model_state": state}, storage_reader=SafeReader(folder), no_dist=True)
    return state


def read_model_state(folder: str) -> dict[str, torch.Tensor]:
    """The full model of a checkpoint folder (this project's or fms-fsdp's), read once."""
    return read_model_part(folder, list(read_model_keys(folder)))


def model_file_reader(path: Path) -> tuple[dict[str, torch.Size], Callable[[list[str]], dict[str, torch.Tensor]]]:
    """(names and shapes, reader of some tensors) of a .safetensors or .pth model file, read lazily."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            shapes = {k: torch.Size(f.get_slice(k).get_shape()) for k in f.keys()}

        def read(keys: list[str]) -> dict[str, torch.Tensor]:
            with safe_open(str(path), framework="pt") as f:
                return {k: f.get_tensor(k) for k in keys}

        return shapes, read
    state = _read_model_file(path)
    return {k: v.shape for k, v in state.items()}, lambda keys: {k: state[k] for k in keys}


def _read_model_file(path: Path) -> dict[str, torch.Tensor]:
    """A full model state dict from a .safetensors or .pth file (no code runs on load)."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    obj = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    return obj.get("model_state", obj)


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a nested state dict (local shards of DTensors)."""
    if isinstance(obj, torch.Tensor):
        return [obj.to_local() if hasattr(obj, "to_local") else obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []
