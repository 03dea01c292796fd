"""Saving and restoring the whole training state with torch.distributed.checkpoint (DCP).

A checkpoint of step N holds the model and optimizer (DCP's .distcp files and .metadata, keys
`model_state` and `optimizer_state`), metadata.pth (step, tokens_seen, scheduler, world size, the
run's config) and one loader_state_<rank>.pth per data-parallel rank (data position, RNG; rank //
--tensor_parallel_size: a tensor-parallel group reads the same data). Every rank calls every
method. Collectives run on gloo groups of the checkpointer's own (under NCCL too), and a failure on
any rank is raised on every rank, so none is left waiting in a collective.
"""

from __future__ import annotations

import io
import os
import pickle
import time
from dataclasses import replace
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from fms_fsdp.checkpoint.disk import checkpoint_bytes, prune_for
from fms_fsdp.checkpoint.fused import FusingStager, fuse, fused_groups, unfuse_loaded_optimizer
from fms_fsdp.checkpoint.layout import (
    checkpoint_root,
    commit,
    complete_checkpoints,
    delete_checkpoint,
    start_save,
    step_folder,
    temp_folder,
)
from fms_fsdp.checkpoint.policy import KeepPolicy
from fms_fsdp.checkpoint.reader import model_reader, read_model, safe_reader, storage_writer
from fms_fsdp.config import to_dict, train_config
from fms_fsdp.distributed import DistInfo, on_rank0
from fms_fsdp.errors import CheckpointError, first_line
from fms_fsdp.lora import is_adapter
from fms_fsdp.models import split_full
from fms_fsdp.optim import keep_kernels
from fms_fsdp.storage import is_remote, local_copy, location, remove_tree, storage_error

# any failure of a save removes the unfinished folder and ends in one line on every rank; only write
# failures are skipped by --on_checkpoint_error=warn (see write_failure)
_SAVE_ERRORS = (Exception, dcp.CheckpointException)
_TORCH_WRITER_FAILURES = ("inline_container.cc", "PytorchStreamWriter failed")
_LOAD_ERRORS = (OSError, RuntimeError, KeyError, pickle.UnpicklingError, dcp.CheckpointException)
# a whole model from one file: read on rank 0 only, each rank receives its shards
_FROM_RANK0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def plain_tensor(value: torch.Tensor) -> torch.Tensor:
    """A state-dict tensor as checkpoints hold it: a wrapper subclass (the weights of float8 training
    with float8 all-gather) becomes the plain tensor it wraps, sharing its storage, so a checkpoint is
    the same with and without float8 and loads into either."""
    if isinstance(value, DTensor):
        local = plain_tensor(value._local_tensor)
        if local is value._local_tensor:
            return value
        return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False, shape=value.shape,
                                  stride=value.stride())
    if type(value) not in (torch.Tensor, torch.nn.Parameter) and hasattr(value, "__tensor_flatten__"):
        names, _ = value.__tensor_flatten__()
        return getattr(value, names[0])
    return value


