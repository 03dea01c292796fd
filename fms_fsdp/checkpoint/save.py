"""Saving the whole training state with torch.distributed.checkpoint (DCP): `CheckpointSaver`, the
saving part of checkpointer.py's `Checkpointer` (whose other part restores it), as the run's
`CheckpointSettings` say.

A save of step N is written under a temporary folder (DCP's files of the model and optimizer,
metadata.pth, one loader_state_<rank>.pth per data-parallel rank; see checkpointer.py), synchronously or in the
background (--async_checkpoint), after the free-space guard; it is committed (marked complete, renamed
into place, the keep policy applied) only once every rank has written its part. A failure on any rank
is raised on every rank, of the same kind (`agree`), and the unfinished folder is removed; only a
failure to write its files (`write_failure`) is skipped by --on_checkpoint_error=warn.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from fms_fsdp.checkpoint.disk import checkpoint_bytes, prune_for
from fms_fsdp.checkpoint.layout import (
    commit,
    complete_checkpoints,
    delete_checkpoint,
    start_save,
    step_folder,
    temp_folder,
)
from fms_fsdp.checkpoint.settings import CheckpointSettings
from fms_fsdp.checkpoint.writer import BackgroundWriter
from fms_fsdp.compat import tree_map_only
from fms_fsdp.errors import CheckpointError, TrainingError, first_line
from fms_fsdp.parallel.process_group import DistInfo, agreement_group, failures, on_rank0
from fms_fsdp.storage import is_remote, remove_tree, storage_error
from fms_fsdp.versions import stamp
from fms_fsdp.weights.ema import WeightAverage
from fms_fsdp.weights.fused import fuse, plain_tensor
from fms_fsdp.weights.reader import root_cause, storage_writer

# any failure of a save removes the unfinished folder and ends in one line on every rank; only write
# failures are skipped by --on_checkpoint_error=warn (see write_failure)
_SAVE_ERRORS = (Exception, dcp.CheckpointException)
_TORCH_WRITER_FAILURES = ("inline_container.cc", "PytorchStreamWriter failed")


class Lease(Protocol):
    """The run's hold on its folder, confirmed on rank 0 before each save (resilience/lease.py's RunLease)."""

    def confirm(self) -> None: ...


class GroupState(Protocol):
    """State kept beside each rank's data position (--fault_tolerance's replica group: resilience/ft.py)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class CheckpointSaver:
    """Saves the training state (model, optimizer, scheduler, data loader) under `root`, as `settings` say;
    `config` (the run's flags) and what wrote it (versions.py: the layout, the package's version and commit) go
    into each checkpoint's metadata.pth, `log` takes rank 0's lines."""

    def __init__(
        self,
        *,
        settings: CheckpointSettings,
        root: Path,
        info: DistInfo,
        config: dict[str, Any],
        log: Callable[[str], None],
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        loader: Any,
        lease: Optional[Lease] = None,
        ft: Optional[GroupState] = None,
        average: Optional[WeightAverage] = None,
    ):
        self.settings, self.root, self.info, self.config, self.log = settings, root, info, config, log
        self.lease = lease  # confirmed (on rank 0) before each save
        self.model, self.optimizer, self.scheduler, self.loader = model, optimizer, scheduler, loader
        self.ft = ft  # --fault_tolerance: every group's data position is kept with this rank's
        self.average = average  # --ema_decay: saved as `ema_state`, under the model's names
        self.pending: Optional[tuple[int, Path, Future]] = None
        self.scores: dict[int, float] = {}  # --checkpoint_monitor by step (rank 0; --checkpoint_keep_best)
        self.written_by = stamp() if info.is_main else {}  # the layout, package version and commit
        if is_remote(self.root):
            log(
                f"checkpoint: {self.root} is in object storage: the free-space guard does not apply there (no "
                "free space to measure); unfinished saves are removed and --checkpoint_keep deletes old steps"
            )
        self.writer = BackgroundWriter(info.device) if self.settings.background else None
        # with LoRA the frozen base is not saved: it comes from --ckpt_load_path at every start
        # (the loaded state then lacks the frozen keys: DCP's load already refused a checkpoint lacking others)
        self.options = StateDictOptions(ignore_frozen_params=self.settings.lora, strict=not self.settings.lora)

    # ---------------------------------------------------------------- save

    def save(self, step: int, tokens_seen: int) -> float:
        """Write a checkpoint of `step`; returns the seconds training waited for it. A synchronous save
        is written when it returns and committed by commit_written(), once the step's metrics record is
        out (a kill just after the commit then loses no record). With --async_checkpoint the tensors are
        written in the background: commit_pending() commits them once no rank is writing() any more."""
        start = time.monotonic()
        self.commit_pending()
        if self.lease is not None:  # a run whose folder was taken over stops without touching it
            on_rank0(self.lease.confirm, TrainingError, TrainingError)
        tmp = temp_folder(self.root, step)
        try:
            needed = checkpoint_bytes(self.model, self.optimizer, agreement_group(), self.average is not None)
            free = on_main(self.info, lambda: prune_for(self.root, needed, self.settings.policy, self.scores))
            if free < needed:
                raise CheckpointError(
                    f"not enough space in {self.root} for a checkpoint: {free / 2**30:.2f} GiB free, "
                    f"about {needed / 2**30:.2f} GiB needed; free space or set --ckpt_save_path"
                )
            on_main(self.info, lambda: start_save(tmp))
            self._write_run_state(tmp, step, tokens_seen)
            own = self.own_state()
            if self.writer is not None:  # staged under the model's own names, then fused (fused.FusingStager)
                self.pending = (step, tmp, self.writer.write(own, tmp))
            else:
                dcp.save(fuse(own), storage_writer=storage_writer(tmp), process_group=agreement_group())
                written: Future = Future()
                written.set_result(None)
                self.pending = (step, tmp, written)
        except _SAVE_ERRORS as e:
            self._failed(tmp, e)
        return time.monotonic() - start

    def finish(self) -> None:
        """Commit the background save, if any (every rank calls it)."""
        self.commit_pending()

    def close(self) -> None:
        """Free the staging buffers (no collective: also on the way out of a failed run)."""
        if self.writer is not None:
            self.writer.close()

    def writing(self) -> bool:
        """Whether this rank's background save is still writing."""
        return self.pending is not None and not self.pending[2].done()

    def commit_written(self) -> float:
        """Commit the synchronous save that save() wrote, if any; returns the seconds it took. A
        background save is left to commit_pending()."""
        if self.writer is not None:
            return 0.0
        start = time.monotonic()
        self.commit_pending()
        return time.monotonic() - start

    def commit_pending(self) -> None:
        """Wait for the save being written, if any, and commit it."""
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
            agree(error)
            self._commit(step, tmp)
        except _SAVE_ERRORS as e:
            self._failed(tmp, e)

    def own_state(self) -> dict[str, Any]:
        """What a checkpoint holds of the model and optimizer (what trains: with LoRA, the adapters), under
        the model's own names; checkpoints hold it under fms's fused names (fused.fuse)."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self.options)
        state = {"model_state": model_sd, "optimizer_state": optim_sd}
        if self.average is not None:
            state["ema_state"] = self.average.state_dict()
        return tree_map_only(torch.Tensor, plain_tensor, state)

    def _write_run_state(self, tmp: Path, step: int, tokens_seen: int) -> None:
        """This rank's loader position and RNG; on rank 0 also step, tokens, scheduler and config."""
        error: Optional[Exception] = None
        try:
            rank_state = {"loader": _to_torch(self.loader.state_dict()), "rng": torch.get_rng_state()}
            if self.ft is not None:
                rank_state["ft"] = self.ft.state_dict()
            if self.info.device.type == "cuda":
                rank_state["cuda_rng"] = torch.cuda.get_rng_state(self.info.device)
            # a tensor- (context-) parallel group reads the same data, as do the pipeline's stages: one file
            if self.info.writes_data_state:
                _save_file(rank_state, tmp / f"loader_state_{self.info.dp_rank}.pth")
            if self.info.is_main:
                _save_file(
                    {
                        "step": step,
                        "tokens_seen": tokens_seen,
                        "scheduler": self.scheduler.state_dict(),
                        "world_size": self.info.world_size,
                        "config": self.config,
                        **self.written_by,
                    },
                    tmp / "metadata.pth",
                )
        except Exception as e:  # agreed first, so no rank is left waiting in the next collective
            error = e
        agree(error)

    def _commit(self, step: int, tmp: Path) -> None:
        """Every rank has written its part: mark complete, rename into place, apply the keep policy."""
        dist.barrier(group=agreement_group())

        def files() -> None:
            commit(tmp, step_folder(self.root, step))
            print(f"checkpoint: saved {step_folder(self.root, step)}", flush=True)
            self.prune()

        on_main(self.info, files)

    def prune(self) -> None:
        """Delete the complete checkpoints the keep policy no longer keeps (rank 0's file work: after each
        commit, and after each new score); a failure to delete only warns."""
        try:
            steps = [s for s, _ in complete_checkpoints(self.root)]
            for s in self.settings.policy.to_delete(steps, self.scores):
                delete_checkpoint(step_folder(self.root, s))
        except Exception as e:
            if not storage_error(e):
                raise
            print(
                f"warning: cannot delete an old checkpoint in {self.root} ({type(e).__name__}: "
                f"{first_line(e)}); it is kept",
                flush=True,
            )

    def _failed(self, tmp: Path, error: BaseException) -> None:
        """Remove the unfinished save; stop the run, or warn with --on_checkpoint_error=warn when the
        save failed to write (any other failure, a bug or a lost peer, stops the run)."""
        if self.info.is_main:
            try:
                remove_tree(tmp)  # unmarked: in object storage the step folder itself
            except Exception as e:  # the disk that failed the save may fail this too: the next save retries
                if not storage_error(e):
                    raise
        cause = root_cause(error)
        message = (
            str(error)
            if isinstance(error, CheckpointError)
            else f"checkpoint save to {tmp.parent} failed: "
            + (first_line(cause) if write_failure(error) else f"{type(cause).__name__}: {first_line(cause)}")
        )
        if self.settings.on_error == "warn" and write_failure(error):
            self.log(f"warning: {message}; training goes on (--on_checkpoint_error=warn)")
            return
        raise CheckpointError(message) from None


