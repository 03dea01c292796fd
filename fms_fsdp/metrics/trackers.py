"""Experiment trackers (--tracker): TensorBoard, Weights & Biases, Aim and MLflow, one or several at once.

Rank 0 sends each tracker the records that go to metrics.jsonl, and the resolved config as
hyper-parameters. Each tracker's run id is kept in <ckpt_save_path>/tracker_runs.json, so a resumed
run (the same command again, or a requeued Slurm job) goes on in the same tracker run. A tracker that
cannot start stops a new run at start-up; a resumed run warns and goes on without it, so that a
requeued job is never lost to a tracker.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Protocol

from fms_fsdp.atomic import write_text_atomic
from fms_fsdp.errors import ConfigError, TrackerError, first_line
from fms_fsdp.parallel.process_group import on_rank0

RUN_IDS_FILE = "tracker_runs.json"


@dataclass(frozen=True, kw_only=True)
class TrackerSettings:
    """--tracker and its flags, and the resolved config the trackers record as hyper-parameters (built
    once: settings.py)."""

    names: tuple[str, ...]  # --tracker
    project: str  # --tracker_project_name
    folder: Optional[str]  # --tracker_dir
    run_id: Optional[str]  # --tracker_run_id
    config: dict[str, Any]  # every flag's value


class Tracker(Protocol):
    """A tracker's run. One that also has `log_text(texts: dict[str, str], step)` gets a record's text
    values (the slowest rank's host); the others get its numbers only."""

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self, failed: bool) -> None: ...


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

    def log_text(self, texts: dict[str, str], step: int) -> None:
        for name, value in texts.items():
            self.writer.add_text(name, value, step)
        self.writer.flush()

    def close(self, failed: bool) -> None:
        if self.writer is not None:
            self.writer.close()


class WandbTracker:
    """A W&B run in <tracker_dir>/wandb, resumed by id; WANDB_MODE=offline works without a network
    (upload later with `wandb sync`)."""

    def __init__(self, folder: Path, project: str, run_id: str, config: dict[str, Any]):
        import wandb

        folder.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(
                project=project, dir=str(folder), id=run_id, resume="allow", config=config, allow_val_change=True
            )
        except (wandb.errors.Error, OSError) as e:  # login, network, a bad id
            raise TrackerError(
                f"--tracker=wandb: {first_line(e).rstrip('.')} (WANDB_MODE=offline logs "
                "without a network or an account)"
            ) from None

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_text(self, texts: dict[str, str], step: int) -> None:
        self.run.log(texts, step=step)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class AimTracker:
    """An Aim run in the repository <tracker_dir> (created when missing), resumed by its hash."""

    def __init__(self, folder: Path, project: str, run_hash: Optional[str], config: dict[str, Any], take_over: bool):
        import aim
        from aim.sdk.errors import MissingRunError, RepoIntegrityError, RunLockingError

        folder.mkdir(parents=True, exist_ok=True)
        try:
            # take_over: the lock of an earlier attempt of this run killed on another node never goes stale
            self.run = aim.Run(
                run_hash=run_hash,
                repo=str(folder),
                experiment=project,
                force_resume=take_over,
                system_tracking_interval=None,
                capture_terminal_logs=False,
            )
            self.run["hparams"] = config
        except (MissingRunError, RepoIntegrityError, RunLockingError) as e:
            raise TrackerError(f"--tracker=aim: {first_line(e)}") from None

    @property
    def run_id(self) -> str:
        return self.run.hash

    def log(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.run.track(value, name=name, step=step)

    def log_text(self, texts: dict[str, str], step: int) -> None:
        import aim

        for name, value in texts.items():
            self.run.track(aim.Text(value), name=name, step=step)

    def close(self, failed: bool) -> None:
        self.run.close()


class MLflowTracker:
    """An MLflow run in the experiment --tracker_project_name, on the server of MLFLOW_TRACKING_URI or
    else in the local store <tracker_dir>/mlflow/mlflow.db; resumed by its run id. The config goes in
    as params, which MLflow never changes: a resumed run keeps the values it started with."""

    def __init__(self, folder: Path, project: str, run_id: Optional[str], config: dict[str, Any]):
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        local = folder / "mlflow"
        if not uri:
            local.mkdir(parents=True, exist_ok=True)
        self._set_here = _mlflow_fails_fast()
        try:
            self.client = MlflowClient(tracking_uri=uri or f"sqlite:///{local / 'mlflow.db'}")
            if run_id:  # a run of an earlier attempt: running again
                self.client.update_run(run_id, status="RUNNING")
            self.run_id = run_id or self._new_run(project, None if uri else (local / "artifacts").as_uri())
            self._log_params(config)
        except BaseException as e:
            self._release()
            if isinstance(e, MlflowException):
                raise TrackerError(f"--tracker=mlflow: {_mlflow_reason(e, uri)}") from None
            raise

    def _new_run(self, project: str, artifacts: Optional[str]) -> str:
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project, artifacts)
        return self.client.create_run(experiment_id).info.run_id

    def _log_params(self, config: dict[str, Any]) -> None:
        """The config values the run has no param for yet (all of them in a new run)."""
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        logged = self.client.get_run(self.run_id).data.params
        params = [Param(k, str(v)[:MAX_PARAM_VAL_LENGTH]) for k, v in config.items() if k not in logged]
        for i in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + MAX_PARAMS_TAGS_PER_BATCH])

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        try:
            self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])
        except BaseException:
            self._release()  # switched off (Trackers drops it)
            raise

    def close(self, failed: bool) -> None:
        try:
            self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
        finally:
            self._release()

    def _release(self) -> None:
        """MLflow's own request settings again, once this tracker is done."""
        for name in self._set_here:
            os.environ.pop(name, None)
        self._set_here = []


