"""Helpers to run real training processes (several ranks, gloo) from tests."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
import torch
from slurm_cluster import slurm  # noqa: F401  (the fixture: a one-node Slurm cluster, for any test file)

# no_silent_skip: under CI=true a skip fails (tests/no_silent_skip.py); pytester: pytest run inside a test
pytest_plugins = ("no_silent_skip", "pytester")

ROOT = Path(__file__).resolve().parents[1]
# the files whose runs take longest (seconds on 2 cores), started first so that neither of
# scripts/test.sh's two workers is left with one of them at the end
SLOWEST_FILES = (
    "test_meshes.py",
    "test_ft.py",
    "test_multinode.py",
    "test_checkpoint.py",
    "test_faults.py",
    "test_object_storage.py",
    "test_slurm.py",
    "test_kubernetes.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slowest files first, the rest in their order (pytest-xdist hands out whole files in this order)."""
    first = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))


# a tiny CPU run: fp32 (bf16 is slow on CPU), no compile, short sequences
TINY = [
    "--model_variant=tiny",
    "--device=cpu",
    "--use_dummy_dataset=True",
    "--use_torch_compile=False",
    "--mixed_precision=False",
    "--seq_length=64",
    "--vocab_size=256",
    "--learning_rate=3e-3",
    "--report_interval=1",
]


def launch(
    script: str,
    args: list[str],
    nproc: Optional[int],
    extra_env: Optional[dict] = None,
    timeout: int = 300,
    torchrun_args: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """Run `script` with `args` in nproc real processes: plain python when nproc is None; under torchrun
    when torchrun_args are given; else the ranks are started directly with the environment torchrun
    gives them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT, ...), which skips torchrun's 2 s agent
    start-up (torchrun's own behaviour is tested with it: logs, kills, SIGTERM, Slurm). Rank outputs are
    joined, rank 0's first; the status is the first failing rank's."""
    env = rank_env(extra_env)
    if nproc is None or torchrun_args:
        cmd = [sys.executable]
        if nproc is not None:
            cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *torchrun_args]
        cmd += [str(ROOT / script), *args]
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    procs = start_ranks(script, args, nproc, env)
    with ThreadPoolExecutor(nproc) as pool:  # drain every rank's pipes while they run
        futures = {pool.submit(p.communicate): p for p in procs}
        deadline, pending = time.monotonic() + timeout, set(futures)
        while pending:
            done, pending = wait(pending, timeout=max(0.0, deadline - time.monotonic()), return_when=FIRST_COMPLETED)
            if not done or any(futures[f].returncode != 0 for f in done):
                # as torchrun does: a failed rank (or the time limit) ends the others, so none hangs
                if done:
                    wait(pending, timeout=5)
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                if not done:
                    raise subprocess.TimeoutExpired(procs[0].args, timeout)
        outputs = [f.result() for f in futures]
    codes = [p.wait() for p in procs]
    status = next((c for c in codes if c != 0), 0)
    return subprocess.CompletedProcess(
        procs[0].args, status, "".join(o[0] or "" for o in outputs), "".join(o[1] or "" for o in outputs)
    )


def rank_env(extra_env: Optional[dict] = None) -> dict:
    """The environment of a launched process: one thread, this checkout first on the path."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        **(extra_env or {}),
    }


def start_ranks(script: str, args: list[str], nproc: int, env: dict) -> list[subprocess.Popen]:
    """nproc processes of `script`, each with the environment torchrun gives a rank (and `env`). As under
    torchrun, the store is this process's, bound before they start (TORCHELASTIC_USE_AGENT_STORE: every
    rank connects to it), so no other test can take its port meanwhile; each process holds it (`store`)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, nproc, True, wait_for_workers=False)
    world = {
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / script), *args],
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**env, **world, "RANK": str(r), "LOCAL_RANK": str(r)},
        )
        for r in range(nproc)
    ]
    for p in procs:
        p.store = store  # type: ignore[attr-defined]
    return procs


