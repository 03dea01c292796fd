"""Saving and restoring the whole training state with torch.distributed.checkpoint (DCP): `Checkpointer`
puts together save.py's `CheckpointSaver` and this module's `CheckpointRestorer` (the start of a run, resume).

A checkpoint of step N holds the model and optimizer (DCP's .distcp files and .metadata, keys
`model_state` and `optimizer_state`), metadata.pth (step, tokens_seen, scheduler, world size, the
run's config, and what wrote it: fms_fsdp/versions.py) and one loader_state_<rank>.pth per data-parallel rank (data position, RNG; rank //
--tensor_parallel_size: a tensor-parallel group reads the same data). Every rank calls every
method. Collectives run on the ranks' agreement group (gloo, under NCCL too; background saves on
the writer's own), and a failure on any rank is raised on every rank, so none is left waiting in a
collective. `start` owns the order of a run's beginning: the newest checkpoint, else the weights of
--ckpt_load_path (weights/load.py), which a LoRA run loads at every start (its checkpoints hold only the
adapters).
"""

from __future__ import annotations

import io
import json
import pickle
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import set_state_dict

from fms_fsdp.checkpoint.layout import complete_checkpoints, set_aside
from fms_fsdp.checkpoint.save import CheckpointSaver, on_main
from fms_fsdp.errors import CheckpointError, first_line
from fms_fsdp.optim import keep_kernels, load_low_bit_states, set_learning_rates, state_dtype
from fms_fsdp.parallel.process_group import agreement_group, failures, on_rank0
from fms_fsdp.storage import storage_error
from fms_fsdp.versions import check_layout
from fms_fsdp.weights.fused import fuse, fused_groups, unfuse_loaded_optimizer
from fms_fsdp.weights.load import load_weights
from fms_fsdp.weights.reader import damage, safe_reader, unreadable

_LOAD_ERRORS = (OSError, EOFError, RuntimeError, KeyError, pickle.UnpicklingError, dcp.CheckpointException)


def earlier_scores(metrics: Path, monitor: str, until: int) -> dict[int, float]:
    """`monitor` by step from a resumed run's metrics.jsonl, up to step `until` (unreadable lines and a
    missing file give nothing)."""
    try:
        lines = metrics.read_text().splitlines() if metrics.exists() else []
    except Exception as e:  # fsspec filesystems raise their clients' own errors too
        if not storage_error(e):
            raise
        lines = []
    scores = {}
    for line in lines:
        try:
            record = json.loads(line)
            step, value = int(record["step"]), float(record[monitor])
        except (ValueError, KeyError, TypeError):
            continue
        if step <= until:
            scores[step] = value
    return scores


class Checkpointer:
    """The training state's checkpoints: saved by `saver` (CheckpointSaver, save.py), restored at the start
    by a CheckpointRestorer of the same state. `metrics` is the run's metrics.jsonl (a resumed run's
    evaluations rank its kept checkpoints), `variant` its --model_variant (to read --ckpt_load_path's
    weights)."""

    def __init__(self, *, saver: CheckpointSaver, metrics: Path, variant: str):
        self.saver, self.metrics = saver, metrics
        self.restorer = CheckpointRestorer(saver, variant)

    def start(self) -> tuple[int, int]:
        """(step, tokens_seen) to go on from: the newest checkpoint's, else (0, 0) with the model's
        weights from --ckpt_load_path when given (a LoRA run's base is loaded first, at every start)."""
        saver = self.saver
        resumed = self.restorer.start()
        if saver.average is not None and not self.restorer.averaged:  # a start, or a checkpoint without one
            saver.average.reset()
        if resumed is not None and saver.settings.policy.best and saver.info.is_main:
            saver.scores = earlier_scores(self.metrics, saver.settings.policy.monitor, resumed[0])
        return resumed or (0, 0)

    def scored(self, step: int, record: dict[str, Any]) -> None:
        """An evaluation at `step`: its --checkpoint_monitor ranks that step's checkpoint (rank 0)."""
        saver = self.saver
        monitor = saver.settings.policy.monitor
        if not saver.settings.policy.best or not saver.info.is_main:
            return
        if monitor not in record:
            kind = "harness/" if monitor.startswith("harness/") else "eval_"
            if not saver.scores and any(k.startswith(kind) for k in record):  # the monitor's kind of record
                names = ", ".join(k for k in record if k.startswith(("eval_loss", "eval_ppl", "harness/")))
                saver.log(
                    f"warning: --checkpoint_monitor={monitor} is not among the evaluation's metrics ({names}): "
                    "no checkpoint is kept as best"
                )
            return
        saver.scores[step] = float(record[monitor])
        saver.prune()  # the best may have changed: a checkpoint kept only as the best so far goes now

    def save(self, step: int, tokens_seen: int) -> float:
        return self.saver.save(step, tokens_seen)

    def writing(self) -> bool:
        return self.saver.writing()

    def commit_written(self) -> float:
        return self.saver.commit_written()

    def commit_pending(self) -> None:
        self.saver.commit_pending()

    def finish(self) -> None:
        self.saver.finish()

    def close(self) -> None:
        self.saver.close()