def on_main(info: DistInfo, work: Callable[[], Any]) -> float:
    """work() on rank 0 (file work: one writer), its numeric result on every rank; a failure there is
    raised on every rank, of its kind (agree: a storage error is a write failure)."""
    result, error = torch.zeros(1, dtype=torch.float64), None
    if info.is_main:
        try:
            result[0] = float(work() or 0)
        except Exception as e:
            error = e
    agree(error)
    dist.broadcast(result, src=0, group=agreement_group())
    return float(result[0])


def agree(error: Optional[BaseException]) -> None:
    """Raise on every rank if any rank failed (every rank calls it), an error of the same kind
    everywhere: a write failure (see write_failure) only when every failure was one; a rank that did
    not fail raises the failing rank's line."""
    found = [
        (rank, f)
        for rank, f in enumerate(failures(error, lambda e: "write" if write_failure(e) else "other"))
        if f is not None
    ]
    if not found:
        return
    kind = "other" if any(f[0] == "other" for _, f in found) else "write"
    if error is not None and (kind == "write") == write_failure(error):
        raise error
    rank, (_, message) = next((r, f) for r, f in found if f[0] == kind)
    if kind == "write":
        raise OSError(f"rank {rank} failed to write its part: {message}")
    raise RuntimeError(f"rank {rank} failed to save its part: {message}")


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
