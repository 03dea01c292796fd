"""--tracker: TensorBoard, W&B (offline), Aim and MLflow (a real `mlflow server`, and the local store) get
metrics.jsonl's records and the config, and a resumed run goes on in the same tracker runs; a tracker
that is not installed is refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

import pytest

from fms_fsdp.errors import ConfigError, TrackerError
from fms_fsdp.flags import parse_args
from fms_fsdp.metrics.trackers import MLFLOW_FAIL_FAST, open_trackers
from fms_fsdp.parallel.process_group import free_port
from fms_fsdp.settings import trackers_of

from conftest import ROOT, TINY, launch, train, train_here


def _tensorboard_scalars(folder: Path) -> tuple[dict[str, list[tuple[int, float]]], bool]:
    """Scalars by tag as (step, value), and whether hyper-parameters were written."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    return scalars, bool(acc.PluginTagToContent("hparams"))


def _aim_run(repo: Path, run_hash: str) -> tuple[dict, list[float], list[int]]:
    import aim

    run = aim.Run(run_hash=run_hash, repo=str(repo), system_tracking_interval=None, capture_terminal_logs=False)
    try:
        loss = next(m for m in run.metrics() if m.name == "loss")
        steps, (values, *_) = loss.data.items_list()  # columns: value, epoch, time
        return run.get("hparams"), values, steps
    finally:
        run.close()


@pytest.mark.slow  # three trackers, a run and its resume: about 14 s
def test_three_trackers_get_the_metrics_and_config_and_keep_their_runs_on_resume(tmp):
    flags = ["--tracker=tensorboard,wandb,aim", "--report_interval=2", "--tracker_project_name=tests"]
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    train(tmp, [*flags, "--num_steps=4"], nproc=None, extra_env=env)
    run = tmp / "run"
    ids = json.loads((run / "tracker_runs.json").read_text())
    assert set(ids) == {"tensorboard", "wandb", "aim"}
    records = train(tmp, [*flags, "--num_steps=6"], nproc=None, extra_env=env)  # resumes at step 4
    assert json.loads((run / "tracker_runs.json").read_text()) == ids
    loss = {r["step"]: r["loss"] for r in records}
    assert sorted(loss) == [2, 4, 6]

    scalars, has_hparams = _tensorboard_scalars(run / "tracker" / "tensorboard" / ids["tensorboard"])
    assert [s for s, _ in scalars["loss"]] == [2, 4, 6]
    assert all(abs(v - loss[s]) < 1e-5 * max(1.0, abs(loss[s])) for s, v in scalars["loss"])
    assert {"lr", "grad_norm", "tokens_seen", "tokens_per_sec_per_gpu"} <= set(scalars)
    assert has_hparams

    wandb_runs = sorted((run / "tracker" / "wandb").glob(f"offline-run-*-{ids['wandb']}"))
    assert len(wandb_runs) == 2, wandb_runs  # one folder per attempt, both the same W&B run id
    # the offline log holds protobuf records whose values are JSON text: find each loss in its attempt
    first, second = (next(r.glob("run-*.wandb")).read_bytes() for r in wandb_runs)
    assert all(json.dumps(loss[s]).encode() in first for s in (2, 4))
    assert json.dumps(loss[6]).encode() in second and json.dumps(loss[6]).encode() not in first
    assert all(b"model_variant" in log and b"tokens_per_sec_per_gpu" in log for log in (first, second))

    hparams, values, steps = _aim_run(run / "tracker", ids["aim"])
    assert hparams["model_variant"] == "tiny" and hparams["tracker"] == ["tensorboard", "wandb", "aim"]
    assert steps == [2, 4, 6]
    assert all(abs(v - loss[s]) < 1e-5 * max(1.0, abs(loss[s])) for s, v in zip(steps, values))