class CheckpointRestorer:
    """Restores what `saver` saves: the newest readable checkpoint under its root, else the weights of
    --ckpt_load_path (read for the model variant `variant`)."""

    def __init__(self, saver: CheckpointSaver, variant: str):
        self.saver, self.variant = saver, variant
        self.settings, self.root, self.info, self.ft = saver.settings, saver.root, saver.info, saver.ft
        self.model, self.optimizer, self.scheduler, self.loader = (
            saver.model,
            saver.optimizer,
            saver.scheduler,
            saver.loader,
        )
        self.log: Callable[[str], None] = saver.log
        self.averaged = False  # the weight average (--ema_decay) came from a checkpoint

    def start(self) -> Optional[tuple[int, int]]:
        """The newest checkpoint restored: (step, tokens_seen); else None, with the model's weights from
        --ckpt_load_path when given (a LoRA run's base is loaded first, at every start)."""
        if self.settings.lora:
            self.load_weights()
        resumed = self.resume()
        if resumed is None and self.settings.load_path and not self.settings.lora:
            self.load_weights()
        return resumed

    def load_weights(self) -> None:
        """The model's weights from --ckpt_load_path (weights/load.py)."""
        assert self.settings.load_path is not None
        load_weights(self.model, self.settings.load_path, self.variant)
        self.log(f"checkpoint: model initialised from {self.settings.load_path}")

    # ---------------------------------------------------------------- load

    def resume(self) -> Optional[tuple[int, int]]:
        """Restore the newest complete checkpoint (the previous one when it can't be read): (step,
        tokens_seen), or None when there is none. Rank 0 lists the candidates and every rank agrees on
        each attempt, so all resume from the same one."""
        names = on_rank0(self._candidates, CheckpointError, CheckpointError)
        last_error = ""
        for k, path in enumerate(self.root / name for name in names):
            error: Optional[BaseException] = None
            try:
                result = self._load(path)
            except _LOAD_ERRORS as e:
                error = e
            found = [(rank, f[1]) for rank, f in enumerate(failures(error)) if f is not None]
            if not found:
                on_main(self.info, partial(self._set_aside, names[:k]))
                return result
            last_error = first_line(error) if error is not None else f"rank {found[0][0]}: {found[0][1]}"
            if k + 1 < len(names):
                self.log(f"warning: cannot resume from {path} ({last_error}); trying {self.root / names[k + 1]}")
        if names:
            raise CheckpointError(
                f"no checkpoint under {self.root} can be read (last error: {last_error}); if this "
                "run's settings changed on purpose, start it with a new --ckpt_save_path"
            )
        return None

    def _candidates(self) -> list[str]:
        """The complete checkpoints' names, newest first; CheckpointError when they cannot be listed, or when
        the newest has a layout newer than this code reads (refused: never set aside for an older one)."""
        try:
            names = [p.name for _, p in reversed(complete_checkpoints(self.root))]
        except Exception as e:  # fsspec filesystems raise their clients' own errors too
            raise CheckpointError(f"cannot list the checkpoints in {self.root}: {first_line(e)}") from None
        if names:
            newest = self.root / names[0]
            try:
                meta = _load_file(newest / "metadata.pth")
            except CheckpointError:  # damaged: the resume says so and goes on to the one before
                return names
            check_layout(meta, newest)
            saved, now = _saved_state_dtype(meta), state_dtype(self.optimizer)
            if saved != now:  # a checkpoint holds fp32 states either way (fused.plain_tensor)
                self.log(f"checkpoint: {newest} kept its optimizer states in {saved}; they load into {now} ones")
        return names

    def _set_aside(self, names: list[str]) -> None:
        """Rename the newer checkpoints that could not be read, so that the keep policy never deletes
        the one resumed from in their favour (kept whole, for a look)."""
        for name in names:
            moved = set_aside(self.root / name)
            if moved is not None:
                print(f"checkpoint: {self.root / name} cannot be read: kept as {moved}", flush=True)

    def _load(self, path: Path) -> tuple[int, int]:
        own = self.saver.own_state()
        if "ema_state" in own and not _holds(path, "ema_state"):  # --ema_decay turned on for this resume
            del own["ema_state"]
            self.log(f"checkpoint: {path} holds no weight average: --ema_decay's starts at its weights")
        meta = _load_file(path / "metadata.pth")
        state = fuse(own)
        # written with the other --optimizer_state_dtype: its groups' settings are another optimizer's
        switched = _saved_state_dtype(meta) != state_dtype(self.optimizer)
        settings = [_only_params(group) for group in state["optimizer_state"]["param_groups"]] if switched else []
        # the parameter names of this rank's optimizer groups: a checkpoint holds one rank's lists (DCP
        # keeps one copy of what is not a tensor), which under pipeline parallelism name other stages'
        names = [group["params"] for group in own["optimizer_state"]["param_groups"]]
        try:
            dcp.load(state, storage_reader=safe_reader(path), process_group=agreement_group())  # into `own` too
        except _LOAD_ERRORS as e:
            if not unreadable(e):
                raise
            raise CheckpointError(damage(e, path)) from None
        for group, params in zip(own["optimizer_state"]["param_groups"], names):
            group["params"] = params
        for group, kept in zip(own["optimizer_state"]["param_groups"], settings):
            group.update(kept)  # this run's, the learning rate set from the scheduler below
        if state is not own:
            unfuse_loaded_optimizer(state["optimizer_state"], own["optimizer_state"], fused_groups(own["model_state"]))
        load_low_bit_states(self.optimizer, own["optimizer_state"])
        kernels = self.optimizer.defaults.get("fused"), self.optimizer.defaults.get("foreach")
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=own["model_state"],
            optim_state_dict=own["optimizer_state"],
            options=self.saver.options,
        )
        keep_kernels(self.optimizer, *kernels)
        base = meta.get("config", {}).get("ckpt_load_path")
        if self.settings.lora and base != self.settings.load_path:
            raise CheckpointError(
                f"{path} holds LoRA adapters of the base {base}, but --ckpt_load_path is now "
                f"{self.settings.load_path}; give the same base, or a new --ckpt_save_path"
            )
        self.scheduler.load_state_dict(meta["scheduler"])
        if switched:
            set_learning_rates(self.optimizer, self.scheduler.get_last_lr())
        self._load_rank_states(path)
        self.averaged = "ema_state" in own
        self.log(f"checkpoint: resumed from {path} at step {meta['step']}")
        return int(meta["step"]), int(meta["tokens_seen"])

    def _load_rank_states(self, path: Path) -> None:
        """The loader's position (every rank's, for any world size) and, at the same size, this rank's RNG
        and fault-tolerance state."""
        ranks = sorted(path.glob("loader_state_*.pth"), key=lambda p: int(p.stem.rsplit("_", 1)[1]))
        rank_states = [_load_file(p) for p in ranks]
        loaders = [r["loader"] for r in rank_states]  # every rank's: any world size
        if self.ft is not None and len(loaders) == self.info.dp_size:  # a replica group's own ranks
            self.loader.load_state_dict(loaders[self.info.dp_rank])
        else:
            self.loader.load_state_dict(loaders)
        if len(rank_states) == self.info.dp_size:
            mine = rank_states[self.info.dp_rank]
            if self.ft is not None and "ft" in mine:
                self.ft.load_state_dict(mine["ft"])
            torch.set_rng_state(mine["rng"])
            if "cuda_rng" in mine and self.info.device.type == "cuda":
                torch.cuda.set_rng_state(mine["cuda_rng"], self.info.device)