# While an MLflow tracker is open, a tracking server that does not answer fails its call in seconds, not
# after MLflow's default retries and timeout (about 4 minutes, in which rank 0, and so every rank, waits)
MLFLOW_FAIL_FAST = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


def _mlflow_fails_fast() -> list[str]:
    """MLFLOW_FAIL_FAST in this process's environment, which MLflow reads on every request; a value the
    user set is kept. Returns the names set here."""
    set_here = [name for name in MLFLOW_FAIL_FAST if name not in os.environ]
    for name in set_here:
        os.environ[name] = MLFLOW_FAIL_FAST[name]
    return set_here


def _mlflow_reason(e: BaseException, uri: Optional[str]) -> str:
    import requests

    if isinstance(e.__context__, requests.exceptions.RequestException):
        return (
            f"cannot reach the tracking server {uri} (MLFLOW_TRACKING_URI): start it (`mlflow server`) "
            "or unset MLFLOW_TRACKING_URI to log to a local store"
        )
    return first_line(e)


class Trackers:
    """The trackers of this run (none on ranks other than 0). A tracker that fails while logging is
    reported once and dropped: training and metrics.jsonl go on."""

    def __init__(self, trackers: dict[str, Tracker]):
        self.trackers = trackers

    def log(self, record: dict[str, Any]) -> None:
        for name, tracker in list(self.trackers.items()):
            try:
                numbers = {k: float(v) for k, v in record.items() if k != "step" and not isinstance(v, str)}
                tracker.log(numbers, record["step"])
                texts = {k: v for k, v in record.items() if isinstance(v, str)}
                if texts and hasattr(tracker, "log_text"):
                    tracker.log_text(texts, record["step"])
            except Exception as e:
                _warn(f"--tracker={name} failed and is switched off: {first_line(e)}")
                del self.trackers[name]

    def close(self, failed: bool = False) -> None:
        """Finish every tracker's run (marked failed when training raised)."""
        for name, tracker in self.trackers.items():
            try:
                tracker.close(failed)
            except Exception as e:
                _warn(f"--tracker={name} could not close its run: {first_line(e)}")
        self.trackers = {}


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


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


def _open(name: str, settings: TrackerSettings, folder: Path, run_id: Optional[str], resumed: bool) -> Tracker:
    config, project = settings.config, settings.project
    if name == "tensorboard":
        return TensorBoardTracker(folder / "tensorboard" / (run_id or ""), config)
    if name == "wandb":
        return WandbTracker(folder, project, run_id or "", config)
    if name == "mlflow":
        return MLflowTracker(folder, project, run_id, config)
    return AimTracker(folder, project, run_id, config, take_over=resumed)


def open_trackers(settings: TrackerSettings, run_folder: Path) -> Trackers:
    """Start (or resume) every tracker in --tracker, their files under --tracker_dir (default:
    `run_folder`/tracker) and their run ids in `run_folder`/tracker_runs.json. Call on rank 0 only;
    raises TrackerError."""
    if not settings.names:
        return Trackers({})
    folder = Path(settings.folder) if settings.folder else run_folder / "tracker"
    ids_path = run_folder / RUN_IDS_FILE
    saved = _load_run_ids(ids_path)  # the tracker runs of earlier attempts of this run
    ids = {name: settings.run_id for name in settings.names} if settings.run_id else dict(saved)
    trackers: dict[str, Tracker] = {}
    try:
        for name in settings.names:
            if name not in ("aim", "mlflow"):  # an Aim run's hash and an MLflow run's id are theirs to choose
                ids.setdefault(name, uuid.uuid4().hex[:12])
            resumed = name in saved and saved[name] == ids.get(name)
            try:
                tracker = _open(name, settings, folder, ids.get(name), resumed)
            except Exception as e:
                if resumed:  # a resumed run goes on: a requeued job is never lost to a tracker
                    message = str(e) if isinstance(e, TrackerError) else f"--tracker={name}: {first_line(e)}"
                    _warn(f"{message}; this resumed run goes on without it")
                    continue
                if isinstance(e, OSError):
                    raise TrackerError(
                        f"--tracker={name}: cannot write {e.filename or folder}: {e.strerror or e}"
                    ) from None
                raise
            trackers[name] = tracker
            if isinstance(tracker, (AimTracker, MLflowTracker)):
                ids[name] = tracker.run_id
        try:
            write_text_atomic(ids_path, json.dumps(ids, indent=1) + "\n")
        except OSError as e:
            raise TrackerError(f"cannot write {ids_path}: {e.strerror or e}") from None
    except BaseException:
        Trackers(trackers).close(failed=True)
        raise
    return Trackers(trackers)


def start_trackers(settings: TrackerSettings, run_folder: Path) -> Trackers:
    """open_trackers on rank 0 (the other ranks get none); a tracker that cannot start stops every rank
    with one ConfigError (rank 0 keeps the traceback of an error that is not a TrackerError)."""
    opened: list[Trackers] = []
    if settings.names:
        on_rank0(
            lambda: opened.append(open_trackers(settings, run_folder)), TrackerError, ConfigError
        )  # nothing to share
    return opened[0] if opened else Trackers({})