def inspect_data(*args: str) -> subprocess.CompletedProcess:
    """scripts/inspect_data.py (fms-inspect-data) with `args`, in a process of its own."""
    command = [sys.executable, "scripts/inspect_data.py", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def records(out: Path) -> list[dict]:
    """The metrics.jsonl records of the run written to `out`."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def train(tmp: Path, args: list[str], nproc: Optional[int] = 2, **kw: Any) -> list[dict]:
    """Run main_training.py; assert it succeeded; return the metrics.jsonl records."""
    out = tmp / "run"
    proc = launch("main_training.py", [*TINY, f"--ckpt_save_path={out}", *args], nproc, **kw)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return records(out)


@pytest.fixture
def one_process_group(tmp_path: Path) -> Iterator[None]:
    """A gloo process group of this process alone (the default group), stopped after the test."""
    from fms_fsdp.parallel.process_group import stop_process_group

    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    stop_process_group()


@contextlib.contextmanager
def here() -> Iterator[io.StringIO]:
    """Run a command's entry point in this process, one rank (no start-up of a new interpreter): the
    same code path, a real gloo group. Environment and thread count are restored after (run() restores
    the stop-signal handlers itself); yields what it prints."""
    saved_env, threads = dict(os.environ), torch.get_num_threads()
    out = io.StringIO()
    torch.set_num_threads(1)  # as OMP_NUM_THREADS=1 in the launched runs, so losses compare across both
    try:
        with contextlib.redirect_stdout(out):
            yield out
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        torch.set_num_threads(threads)


def launch_runs(nproc: int, runs: list[list[str]], extra_env: Optional[dict] = None, timeout: int = 600) -> str:
    """The runs one after another in one launch of `nproc` ranks (tests/runs_worker.py: a rank's start-up
    is most of a short run's time); every rank's output, rank 0's first."""
    proc = launch(
        "tests/runs_worker.py", [], nproc, extra_env={**(extra_env or {}), "RUNS": json.dumps(runs)}, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def run_here(args: list[str]) -> str:
    """main_training.py's run in this process (see `here`); returns what it printed. For runs whose
    command line is not under test."""
    from fms_fsdp.flags import parse_args
    from fms_fsdp.startup import facts
    from fms_fsdp.train.loop import run_training

    with here() as out:
        run_training(lambda: facts(parse_args([*TINY, *args])))
    return out.getvalue()


def data_loader(cfg: Any, rank: int, world_size: int) -> Any:
    """get_data_loader for data-parallel rank `rank` of `world_size`, with cfg's data settings (the run's)."""
    from fms_fsdp.data import get_data_loader
    from fms_fsdp.startup import facts

    return get_data_loader(facts(cfg).settings.data, rank, world_size)


def train_here(tmp: Path, args: list[str]) -> list[dict]:
    """run_here with its outputs in tmp/run; returns the metrics.jsonl records."""
    out = tmp / "run"
    run_here([f"--ckpt_save_path={out}", *args])
    return records(out)


def inspect(
    tmp: Path,
    args: list[str],
    nproc: int,
    cases: Optional[list[list[str]]] = None,
    weights: bool = True,
    backward: bool = False,
) -> list[list[dict]]:
    """Run tests/inspect_worker.py once: per case (extra flags; default one case without), one JSON
    record per rank about its shards and memory, with `weights` its full weights' fingerprint and
    initial loss, with `backward` too its gradients."""
    cases = cases or [[]]
    env = {
        "INSPECT_CASES": json.dumps(cases),
        "INSPECT_WEIGHTS": str(int(weights)),
        "INSPECT_BACKWARD": str(int(backward)),
    }
    proc = launch(
        "tests/inspect_worker.py", [*TINY, f"--ckpt_save_path={tmp / 'inspect'}", *args], nproc, extra_env=env
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [
        [json.loads((tmp / "inspect" / f"rank{r}.{k}.json").read_text()) for r in range(nproc)]
        for k in range(len(cases))
    ]


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture(scope="session")
def data(tmp_path_factory) -> Path:
    """Two small datasets in two layouts: web (Arrow, 400 documents) and code (Parquet, 200)."""
    from test_data import make_docs, write_dataset

    root = tmp_path_factory.mktemp("data")
    write_dataset(root, "web", make_docs(10, 400, 1))
    write_dataset(root, "code", make_docs(500, 200, 2), layout="parquet")
    return root


def resume_from(source: Path, step: int, out: Path) -> Path:
    """`out`, a run folder whose newest checkpoint is a copy of run `source`'s of `step`."""
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(source / "checkpoints" / f"step_{step}_ckp", out / "checkpoints" / f"step_{step}_ckp")
    return out


STEPS = 12  # of a run on `data` (see `uninterrupted`)


def flags(data: Path, out: Path, *extra: str) -> list[str]:
    """A run of STEPS steps on `data`, written to `out`."""
    return [
        *TINY,
        "--use_dummy_dataset=False",
        f"--data_path={data}",
        "--file_type=auto",
        "--weights=2,1",
        "--vocab_size=1024",
        "--batch_size=4",
        "--seq_length=128",
        f"--num_steps={STEPS}",
        "--num_workers=1",
        "--logical_shards=16",
        f"--ckpt_save_path={out}",
        *extra,
    ]


@pytest.fixture(scope="session")
def uninterrupted(data, tmp_path_factory) -> Path:
    """The outputs of a two-rank run on `data`, checkpointed at steps 6 and 12, never interrupted."""
    out = tmp_path_factory.mktemp("full") / "run"
    proc = launch("main_training.py", flags(data, out, "--checkpoint_interval=6"), 2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out