class Checkpointer:
    """Saves the training state under <ckpt_save_path>/checkpoints and restores it."""

    def __init__(self, cfg: train_config, info: DistInfo, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: Any, loader: Any):
        self.cfg, self.info = cfg, info
        self.model, self.optimizer, self.scheduler, self.loader = model, optimizer, scheduler, loader
        self.root = checkpoint_root(cfg.ckpt_save_path)
        self.policy = KeepPolicy.parse(cfg.checkpoint_keep, cfg.checkpoint_keep_policy)
        self.group = dist.new_group(backend="gloo")
        # background saves run their collectives in another thread: a group of their own keeps them
        # from pairing up with this thread's collectives
        self.async_group = dist.new_group(backend="gloo") if cfg.async_checkpoint else None
        self.pending: Optional[tuple[int, Path, Future]] = None
        if info.is_main and is_remote(self.root):
            print(f"checkpoint: {self.root} is in object storage: the free-space guard does not apply there (no free "
                  "space to measure); unfinished saves are removed and --checkpoint_keep deletes old steps", flush=True)
        self.stager = staging_buffers(info.device) if cfg.async_checkpoint else None
        # with LoRA the frozen base is not saved: it comes from --ckpt_load_path at every start
        # (the loaded state then lacks the frozen keys: DCP's load already refused a checkpoint lacking others)
        self._options = StateDictOptions(ignore_frozen_params=bool(cfg.lora_rank), strict=not cfg.lora_rank)

    # ---------------------------------------------------------------- save

    def save(self, step: int, tokens_seen: int) -> float:
        """Write a checkpoint of `step`; returns the seconds training waited for it. A synchronous save
        is committed before it returns. With --async_checkpoint the tensors are written in the
        background: commit_pending() commits them once no rank is writing() any more."""
        start = time.monotonic()
        self.commit_pending()
        tmp = temp_folder(self.root, step)
        try:
            needed = checkpoint_bytes(self.model, self.optimizer, self.group)
            free = self._on_main(lambda: prune_for(self.root, needed, self.policy))
            if free < needed:
                raise CheckpointError(f"not enough space in {self.root} for a checkpoint: {free / 2**30:.2f} GiB free, "
                                      f"about {needed / 2**30:.2f} GiB needed; free space or set --ckpt_save_path")
            self._on_main(lambda: start_save(tmp))
            self._write_run_state(tmp, step, tokens_seen)
            own = self._own_state()
            if self.cfg.async_checkpoint:  # staged under the model's own names, then fused (fused.FusingStager)
                stager = FusingStager(self.stager) if fused_groups(own["model_state"]) else self.stager
                future = dcp.async_save(own, storage_writer=storage_writer(tmp), process_group=self.async_group,
                                        async_stager=stager)
                self.pending = (step, tmp, future)
            else:
                dcp.save(fuse(own), storage_writer=storage_writer(tmp), process_group=self.group)
                self._commit(step, tmp)
        except _SAVE_ERRORS as e:
            self._failed(tmp, e)
        return time.monotonic() - start

    def close(self) -> None:
        """Commit the background save, if any, and free the staging buffers."""
        self.commit_pending()
        if self.stager is not None:
            self.stager.close()
            self.stager = None

    def writing(self) -> bool:
        """Whether this rank's background save is still writing."""
        return self.pending is not None and not self.pending[2].done()

    def commit_pending(self) -> None:
        """Wait for the background save, if any, and commit it."""
        if self.pending is None:
            return
        step, tmp, future = self.pending
        self.pending = None
        error: Optional[BaseException] = None
        try:
            future.result()
        except _SAVE_ERRORS as e:
            error = e
        try:
            self._agree(error)
            self._commit(step, tmp)
        except _SAVE_ERRORS as e:
            self._failed(tmp, e)

    def _own_state(self) -> dict[str, Any]:
        """What a checkpoint holds of the model and optimizer (what trains: with LoRA, the adapters), under
        the model's own names; checkpoints hold it under fms's fused names (fused.fuse)."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._options)
        return tree_map_only(torch.Tensor, plain_tensor, {"model_state": model_sd, "optimizer_state": optim_sd})

    def _write_run_state(self, tmp: Path, step: int, tokens_seen: int) -> None:
        """This rank's loader position and RNG; on rank 0 also step, tokens, scheduler and config."""
        error: Optional[Exception] = None
        try:
            rank_state = {"loader": _to_torch(self.loader.state_dict()), "rng": torch.get_rng_state()}
            if self.info.device.type == "cuda":
                rank_state["cuda_rng"] = torch.cuda.get_rng_state(self.info.device)
            if self.info.rank % self.info.tp == 0:  # a tensor-parallel group reads the same data: one file
                _save_file(rank_state, tmp / f"loader_state_{self.info.dp_rank}.pth")
            if self.info.is_main:
                _save_file({"step": step, "tokens_seen": tokens_seen, "scheduler": self.scheduler.state_dict(),
                            "world_size": self.info.world_size, "config": to_dict(self.cfg)}, tmp / "metadata.pth")
        except Exception as e:  # agreed first, so no rank is left waiting in the next collective
            error = e
        self._agree(error)

    def _commit(self, step: int, tmp: Path) -> None:
        """Every rank has written its part: mark complete, rename into place, apply the keep policy."""
        dist.barrier(group=self.group)

        def files() -> None:
            commit(tmp, step_folder(self.root, step))
            print(f"checkpoint: saved {step_folder(self.root, step)}", flush=True)
            try:  # the new checkpoint is complete: a failure to delete an old one only warns
                for s in self.policy.to_delete([s for s, _ in complete_checkpoints(self.root)]):
                    delete_checkpoint(step_folder(self.root, s))
            except Exception as e:
                if not storage_error(e):
                    raise
                print(f"warning: cannot delete an old checkpoint in {self.root} ({type(e).__name__}: "
                      f"{first_line(e)}); it is kept", flush=True)

        self._on_main(files)

    def _failed(self, tmp: Path, error: BaseException) -> None:
        """Remove the unfinished save; stop the run, or warn with --on_checkpoint_error=warn when the
        save failed to write (any other failure, a bug or a lost peer, stops the run)."""
        if self.info.is_main:
            remove_tree(tmp)  # unmarked: in object storage the step folder itself
        cause = _root_cause(error)
        message = str(error) if isinstance(error, CheckpointError) else f"checkpoint save to {tmp.parent} failed: " + (
            first_line(cause) if write_failure(error) else f"{type(cause).__name__}: {first_line(cause)}")
        if self.cfg.on_checkpoint_error == "warn" and write_failure(error):
            if self.info.is_main:
                print(f"warning: {message}; training goes on (--on_checkpoint_error=warn)", flush=True)
            return
        raise CheckpointError(message) from None

    # ---------------------------------------------------------------- load

    def resume(self) -> Optional[tuple[int, int]]:
        """Restore the newest complete checkpoint (the previous one when it can't be read): (step,
        tokens_seen), or None when there is none. Rank 0 lists the candidates and every rank agrees on
        each attempt, so all resume from the same one."""
        names = on_rank0(lambda: [p.name for _, p in reversed(complete_checkpoints(self.root))], Exception,
                         lambda message: CheckpointError(f"cannot list the checkpoints in {self.root}: {message}"))
        last_error = ""
        for path in (self.root / name for name in names):
            error: Optional[BaseException] = None
            try:
                result = self._load(path)
            except _LOAD_ERRORS as e:
                error, last_error = e, first_line(e)
            if not self._failed_anywhere(error):
                return result
            if self.info.is_main:
                print(f"warning: cannot resume from {path} ({last_error or 'failed on another rank'}); "
                      "trying an older one", flush=True)
        if names:
            raise CheckpointError(f"no checkpoint under {self.root} can be read (last error: {last_error}); if this "
                                  "run's settings changed on purpose, start it with a new --ckpt_save_path")
        return None

    def _load(self, path: Path) -> tuple[int, int]:
        own = self._own_state()
        state = fuse(own)
        dcp.load(state, storage_reader=safe_reader(path), process_group=self.group)  # into `own` too
        if state is not own:
            unfuse_loaded_optimizer(state["optimizer_state"], own["optimizer_state"], fused_groups(own["model_state"]))
        kernels = self.optimizer.defaults.get("fused"), self.optimizer.defaults.get("foreach")
        set_state_dict(self.model, self.optimizer, model_state_dict=own["model_state"],
                       optim_state_dict=own["optimizer_state"], options=self._options)
        keep_kernels(self.optimizer, *kernels)
        meta = _load_file(path / "metadata.pth")
        base = meta.get("config", {}).get("ckpt_load_path")
        if self.cfg.lora_rank and base != self.cfg.ckpt_load_path:
            raise CheckpointError(f"{path} holds LoRA adapters of the base {base}, but --ckpt_load_path is now "
                                  f"{self.cfg.ckpt_load_path}; give the same base, or a new --ckpt_save_path")
        self.scheduler.load_state_dict(meta["scheduler"])
        ranks = sorted(path.glob("loader_state_*.pth"), key=lambda p: int(p.stem.rsplit("_", 1)[1]))
        rank_states = [_load_file(p) for p in ranks]
        self.loader.load_state_dict([r["loader"] for r in rank_states])  # every rank's: any world size
        if len(rank_states) == self.info.dp_size:
            mine = rank_states[self.info.dp_rank]
            torch.set_rng_state(mine["rng"])
            if "cuda_rng" in mine and self.info.device.type == "cuda":
                torch.cuda.set_rng_state(mine["cuda_rng"], self.info.device)
        if self.info.is_main:
            print(f"checkpoint: resumed from {path} at step {meta['step']}", flush=True)
        return int(meta["step"]), int(meta["tokens_seen"])

    def load_model(self, path: str) -> None:
        """Initialise the model only, from --ckpt_load_path: a checkpoint folder (this project's or
        fms-fsdp's), a Hugging Face Llama folder, or a .pth / .safetensors file holding the model.
        Single files and Hugging Face folders are read on rank 0 and broadcast."""
        from fms_fsdp.hf import check_hf_config, read_hf_config, read_hf_model

        p = location(path, "ckpt_load_path")
        try:
            found = p.exists()
        except Exception as e:  # object storage: no endpoint, no access
            raise CheckpointError(f"--ckpt_load_path: cannot read {path} "
                                  f"({type(e).__name__}: {first_line(e)})") from None
        if not found:
            raise CheckpointError(f"--ckpt_load_path: {path} does not exist")
        try:
            if p.is_dir() and (p / "config.json").is_file():
                check_hf_config(read_hf_config(p), self.model.config, str(p))  # on every rank: same verdict
                full = self._read_on_main(p, path, lambda local: read_hf_model(str(local), self.model.config))
                self._set_base(full, _FROM_RANK0)
            elif p.is_dir():
                model_reader(p)  # a folder without a whole model (a LoRA run's) is refused in one line
                own = {k: v for k, v in get_model_state_dict(self.model).items() if not is_adapter(k)}
                dcp.load(fuse({"model_state": own}), storage_reader=safe_reader(p), process_group=self.group)
                self._set_base(own, StateDictOptions())
            else:
                self._set_base(self._read_on_main(p, path, read_model), _FROM_RANK0)
        except CheckpointError:  # already one line naming the path (read on rank 0)
            raise
        except (pickle.UnpicklingError, ValueError) as e:  # including HFError: a config that does not fit
            raise CheckpointError(f"--ckpt_load_path: {path}: {e}") from None
        except (RuntimeError, KeyError, dcp.CheckpointException) as e:
            raise CheckpointError(f"--ckpt_load_path: {path} does not fit --model_variant={self.cfg.model_variant}"
                                  f" (vocab {self.model.config.src_vocab_size}): {first_line(e)}") from None
        if self.info.is_main:
            print(f"checkpoint: model initialised from {path}", flush=True)

    def _read_on_main(self, p: Path, path: str,
                      read: Callable[[Path], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """read() of --ckpt_load_path `path` (at `p`) on rank 0 (downloaded first from object storage:
        rank 0 reads it whole anyway), {} elsewhere; a failure is one CheckpointError on every rank,
        none left waiting."""
        box: list[dict[str, torch.Tensor]] = [{}]

        def work() -> None:
            try:
                with local_copy(p) as local:
                    box[0] = read(local)
            except Exception as e:
                if not (storage_error(e) or isinstance(e, (ValueError, pickle.UnpicklingError, CheckpointError))):
                    raise
                raise CheckpointError(first_line(e)) from None

        on_rank0(work, CheckpointError, lambda message: CheckpointError(f"--ckpt_load_path: {path}: {message}"))
        return box[0]

    def _set_base(self, state: dict[str, torch.Tensor], options: StateDictOptions) -> None:
        """Load the model's weights (a whole state dict with fused keys is cut to fit a model built
        unfused); only LoRA's adapters may be missing (they start from their init)."""
        result = set_model_state_dict(self.model, split_full(state, self.model), options=replace(options, strict=False))
        missing = [k for k in result.missing_keys if not is_adapter(k)]
        if missing or result.unexpected_keys:
            raise KeyError(f"missing {missing[:3]}, unexpected {list(result.unexpected_keys)[:3]}")

    # ---------------------------------------------------------------- agreement

    def _failed_anywhere(self, error: Optional[BaseException]) -> int:
        """The worst failure of any rank (every rank calls it): 0 none, 1 a write failure, 2 another."""
        failed = torch.tensor([0.0 if error is None else 1.0 if write_failure(error) else 2.0])
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.group)
        return int(failed[0])

    def _agree(self, error: Optional[BaseException]) -> None:
        """Raise on every rank if any rank failed; of the same kind (a write failure or not) everywhere."""
        worst = self._failed_anywhere(error)
        if not worst:
            return
        if error is None or (worst == 2 and write_failure(error)):
            error = OSError("another rank failed to write its part") if worst == 1 else \
                RuntimeError("another rank failed to save its part (not a write failure)")
        raise error

    def _on_main(self, work: Callable[[], Any]) -> float:
        """work() on rank 0 (file work: one writer), its numeric result on every rank; a storage error
        there (storage.storage_error) is raised on every rank."""
        result, error = torch.tensor([0.0], dtype=torch.float64), None
        if self.info.is_main:
            try:
                result[0] = float(work() or 0)
            except Exception as e:
                if not storage_error(e):
                    raise
                error = e
        self._agree(error)
        dist.broadcast(result, src=0, group=self.group)
        return float(result[0])


def staging_buffers(device: torch.device) -> DefaultStager:
    """Where a background save copies the state before writing it: CPU buffers allocated at the first
    save and reused by every later one (cached by tensor storage), pinned and filled by non-blocking
    copies on CUDA, so a save stalls training for one device-to-host copy."""
    cuda = device.type == "cuda"
    return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False,
                                        use_non_blocking_copy=cuda))


