"""fms-prepare-data on a cluster's engines: a real Ray cluster (`ray start --head`, the command joining it
by --ray_address), a local Ray the command starts and stops, and a real Slurm job array
(scripts/prepare_data.slurm). Each writes what one machine writes, byte for byte, also from a bucket to a
bucket on Ray; a Ray worker or the driver killed with -9 costs nothing but time."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
from slurm_cluster import job_state, submit, wait_for
from test_object_storage import SECRET, s3_settings, start_server
from test_prepare_pieces import PIECE, dataset_bytes, prepare, word_tokenizer, write_corpus

from fms_fsdp.data.prepare.cache_dir import JobCluster, ray_start, stop_job_cluster
from fms_fsdp.parallel.process_group import free_port

from conftest import TINY, launch, records
from held_at import wait_held
from test_checkpoint import alive, process_children

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """A corpus of many pieces, a word-level tokenizer, the flags, and what one machine makes of them."""
    folder = tmp_path_factory.mktemp("corpus")
    raw, tok = folder / "raw", word_tokenizer(folder / "tok")
    write_corpus(raw, lines=3000, words=40)
    flags = [f"--tokenizer={tok}", f"--piece_bytes={PIECE * 4}", "--shard_tokens=5000"]
    prepare(raw, folder / "one" / "ds", *flags, "--workers=2")
    return {"raw": raw, "flags": flags, "bytes": dataset_bytes(folder / "one")}


@pytest.fixture(scope="module")
def ray_env(tmp_path_factory) -> dict[str, str]:
    """Ray's settings for these tests: its token (Ray's default authentication) in a home of their own."""
    home = tmp_path_factory.mktemp("ray-home")
    env = {"HOME": str(home), "RAY_AUTH_MODE": "token", "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run(
        [str(BIN / "ray"), "get-auth-token", "--generate"], env={**os.environ, **env}, check=True, capture_output=True
    )
    return env


def ray_processes(name: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", name], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]


def test_a_local_ray_writes_what_one_machine_writes_and_is_stopped(corpus, ray_env, ray_head, tmp_path):
    """Without --ray_address the command starts a Ray of its own, also beside a cluster running on the
    machine (ray_head), and stops it."""
    running = ray_processes("raylet")
    proc = prepare(corpus["raw"], tmp_path / "ds", *corpus["flags"], "--engine=ray", "--workers=2", env=ray_env)
    assert dataset_bytes(tmp_path) == corpus["bytes"]
    assert "pieces (0 done before)" in proc.stdout
    assert ray_processes("raylet") == running, "the local Ray outlived the command"


def cache_run(tmp_path: Path, ray_env: dict, *ray_flags: str) -> tuple[list[dict], str]:
    """A 2-rank run on raw text with --cache_dir, its cache tokenized on Ray; its records and output."""
    from test_data import make_docs, write_dataset

    data = tmp_path / "raw"
    write_dataset(data, "text", make_docs(400, 200, 3), layout="jsonl")
    args = [
        "--use_dummy_dataset=False",
        f"--data_path={data}",
        f"--tokenizer_path={data / 'tokenizer.json'}",
        "--vocab_size=4096",
        f"--cache_dir={tmp_path / 'cache'}",
        "--num_steps=2",
        "--batch_size=2",
        *ray_flags,
    ]
    out = tmp_path / "run"
    proc = launch("main_training.py", [*TINY, f"--ckpt_save_path={out}", *args], 2, extra_env=ray_env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "cache" / "text" / ".done" / "complete.json").is_file()
    return records(out), proc.stdout + proc.stderr


def test_a_run_starts_ray_over_its_own_nodes_to_build_its_cache_and_stops_it(ray_env, ray_head, tmp_path):
    """--ray_start_workers (Levanter's start_workers): the head beside rank 0, a worker per other node
    (none on one node), stopped once the cache is built, and no other Ray on the node (ray_head's);
    training then reads the cache."""
    running = ray_processes("raylet")
    runs, output = cache_run(tmp_path, ray_env, "--ray_start_workers=True")
    assert re.search(r"note: tokenizing text into \S+ on the Ray cluster at [\w.-]+:\d+ ", output), output[-3000:]
    assert any("loss" in r for r in runs)
    assert ray_processes("raylet") == running, "the job's Ray outlived the cache, or stopped another"


def test_ranks_killed_while_their_ray_builds_the_cache_leave_no_ray_running(ray_env, tmp_path):
    """--ray_start_workers: torchrun and the ranks SIGKILLed mid-build (a node's processes killed outright)
    end the job's Ray too."""
    from test_data import make_docs, write_dataset

    data = tmp_path / "raw"
    write_dataset(data, "text", make_docs(400, 200, 3), layout="jsonl")
    running, nodes, log = ray_processes("raylet"), ray_processes("ray start"), tmp_path / "run.log"
    tickets = tmp_path / "tickets"  # every piece held (tests/held_pieces.py): the kill lands mid-build
    flags = [f"--data_path={data}", f"--tokenizer_path={data / 'tokenizer.json'}", "--vocab_size=4096"]
    flags += [f"--cache_dir={tmp_path / 'cache'}", "--ray_start_workers=True", f"--ckpt_save_path={tmp_path / 'run'}"]
    with log.open("w") as out:
        torchrun = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
            + [str(ROOT / "tests" / "held_pieces.py"), str(tickets), "0"]
            + [str(ROOT / "main_training.py"), *TINY, "--use_dummy_dataset=False", *flags],
            cwd=ROOT,
            env={**os.environ, **ray_env, "OMP_NUM_THREADS": "1"},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for("a piece held on the job's Ray", lambda: bool(held(tickets)) or torchrun.poll() is not None, 300)
        assert torchrun.poll() is None, log.read_text()[-3000:]
        assert len(ray_processes("raylet")) > len(running)
        for pid in [
            torchrun.pid,
            *process_children().get(torchrun.pid, []),
        ]:  # all at once: no one is left to stop the rest
            with contextlib.suppress(ProcessLookupError):  # a child that has just ended
                os.kill(pid, signal.SIGKILL)
        torchrun.wait(timeout=120)
        assert not (tmp_path / "cache" / "text" / ".done" / "complete.json").exists()  # killed mid-build
        wait_for(
            "the job's Ray to end",
            lambda: (ray_processes("raylet"), ray_processes("ray start")) == (running, nodes),
            180,
        )
    finally:
        torchrun.kill()
        for pid in set(ray_processes("ray start")) - set(nodes):  # none, unless the test failed
            os.kill(pid, signal.SIGTERM)


def test_sbatch_train_slurm_builds_the_cache_on_ray_over_its_nodes_then_trains(ray_env, slurm, tmp_path):
    """scripts/train.slurm with --cache_dir --ray_start_workers=True, as its header shows."""
    from test_data import make_docs, write_dataset

    data, log, run = tmp_path / "raw", tmp_path / "job.out", tmp_path / "run"
    write_dataset(data, "text", make_docs(400, 200, 3), layout="jsonl")
    running = ray_processes("raylet")
    env = {**slurm, **ray_env, "NPROC_PER_NODE": "2", "OMP_NUM_THREADS": "1", "PATH": f"{BIN}:{slurm['PATH']}"}
    flags = [f"--data_path={data}", f"--tokenizer_path={data / 'tokenizer.json'}", "--vocab_size=4096", "--num_steps=2"]
    job = submit(
        env,
        *("--nodes=1", "--gres=none", f"--cpus-per-task={os.cpu_count()}", "--time=10", f"--output={log}"),
        *("scripts/train.slurm", *TINY, "--use_dummy_dataset=False", *flags),
        *(f"--cache_dir={tmp_path / 'cache'}", "--ray_start_workers=True", f"--ckpt_save_path={run}"),
    )
    wait_for("the job to end", lambda: job_state(slurm, job) in ("COMPLETED", "FAILED", "CANCELLED"), 400, log)
    output = log.read_text()
    assert job_state(slurm, job) == "COMPLETED", output[-4000:]
    assert "on the Ray cluster at" in output and (tmp_path / "cache" / "text" / ".done" / "complete.json").is_file()
    assert [r["step"] for r in records(run) if "loss" in r] == [1, 2]
    assert ray_processes("raylet") == running, "the job's Ray outlived the cache"


@pytest.fixture(scope="module")
def ray_head(ray_env) -> Iterator[str]:
    """A Ray cluster started as a user starts one (`ray start --head`, 2 CPUs, no bucket settings); its
    address. Ended, it stops its own processes only."""
    port = free_port()
    with pytest.MonkeyPatch.context() as env:
        for name in [k for k in os.environ if k.startswith("AWS_")]:
            env.delenv(name)
        for name, value in {**ray_env, "PYTHONPATH": str(ROOT)}.items():
            env.setenv(name, value)
        client = f"--ray-client-server-port={free_port()}"  # not 10001: a cluster of the run's own may need it
        head = ray_start("--head", f"--port={port}", client, "--num-cpus=2", "--include-dashboard=false")
    try:
        yield f"127.0.0.1:{port}"
    finally:
        stop_job_cluster(JobCluster(f"127.0.0.1:{port}", head))


def start(corpus: dict, out: Path, env: dict, *args: str, held: tuple = ()) -> subprocess.Popen:
    """fms-prepare-data on the corpus, in the background; `held`: (tickets folder, first held ticket), its
    pieces held as tests/held_pieces.py says."""
    hold = [str(ROOT / "tests" / "held_pieces.py"), str(held[0]), str(held[1])] if held else []
    return subprocess.Popen(
        [
            sys.executable,
            *hold,
            "scripts/prepare_data.py",
            f"--input={corpus['raw']}",
            f"--output={out}",
            *corpus["flags"],
            *args,
        ],
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def markers(out: Path) -> int:
    """The finished pieces' markers in .done, and the ledger (complete.json) once the dataset is whole."""
    return len(list((out / ".done").glob("*.json")))


def test_a_ray_cluster_writes_what_one_machine_writes_despite_a_killed_worker(corpus, ray_env, ray_head, tmp_path):
    """The first piece's worker is held until it is SIGKILLed, then every piece is let go: Ray retries it."""
    out, tickets = tmp_path / "ds", tmp_path / "tickets"
    proc = start(corpus, out, ray_env, "--engine=ray", f"--ray_address={ray_head}", held=(tickets, 0))
    try:
        wait_for("a Ray worker holding a piece", lambda: (tickets / "held-0").exists() or proc.poll() is not None, 180)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        os.kill(int((tickets / "held-0").read_text().split()[0]), signal.SIGKILL)
        (tickets / "release").touch()
        output, _ = proc.communicate(timeout=180)
    finally:
        proc.kill()  # a failed test leaves no driver (and so no held task) behind
    assert proc.returncode == 0, output
    assert len(list(tickets.glob("ticket-*"))) == markers(out), (
        "the killed piece was not run again"
    )  # 1 more: the ledger
    assert dataset_bytes(tmp_path) == corpus["bytes"]


def test_a_ray_cluster_reads_and_writes_a_bucket_with_the_drivers_settings(corpus, ray_env, ray_head, tmp_path):
    """The input and the output in a bucket (moto's S3 server) that the cluster was started without: the
    command's AWS_* settings travel with its tasks, and the files are what one machine writes on disk."""
    import s3fs

    port = free_port()
    server = start_server(port)
    aws = s3_settings(port)
    try:
        fs = s3fs.S3FileSystem(key="testing", secret=SECRET, endpoint_url=aws["AWS_ENDPOINT_URL"])
        fs.mkdir("raw")
        fs.mkdir("out")
        fs.put(f"{corpus['raw']}/", "raw/corpus/", recursive=True)
        proc = subprocess.run(
            [
                sys.executable,
                "scripts/prepare_data.py",
                "--input=s3://raw/corpus",
                "--output=s3://out/ds",
                *corpus["flags"],
                "--engine=ray",
                f"--ray_address={ray_head}",
            ],
            cwd=ROOT,
            env={**os.environ, **ray_env, **aws},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        fs.get("out/", f"{tmp_path / 'got'}/", recursive=True)
    finally:
        server.kill()
    assert dataset_bytes(tmp_path / "got") == corpus["bytes"]


def test_the_driver_killed_and_run_again_finishes_with_the_same_files(corpus, ray_env, ray_head, tmp_path):
    """Two pieces finish, the rest are held; the driver is SIGKILLed then, and the run again does the rest."""
    out, tickets = tmp_path / "ds", tmp_path / "tickets"
    proc = start(corpus, out, ray_env, "--engine=ray", f"--ray_address={ray_head}", held=(tickets, 2))
    try:
        wait_for(
            "two pieces and a held one",
            lambda: (markers(out) == 2 and (tickets / "held-2").exists()) or proc.poll() is not None,
            180,
        )
        assert proc.poll() is None, proc.communicate()[0][-3000:]
    finally:
        proc.send_signal(signal.SIGKILL)  # the kill under test (and, on a failure, nothing left behind)
        proc.wait()
    wait_for("the held tasks to end", lambda: not any(alive(p) for p in held_pids(tickets)), 180)
    assert markers(out) == 2
    again = prepare(corpus["raw"], out, *corpus["flags"], "--engine=ray", f"--ray_address={ray_head}", env=ray_env)
    assert markers(out) > 2 and dataset_bytes(tmp_path) == corpus["bytes"]
    assert "(2 done before)" in again.stdout, again.stdout


def held(tickets: Path) -> list[Path]:
    """The `held-<ticket>` files of tests/held_pieces.py: a held piece's pid and Slurm array task."""
    return list(tickets.glob("held-*"))


def held_pids(tickets: Path) -> list[int]:
    return [int(f.read_text().split()[0]) for f in held(tickets)]


def test_a_slurm_job_array_writes_what_one_machine_writes(corpus, slurm, tmp_path):
    out = tmp_path / "ds"
    env = {**slurm, "PYTHON": sys.executable}
    job = submit(
        env,
        *("--array=0-2", "--cpus-per-task=1", "--time=10", f"--output={tmp_path / 'task-%a.out'}"),
        *("scripts/prepare_data.slurm", f"--input={corpus['raw']}", f"--output={out}", *corpus["flags"]),
    )
    tasks = [f"{job}_{i}" for i in range(3)]
    wait_for(
        "the array's tasks",
        lambda: all(job_state(slurm, t) in ("COMPLETED", "FAILED", "CANCELLED") for t in tasks),
        400,
    )
    logs = {t: (tmp_path / f"task-{t[-1]}.out").read_text() for t in tasks}
    assert all(job_state(slurm, t) == "COMPLETED" for t in tasks), logs
    assert dataset_bytes(tmp_path) == corpus["bytes"]
    assert sum("counts:" in log for log in logs.values()) >= 1  # the last to finish wrote them


def test_a_run_builds_its_cache_on_a_running_ray_cluster(ray_env, ray_head, tmp_path):
    runs, output = cache_run(tmp_path, ray_env, f"--ray_address={ray_head}")
    assert f"on the Ray cluster at {ray_head} (once: later runs read it)" in output and any("loss" in r for r in runs)


def test_a_run_builds_its_cache_on_a_local_ray_it_starts_and_stops(ray_env, ray_head, tmp_path):
    """--ray_auto_start_cluster: a Ray of its own beside rank 0 (also beside a running cluster), stopped
    once the cache is built."""
    running = ray_processes("raylet")
    runs, output = cache_run(tmp_path, ray_env, "--ray_auto_start_cluster=True")
    assert re.search(r"note: training while text is tokenized into \S+ on a local Ray \(\d+ CPUs\)", output), output[
        -3000:
    ]
    assert any("loss" in r for r in runs) and ray_processes("raylet") == running


def test_the_ray_driver_of_a_cache_built_beside_killed_mid_build_costs_only_time(
    ray_env, ray_head, tmp_path, monkeypatch, capsys
):
    """The cache built beside the training on a running Ray: its driver (rank 0's builder) SIGKILLed while a
    Ray worker holds its first piece (tests/held_pieces.py) is started again; the batches are raw text's,
    and the cache ends complete."""
    from test_cache_beside import held_builder, same

    from fms_fsdp.data.prepare import beside

    from conftest import data_loader
    from test_data import cfg, make_docs, take, write_dataset

    for name, value in {**ray_env, "PYTHONPATH": str(ROOT)}.items():
        monkeypatch.setenv(name, value)
    data, tickets = tmp_path / "raw", tmp_path / "tickets"
    write_dataset(data, "text", make_docs(400, 300, 3), layout="jsonl")
    raw = take(data_loader(cfg(data, vocab_size=4096), 0, 1), 4)
    monkeypatch.setattr(beside, "BUILDER", held_builder(tickets, 0))
    loader = data_loader(cfg(data, vocab_size=4096, cache_dir=str(tmp_path / "cache"), ray_address=ray_head), 0, 1)
    wait_held(tickets, 1, [], timeout=120, files="held-0", said=lambda: list(loader.builder._lines))
    os.kill(loader.builder._process.pid, signal.SIGKILL)
    (tickets / "release").mkdir()  # the driver started again goes on
    assert same(raw, take(loader, 4))
    loader.finish()
    out = capsys.readouterr().out
    assert f"on the Ray cluster at {ray_head}" in out and "warning: the cache's builder ended" in out, out
    assert (tmp_path / "cache" / "text" / ".done" / "complete.json").is_file()


def test_an_array_task_killed_with_minus_9_and_the_array_run_again_finishes_the_same(slurm, tmp_path):
    """One task of a running array SIGKILLed (`scancel --full --signal=KILL`) while it holds a piece (four
    pieces finish, the rest are held), then the same sbatch again."""
    raw, tok = tmp_path / "raw", word_tokenizer(tmp_path / "tok")
    write_corpus(raw, lines=3000, words=40)
    flags = [f"--tokenizer={tok}", f"--piece_bytes={PIECE * 4}", "--shard_tokens=5000"]
    prepare(raw, tmp_path / "one" / "ds", *flags, "--workers=2")
    tickets, held_python = tmp_path / "tickets", tmp_path / "held-python"
    held_python.write_text(f'#!/bin/sh\nexec {sys.executable} {ROOT / "tests" / "held_pieces.py"} {tickets} 4 "$@"\n')
    held_python.chmod(0o755)
    out = tmp_path / "array" / "ds"
    args = ["--array=0-1", "--cpus-per-task=1", "--time=10", f"--output={tmp_path / 'task-%a.out'}"]
    args += ["scripts/prepare_data.slurm", f"--input={raw}", f"--output={out}", *flags]
    job = submit({**slurm, "PYTHON": str(held_python)}, *args)
    try:
        wait_for("task 1 holding a piece", lambda: any(f.read_text().split()[1:] == ["1"] for f in held(tickets)), 300)
        subprocess.run(["scancel", "--full", "--signal=KILL", f"{job}_1"], env=slurm, check=True)
        ended = ("COMPLETED", "FAILED", "CANCELLED")
        wait_for("task 1 to end", lambda: job_state(slurm, f"{job}_1") in ended, 180)
    finally:
        (tickets / "release").touch()  # task 0 goes on (and, on a failure, nothing waits)
    wait_for("the array to end", lambda: job_state(slurm, f"{job}_0") in ended, 400)
    assert job_state(slurm, f"{job}_1") != "COMPLETED"
    assert not (out.parent / "meta").exists()
    env = {**slurm, "PYTHON": sys.executable}
    done = markers(out)
    again = submit(env, *args)
    wait_for("the array again", lambda: all(job_state(slurm, f"{again}_{i}") in ended for i in (0, 1)), 400)
    assert all(job_state(slurm, f"{again}_{i}") == "COMPLETED" for i in (0, 1))
    assert done < markers(out)
    assert dataset_bytes(out.parent) == dataset_bytes(tmp_path / "one")