def _saved_state_dtype(meta: dict[str, Any]) -> str:
    """The --optimizer_state_dtype a checkpoint's optimizer had (fp32 before the flag existed)."""
    return meta.get("config", {}).get("optimizer_state_dtype", "fp32")


def _only_params(group: dict[str, Any]) -> dict[str, Any]:
    """Leave a param group to load only its parameters' names; returns its other entries, removed."""
    settings = {k: v for k, v in group.items() if k != "params"}
    for key in settings:
        del group[key]
    return settings


def _holds(path: Path, key: str) -> bool:
    """Whether the DCP checkpoint at `path` holds state under `key` (a CheckpointError when unreadable)."""
    try:
        names = safe_reader(path).read_metadata().state_dict_metadata
    except _LOAD_ERRORS as e:
        if not unreadable(e):
            raise
        raise CheckpointError(damage(e, path)) from None
    return any(name.startswith(f"{key}.") for name in names)


def newest_metadata(root: Path) -> Optional[dict[str, Any]]:
    """The run state the newest complete checkpoint under `root` recorded: its step, tokens_seen and
    flags (`config`), among others (None: no checkpoint, or one that cannot be read, which the resume
    itself reports)."""
    try:
        found = complete_checkpoints(root)
        return _load_file(found[-1][1] / "metadata.pth") if found else None
    except Exception:  # fsspec filesystems raise their clients' own errors too; the resume reports them
        return None


def _load_file(path: Path) -> Any:
    """torch.load of a small file of the run state, local or in object storage, without running code;
    CheckpointError naming it when it is missing or damaged."""
    try:
        with path.open("rb") as f:
            return torch.load(io.BytesIO(f.read()), weights_only=True)
    except _LOAD_ERRORS as e:
        if not unreadable(e):
            raise
        raise CheckpointError(f"{path}: {damage(e)}") from None
