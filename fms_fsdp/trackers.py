"""Experiment trackers (--tracker): TensorBoard, Weights & Biases and Aim, one or several at once.

Rank 0 sends each tracker the records that go to metrics.jsonl, and the resolved config as
hyper-parameters. Each tracker's run id is kept in <ckpt_save_path>/tracker_runs.json, so a resumed
run (the same command again, or a requeued Slurm job) goes on in the same tracker run.
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

from fms_fsdp.atomic import write_text_atomic
from fms_fsdp.config import ConfigError, to_dict, train_config
from fms_fsdp.parallel import DistInfo, broadcast_from_rank0

RUN_IDS_FILE = "tracker_runs.json"


class TrackerError(RuntimeError):
    """A tracker that cannot start; the message is one actionable line."""


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def _flat_hparams(config: dict[str, Any]) -> dict[str, Any]:
    """Config values as TensorBoard hparams accept them: numbers, strings and bools."""
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in config.items()}


class TensorBoardTracker:
    """Event files under <tracker_dir>/tensorboard/<run id>. The writer starts at the first logged
    step, purging what an interrupted earlier attempt logged from that step on."""

    def __init__(self, folder: Path, config: dict[str, Any]):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.config = folder, config
        self.writer: Any = None

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.folder), purge_step=step)
            self.writer.add_hparams(_flat_hparams(self.config), {}, run_name=".")
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandbTracker:
    """A W&B run in <tracker_dir>/wandb, resumed by id; WANDB_MODE=offline works without a network
    (upload later with `wandb sync`)."""

    def __init__(self, folder: Path, project: str, run_id: str, config: dict[str, Any]):
        import wandb

        folder.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(project=project, dir=str(folder), id=run_id, resume="allow", config=config,
                                  allow_val_change=True)
        except Exception as e:  # wandb raises its own error types for login, network and bad ids
            raise TrackerError(f"--tracker=wandb: {str(e).splitlines()[0].rstrip('.')} (WANDB_MODE=offline logs "
                               "without a network or an account)") from None

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class AimTracker:
    """An Aim run in the repository <tracker_dir> (created when missing), resumed by its hash."""

    def __init__(self, folder: Path, project: str, run_hash: Optional[str], config: dict[str, Any]):
        import aim

        folder.mkdir(parents=True, exist_ok=True)
        try:
            self.run = aim.Run(run_hash=run_hash, repo=str(folder), experiment=project,
                               system_tracking_interval=None, capture_terminal_logs=False)
        except Exception as e:  # e.g. MissingRunError for a hash not in this repository
            raise TrackerError(f"--tracker=aim: {str(e).splitlines()[0]}") from None
        self.run["hparams"] = config

    @property
    def run_id(self) -> str:
        return self.run.hash

    def log(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.run.track(value, name=name, step=step)

    def close(self) -> None:
        self.run.close()


class Trackers:
    """The trackers of this run (none on ranks other than 0). A tracker that fails while logging is
    reported once and dropped: training and metrics.jsonl go on."""

    def __init__(self, trackers: dict[str, Tracker]):
        self.trackers = trackers

    def log(self, record: dict[str, Any]) -> None:
        metrics = {k: float(v) for k, v in record.items() if k != "step"}
        for name, tracker in list(self.trackers.items()):
            self._guard(name, lambda: tracker.log(metrics, record["step"]))

    def close(self) -> None:
        for name, tracker in list(self.trackers.items()):
            self._guard(name, tracker.close)
        self.trackers = {}

    def _guard(self, name: str, call: Callable[[], None]) -> None:
        try:
            call()
        except Exception as e:
            print(f"warning: --tracker={name} failed and is switched off: {str(e).splitlines()[0]}",
                  file=sys.stderr, flush=True)
            self.trackers.pop(name, None)


def _load_run_ids(path: Path) -> dict[str, str]:
    if not path.exists():
        return {}
    try:
        ids = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise TrackerError(f"{path} is not valid JSON; delete it to start new tracker runs") from None
    if not isinstance(ids, dict):
        raise TrackerError(f"{path} must map tracker names to run ids; delete it to start new tracker runs")
    return ids


def open_trackers(cfg: train_config) -> Trackers:
    """Start (or resume) every tracker in --tracker. Call on rank 0 only; raises TrackerError."""
    if not cfg.tracker:
        return Trackers({})
    folder = Path(cfg.tracker_dir or Path(cfg.ckpt_save_path) / "tracker")
    ids_path = Path(cfg.ckpt_save_path) / RUN_IDS_FILE
    ids = _load_run_ids(ids_path)
    if cfg.tracker_run_id:
        ids = {name: cfg.tracker_run_id for name in cfg.tracker}
    config = to_dict(cfg)
    trackers: dict[str, Tracker] = {}
    try:
        for name in cfg.tracker:
            if name == "tensorboard":
                ids.setdefault(name, uuid.uuid4().hex[:12])
                trackers[name] = TensorBoardTracker(folder / "tensorboard" / ids[name], config)
            elif name == "wandb":
                ids.setdefault(name, uuid.uuid4().hex[:12])
                trackers[name] = WandbTracker(folder, cfg.tracker_project_name, ids[name], config)
            else:
                aim_tracker = AimTracker(folder, cfg.tracker_project_name, ids.get(name), config)
                ids[name] = aim_tracker.run_id
                trackers[name] = aim_tracker
        write_text_atomic(ids_path, json.dumps(ids, indent=1) + "\n")
    except OSError as e:
        Trackers(trackers).close()
        raise TrackerError(f"--tracker_dir={folder}: {e.strerror or e}") from None
    except TrackerError:
        Trackers(trackers).close()
        raise
    return Trackers(trackers)


def start_trackers(cfg: train_config, info: DistInfo) -> Trackers:
    """open_trackers on rank 0; a tracker that cannot start stops every rank with one ConfigError."""
    trackers, error = Trackers({}), None
    if info.is_main:
        try:
            trackers = open_trackers(cfg)
        except TrackerError as e:
            error = str(e)
    error = broadcast_from_rank0(error)
    if error is not None:
        raise ConfigError(error)
    return trackers