def _root_cause(error: BaseException) -> BaseException:
    """The first rank's exception inside a DCP CheckpointException; else `error`."""
    if isinstance(error, dcp.CheckpointException) and error.failures:
        return next(iter(error.failures.values()))[0]
    return error


def write_failure(error: BaseException) -> bool:
    """Whether a save failed to write its files (an I/O error, a full disk, in DCP's writer on any rank),
    as opposed to a bug or a lost peer. torch.save's file writer reports a failed write (a full disk
    too) as a RuntimeError from its C++ stream writer, not as an OSError."""
    if isinstance(error, dcp.CheckpointException):
        return bool(error.failures) and all(write_failure(e) for e, _ in error.failures.values())
    if isinstance(error, CheckpointError) or storage_error(error):
        return True
    return isinstance(error, RuntimeError) and any(where in str(error) for where in _TORCH_WRITER_FAILURES)


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
    """torch.save, flushed to disk (in object storage: one upload)."""
    with path.open("wb") as f:
        torch.save(obj, f)
        if not is_remote(path):
            f.flush()
            os.fsync(f.fileno())


def _load_file(path: Path) -> Any:
    """torch.load of a small file of the run state, local or in object storage, without running code."""
    with path.open("rb") as f:
        return torch.load(io.BytesIO(f.read()), weights_only=True)