def test_a_tracker_that_is_not_installed_is_refused_at_start_up(tmp):
    """Run the real entry point in an environment without wandb: this interpreter's packages, minus
    wandb, linked into a folder that replaces site-packages."""
    site = Path(sysconfig.get_paths()["purelib"])
    without = tmp / "site"
    without.mkdir()
    for entry in site.iterdir():
        if not entry.name.startswith("wandb"):
            (without / entry.name).symlink_to(entry)
    code = (
        f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(without)!r}]; "
        "from fms_fsdp.cli import train; train(sys.argv[1:])"
    )
    proc = subprocess.run(
        [sys.executable, "-S", "-c", code, "--tracker=tensorboard,wandb"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        "error: --tracker=wandb: the wandb package is not installed; pip install wandb (or drop wandb from --tracker)"
    )


def test_wandb_online_without_a_login_is_one_clear_error(tmp, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp))  # no ~/.netrc, so no W&B login
    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(TrackerError) as e:
        open_trackers(trackers_of(parse_args(["--tracker=wandb"])), tmp / "run")
    message = str(e.value)
    assert message.startswith("--tracker=wandb: ") and "WANDB_MODE=offline" in message and "\n" not in message


def test_a_tracker_that_cannot_start_stops_every_rank_with_one_line(tmp):
    """Rank 0 opens the trackers; its failure reaches rank 1 too, so no rank waits in a collective."""
    proc = launch(
        "main_training.py",
        [*TINY, "--tracker=aim", "--tracker_run_id=0123456789abcdef01234567", f"--ckpt_save_path={tmp / 'run'}"],
        nproc=2,
        timeout=120,
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert errors == [
        f"error: --tracker=aim: Cannot find Run 0123456789abcdef01234567 in aim Repo "
        f"{tmp / 'run' / 'tracker' / '.aim'}."
    ], proc.stderr[-2000:]
    assert not (tmp / "run" / "checkpoints").exists()  # stopped before training


@pytest.mark.parametrize(
    "flag, message",
    [
        ("tensorboard,comet", "--tracker: 'comet' is not one of tensorboard, wandb, aim, mlflow"),
        ("aim,aim", "--tracker: aim is named twice"),
    ],
)
def test_unknown_or_repeated_tracker_is_a_config_error(flag, message):
    with pytest.raises(ConfigError) as e:
        parse_args([f"--tracker={flag}"])
    assert str(e.value) == message


def test_no_tracker_spellings():
    assert parse_args(["--tracker=none"]).tracker is None
    assert parse_args(["--tracker=wandb"]).tracker == ["wandb"]


class MLflowServer:
    """A real `mlflow server` (SQLite store) on a free local port, started in a session of its own so
    that stop() ends all its processes."""

    def __init__(self, folder: Path):
        folder.mkdir()
        self.uri = f"http://127.0.0.1:{free_port()}"
        cmd = [str(Path(sys.executable).parent / "mlflow"), "server", "--workers=1", "--host=127.0.0.1"]
        cmd += [f"--port={self.uri.rsplit(':', 1)[1]}", f"--backend-store-uri=sqlite:///{folder / 'mlflow.db'}"]
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.log = open(folder / "server.log", "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout: float = 120) -> str:
        """Its URI, once it answers."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, Path(self.log.name).read_text()[-2000:]
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2):
                    return self.uri
            except OSError:
                time.sleep(0.25)
        raise AssertionError(f"mlflow server did not answer in {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        self.log.close()


@pytest.mark.slow  # a real mlflow server boots (about 20 s): the slow tier
def test_mlflow_gets_the_config_and_metrics_and_a_resumed_run_goes_on_in_the_same_mlflow_run(tmp, monkeypatch, capsys):
    """Against a real `mlflow server`; while it starts, the local store (no MLFLOW_TRACKING_URI)."""
    from mlflow import MlflowClient

    server = MLflowServer(tmp / "server")
    try:
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
        _check_the_local_store(tmp / "local")
        monkeypatch.setenv("MLFLOW_TRACKING_URI", server.wait())
        flags = ["--tracker=mlflow", "--report_interval=2", "--tracker_project_name=tests"]
        train_here(tmp, [*flags, "--num_steps=4"])
        run_id = json.loads((tmp / "run" / "tracker_runs.json").read_text())["mlflow"]
        records = train_here(tmp, [*flags, "--num_steps=6"])  # resumes at step 4
        assert json.loads((tmp / "run" / "tracker_runs.json").read_text()) == {"mlflow": run_id}

        client = MlflowClient(server.uri)
        experiment = client.get_experiment_by_name("tests")
        assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run_id]
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED"
        params = run.data.params
        assert params["model_variant"] == "tiny" and params["tracker"] == "['mlflow']"
        assert params["num_steps"] == "4"  # MLflow keeps a param's first value
        loss = {m.step: m.value for m in client.get_metric_history(run_id, "loss")}
        assert sorted(loss) == [2, 4, 6]
        assert loss == pytest.approx({r["step"]: r["loss"] for r in records}, rel=1e-6)
        assert {"lr", "grad_norm", "tokens_seen", "tokens_per_sec_per_gpu"} <= set(run.data.metrics)
        _check_a_server_that_goes_away_switches_the_tracker_off_in_seconds(tmp / "gone", server, capsys)
    finally:
        server.stop()


def _check_a_server_that_goes_away_switches_the_tracker_off_in_seconds(run: Path, server: MLflowServer, capsys):
    run.mkdir()
    trackers = open_trackers(trackers_of(parse_args(["--tracker=mlflow"])), run)
    assert {name: os.environ.get(name) for name in MLFLOW_FAIL_FAST} == MLFLOW_FAIL_FAST  # the tracker's life
    trackers.log({"step": 1, "loss": 4.0})
    server.stop()
    start = time.monotonic()
    trackers.log({"step": 2, "loss": 3.0})
    assert time.monotonic() - start < 30  # MLflow's default retries: about 4 minutes
    assert trackers.trackers == {} and "--tracker=mlflow failed and is switched off: " in capsys.readouterr().err
    assert not set(MLFLOW_FAIL_FAST) & set(os.environ)  # MLflow's own settings again


def _check_the_local_store(run: Path) -> None:
    """Without MLFLOW_TRACKING_URI the run goes to <tracker_dir>/mlflow/mlflow.db, and opening the
    trackers again (a resumed run) goes on in the same MLflow run."""
    from mlflow import MlflowClient

    cfg = parse_args(["--tracker=mlflow", "--tracker_project_name=local"])
    for step in (1, 2):
        trackers = open_trackers(trackers_of(cfg), run)
        trackers.log({"step": step, "loss": 5.0 - step})
        trackers.close()
    run_id = json.loads((run / "tracker_runs.json").read_text())["mlflow"]
    client = MlflowClient(f"sqlite:///{run / 'tracker' / 'mlflow' / 'mlflow.db'}")
    history = client.get_metric_history(run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(1, 4.0), (2, 3.0)]
    assert client.get_run(run_id).info.status == "FINISHED"
    assert client.get_experiment_by_name("local").artifact_location.startswith((run / "tracker").as_uri())


@pytest.mark.slow  # a tracker that cannot start stays in the default tier
def test_an_mlflow_server_that_does_not_answer_is_one_line_within_seconds(tmp, monkeypatch):
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    start = time.monotonic()
    with pytest.raises(TrackerError) as e:
        open_trackers(trackers_of(parse_args(["--tracker=mlflow"])), tmp / "run")
    assert time.monotonic() - start < 30
    assert str(e.value) == (
        f"--tracker=mlflow: cannot reach the tracking server {uri} (MLFLOW_TRACKING_URI): start it "
        "(`mlflow server`) or unset MLFLOW_TRACKING_URI to log to a local store"
    )
    assert not set(MLFLOW_FAIL_FAST) & set(os.environ)  # MLflow's retries are as they were
