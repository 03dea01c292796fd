"""Object storage (s3:// URLs) for data, checkpoints and exports, against a real S3 server: moto's,
started here on 127.0.0.1 as a process of its own, reached through the standard AWS variables. The
loader reads the bucket's shards by ranges exactly as it reads them from disk; a run checkpoints to a
bucket, is killed, and resumes from it exactly; a LoRA run saves and exports there; missing buckets,
unreachable endpoints and refused credentials are one line naming the path."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
import torch
from safetensors.torch import load_file, save_file

from fms_fsdp.checkpoint.export import export_checkpoint
from fms_fsdp.checkpoint.layout import complete_checkpoints
from fms_fsdp.data import DataError
from fms_fsdp.errors import CheckpointError, ConfigError
from fms_fsdp.flags import parse_args
from fms_fsdp.metrics.compare import compare_runs
from fms_fsdp.metrics.plot import read_metrics
from fms_fsdp.parallel.process_group import free_port
from fms_fsdp.storage import location
from fms_fsdp.weights.hf import convert
from fms_fsdp.weights.reader import read_model

from conftest import STEPS, TINY, data_loader, flags, launch, run_here, train_here
from held_at import wait_held
from test_checkpoint import kill_tree, start
from test_data import cfg, make_docs, take, write_dataset
from test_lora import LORA

SECRET = "not-a-real-secret-key"


def start_server(port: int, **env: str) -> subprocess.Popen:
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(100):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=1)
            return server
        except OSError:
            time.sleep(0.1)
    server.kill()
    raise RuntimeError("moto's S3 server did not start")


def s3_settings(port: int) -> dict[str, str]:
    """The AWS variables that reach moto's S3 server on `port`."""
    return {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }


@pytest.fixture(scope="module")
def s3(tmp_path_factory) -> Iterator[tuple[dict, Path]]:
    """(the AWS variables of a running S3 server whose bucket `data` holds a corpus, the same corpus on
    disk): Arrow shards, Parquet rows and gzipped JSON lines with their tokenizer."""
    port = free_port()
    server = start_server(port)
    env = s3_settings(port)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    local = tmp_path_factory.mktemp("corpus")
    write_dataset(local, "web", make_docs(10, 120, 1))
    write_dataset(local, "code", make_docs(200, 60, 2), layout="parquet")
    write_dataset(local, "text", make_docs(400, 80, 3), layout="jsonl.gz")
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.mkdir("data")
    fs.mkdir("runs")
    fs.put(f"{local}/", "data/corpus/", recursive=True)
    try:
        yield env, local
    finally:
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
        server.kill()


def test_the_loader_reads_a_bucket_as_it_reads_the_disk(s3):
    env, local = s3
    remote = data_loader(cfg(local, data_path="s3://data/corpus", num_workers=2), 1, 2)
    on_disk = data_loader(cfg(local, num_workers=2), 1, 2)
    assert [d.tokens for d in remote.datasets] == [d.tokens for d in on_disk.datasets]
    for (x1, y1), (x2, y2) in zip(take(remote, 12), take(on_disk, 12)):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    # the same files named by patterns (brace ranges, globs), as Levanter's configs name them
    patterns = [
        "code=s3://data/corpus/code/part{0..2}.parquet",
        "text=s3://data/corpus/text/*.jsonl.gz",
        "web=s3://data/corpus/web/sub*/*.arrow",
    ]
    given = data_loader(cfg(local, data_path="s3://nowhere", datasets=patterns, num_workers=2), 1, 2)
    for (x1, y1), (x2, y2) in zip(take(given, 12), take(data_loader(cfg(local, num_workers=2), 1, 2), 12)):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_a_token_cache_in_a_bucket_is_built_once_and_read_as_one_on_disk(s3, tmp_path, capsys):
    """--cache_dir=s3://...: the bucket's raw text tokenized into another bucket, whose batches are those of
    a cache on disk built first; a later start reads it as it is."""
    env, local = s3
    text = dict(datasets=["text"], vocab_size=4096)
    remote = take(data_loader(cfg(local, data_path="s3://data/corpus", cache_dir="s3://runs/cache", **text), 0, 1), 6)
    assert "note: tokenizing text into s3://runs/cache/text with " in capsys.readouterr().out
    on_disk = take(data_loader(cfg(local, cache_dir=str(tmp_path / "cache"), cache_build="first", **text), 0, 1), 6)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(remote, on_disk))
    again = take(data_loader(cfg(local, data_path="s3://data/corpus", cache_dir="s3://runs/cache", **text), 0, 1), 6)
    assert "note: text: reading the tokenized cache s3://runs/cache/text" in capsys.readouterr().out
    assert all(torch.equal(a[0], b[0]) for a, b in zip(remote, again))


def test_every_layout_is_read_from_a_bucket_as_from_the_disk(s3, tmp_path):
    """datasets' streams, OLMo's and Dolma's token arrays, np.save, Megatron's .bin/.idx, fms-fsdp's Arrow:
    by byte ranges."""
    import s3fs
    from test_data_layouts import mixed

    local = tmp_path / "layouts"
    local.mkdir()
    flags = mixed(local)
    s3fs.S3FileSystem().put(f"{local}/", "data/layouts/", recursive=True)
    remote = data_loader(cfg(local, data_path="s3://data/layouts", **flags), 0, 2)
    on_disk = data_loader(cfg(local, **flags), 0, 2)
    assert [d.tokens for d in remote.datasets] == [d.tokens for d in on_disk.datasets]
    for (x1, _), (x2, _) in zip(take(remote, 8), take(on_disk, 8)):
        assert torch.equal(x1, x2)


def test_training_and_evaluation_from_a_bucket_keep_no_credentials(s3, tmp_path):
    env, local = s3
    common = [
        "--use_dummy_dataset=False",
        "--file_type=auto",
        f"--tokenizer_path={local / 'tokenizer.json'}",
        "--vocab_size=4096",
        "--num_steps=4",
        "--batch_size=4",
        "--logical_shards=8",
        "--num_workers=1",
        "--eval_interval=4",
        "--eval_batches=2",
    ]
    remote = train_here(
        tmp_path / "remote", [*common, "--data_path=s3://data/corpus", "--eval_data_path=s3://data/corpus"]
    )
    disk = train_here(tmp_path / "disk", [*common, f"--data_path={local}", f"--eval_data_path={local}"])
    assert [r.get("loss", r.get("eval_loss")) for r in remote] == [r.get("loss", r.get("eval_loss")) for r in disk]
    saved = (tmp_path / "remote" / "run" / "config.yaml").read_text()
    assert "s3://data/corpus" in saved and SECRET not in saved and "testing" not in saved


def test_prepared_into_a_bucket_the_counts_travel_with_the_data_and_other_data_is_cached_there(s3, tmp_path, capsys):
    """fms-prepare-data from a bucket into a bucket writes what it writes on disk, counts included, and a
    start over it counts nothing; a start over remote data prepared elsewhere caches what it learns in
    the run's bucket folder, and the next start reads that instead of the files."""
    import s3fs
    from test_prepare_pieces import dataset_bytes, prepare, write_corpus

    env, local = s3
    fs = s3fs.S3FileSystem()
    write_corpus(tmp_path / "raw", lines=120)
    fs.put(f"{tmp_path / 'raw'}/", "data/raw/", recursive=True)
    flags = ["--tokenizer=byte", "--piece_bytes=3000", "--shard_tokens=2000"]
    prepare("s3://data/raw", "s3://data/prepared/ds", *flags, "--workers=2")
    prepare(tmp_path / "raw", tmp_path / "disk" / "ds", *flags)
    fs.get("data/prepared/", f"{tmp_path / 'fetched'}/", recursive=True)
    assert dataset_bytes(tmp_path / "fetched") == dataset_bytes(tmp_path / "disk")

    prepared = cfg(
        local, data_path="s3://data/prepared", vocab_size=256, tokenizer_path=None, data_cache_dir="s3://runs/cache-a"
    )
    on_disk = cfg(local, data_path=str(tmp_path / "disk"), vocab_size=256, tokenizer_path=None)
    for (x1, _), (x2, _) in zip(take(data_loader(prepared, 0, 1), 6), take(data_loader(on_disk, 0, 1), 6)):
        assert torch.equal(x1, x2)
    assert not fs.exists("runs/cache-a"), "counts came with the data: nothing to cache"

    elsewhere = cfg(local, data_path="s3://data/corpus", data_cache_dir="s3://runs/cache-b")
    capsys.readouterr()
    first = [x for x, _ in take(data_loader(elsewhere, 0, 1), 4)]
    assert "note: indexing raw text files (once: cached in s3://runs/cache-b/" in capsys.readouterr().out
    cached = {key: fs.info(key)["LastModified"] for key in fs.find("runs/cache-b")}
    assert any(key.endswith("counts_fms_fsdp_cache.csv") for key in cached)
    again = [x for x, _ in take(data_loader(elsewhere, 0, 1), 4)]
    assert "indexing" not in capsys.readouterr().out
    assert {key: fs.info(key)["LastModified"] for key in fs.find("runs/cache-b")} == cached
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_a_bucket_that_cannot_be_read_is_one_line_naming_the_path(s3, monkeypatch):
    import s3fs

    env, local = s3

    def error() -> str:
        s3fs.S3FileSystem.clear_instance_cache()  # a new client, which reads the endpoint variable again
        with pytest.raises(DataError) as e:
            data_loader(cfg(local, data_path="s3://data-missing/corpus"), 0, 1)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "--data_path: folder not found: s3://data-missing/corpus" in error()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    assert error().startswith("--data_path: cannot read s3://data-missing/corpus (")
    port = free_port()
    guarded = start_server(port, INITIAL_NO_AUTH_ACTION_COUNT="0")  # checks credentials: these are unknown
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
        message = error()
    finally:
        guarded.kill()
        s3fs.S3FileSystem.clear_instance_cache()
    assert (
        message.startswith("--data_path: cannot read s3://data-missing/corpus (PermissionError")
        and SECRET not in message
    )


def test_runs_in_a_bucket_are_compared_as_runs_on_the_disk(s3, capsys):
    """fms-compare-runs of a run folder in the bucket against a metrics.jsonl there: the same verdicts,
    the gap found at its step."""
    import s3fs

    steps = [{"step": s, "loss": 5.0 - s / 10, "grad_norm": 1.0} for s in (1, 2, 3)]
    fs = s3fs.S3FileSystem()
    fs.pipe("runs/a/metrics.jsonl", "\n".join(json.dumps(r) for r in steps).encode())
    off = [{**r, "loss": r["loss"] + (0.5 if r["step"] == 3 else 0)} for r in steps]
    fs.pipe("runs/b/metrics.jsonl", "\n".join(json.dumps(r) for r in off).encode())
    assert compare_runs("s3://runs/a", "s3://runs/a/metrics.jsonl")
    assert "within the tolerance (rtol 0.001, atol 1e-06) over 3 steps" in capsys.readouterr().out
    assert not compare_runs("s3://runs/b", "s3://runs/a/metrics.jsonl")
    assert (
        "beyond the tolerance (rtol 0.001, atol 1e-06) at 1 of 3 steps, first at step 3 (loss)"
        in capsys.readouterr().out
    )


def bucket_losses(url: str) -> dict[int, float]:
    """step -> loss of a run's metrics.jsonl in a bucket (a step logged twice keeps its last value)."""
    path = location(url, "ckpt_save_path") / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


@pytest.mark.slow  # a 2-rank run killed and resumed from a bucket (about 57 s): the slow tier
def test_a_run_checkpoints_to_a_bucket_is_killed_and_resumes_from_it_exactly(s3, data, uninterrupted, tmp_path):
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.put(f"{data}/", "data/checkpointed/", recursive=True)
    out = "s3://runs/killed"
    args = flags("s3://data/checkpointed", out, "--checkpoint_interval=6", "--checkpoint_keep=1")  # type: ignore[arg-type]
    held = tmp_path / "held"
    proc = start(args, held=(held, "step:7"))
    wait_held(held, 2, [proc])  # both ranks before step 7: step 6 is saved and committed, its record written
    kill_tree(proc.pid, signal.SIGKILL)  # every process, six steps before the next checkpoint
    proc.wait()
    root = location(out, "ckpt_save_path") / "checkpoints"
    assert [s for s, _ in complete_checkpoints(root)] == [6]
    assert max(bucket_losses(out)) == 6  # the log is uploaded with the report that follows a checkpoint
    for name in (".metadata", "SAVING"):  # a save killed half-way, and a folder of another tool
        fs.put(f"{uninterrupted}/checkpoints/step_6_ckp/.metadata", f"runs/killed/checkpoints/step_9_ckp/{name}")
    fs.put(f"{uninterrupted}/checkpoints/step_6_ckp/.metadata", "runs/killed/checkpoints/step_3_ckp/.metadata")
    assert [s for s, _ in complete_checkpoints(root)] == [6]  # a step folder without its marker is no checkpoint
    resumed = launch("main_training.py", args, 2)  # the same command resumes, from the bucket
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert SECRET not in resumed.stdout + resumed.stderr  # two ranks, each with a loader worker reading by ranges
    assert "step_6_ckp at step 6" in resumed.stdout and "free-space guard does not apply" in resumed.stdout
    ref, got = (
        {
            r["step"]: r["loss"]
            for r in map(json.loads, (uninterrupted / "metrics.jsonl").read_text().splitlines())
            if "loss" in r
        },
        bucket_losses(out),
    )
    assert sorted(got) == list(range(1, STEPS + 1)) and got == ref  # the same losses as a run on disk, uninterrupted
    assert [s for s, _ in complete_checkpoints(root)] == [12]  # --checkpoint_keep=1 deleted step 6 in the bucket
    assert not fs.exists("runs/killed/checkpoints/step_6_ckp") and not fs.exists("runs/killed/checkpoints/step_9_ckp")
    assert fs.exists("runs/killed/checkpoints/step_3_ckp/.metadata")  # not this package's: left alone
    a, b = read_model(uninterrupted / "checkpoints" / "step_12_ckp"), read_model(root / "step_12_ckp")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    export_checkpoint(
        f"{out}/checkpoints/step_12_ckp", f"{out}/model.safetensors"
    )  # fms-export-model, bucket to bucket
    fs.get("runs/killed/model.safetensors", str(tmp_path / "from_bucket.safetensors"))
    exported = load_file(str(tmp_path / "from_bucket.safetensors"))
    assert exported.keys() == a.keys() and all(torch.equal(exported[k], a[k]) for k in a)
    convert(f"{out}/checkpoints/step_12_ckp", f"{out}/hf", dtype="fp32")  # fms_to_hf, bucket to bucket
    fs.get("runs/killed/hf/", str(tmp_path / "hf_from_bucket"), recursive=True)
    local = convert(str(uninterrupted / "checkpoints" / "step_12_ckp"), str(tmp_path / "hf_local"), dtype="fp32")
    got, want = (load_file(str(p / "model.safetensors")) for p in (tmp_path / "hf_from_bucket", local))
    assert (
        (tmp_path / "hf_from_bucket" / "COMPLETE").is_file()
        and got.keys() == want.keys()
        and all(torch.equal(got[k], want[k]) for k in want)
    )


@pytest.mark.slow  # runs to and from a bucket with exports (about 30 s): the slow tier
def test_a_lora_run_from_a_bucket_saves_and_exports_to_it(s3, tmp_path):
    import s3fs

    fs = s3fs.S3FileSystem()
    base = tmp_path / "base"
    train_here(base, ["--num_steps=2"])  # the model to adapt, saved in the bucket as its checkpoint folder
    fs.put(f"{base}/run/checkpoints/step_2_ckp/", "runs/base/", recursive=True)
    common = [*LORA, "--num_steps=4", "--export_interval=2", "--export_keep=1", "--export_model_at_end=True"]
    run_here([*common, "--ckpt_load_path=s3://runs/base", "--ckpt_save_path=s3://runs/lora"])
    run_here([*common, f"--ckpt_load_path={base}/run/checkpoints/step_2_ckp", f"--ckpt_save_path={tmp_path / 'disk'}"])
    assert bucket_losses("s3://runs/lora") == {
        r["step"]: r["loss"] for r in map(json.loads, (tmp_path / "disk" / "metrics.jsonl").read_text().splitlines())
    }
    assert [r["step"] for r in read_metrics(location("s3://runs/lora", "metrics"))] == [1, 2, 3, 4]  # plot_metrics
    listing = {p.removeprefix("runs/lora/") for p in fs.find("runs/lora")}
    assert {
        "config.yaml",
        "checkpoints/step_4_ckp/COMPLETE",
        "exports/step_4/COMPLETE",
        "exports/step_4/model.safetensors",
        "exports/step_4/adapter/adapter_model.safetensors",
        "model_step_4.safetensors",
        "adapter_step_4/adapter_config.json",
        "adapter_step_4/COMPLETE",
    } <= listing
    assert not any(p.startswith(("exports/step_2", "exports/.")) for p in listing)  # --export_keep=1, no leftovers
    for name in (
        "model_step_4.safetensors",
        "exports/step_4/model.safetensors",
        "exports/step_4/adapter/adapter_model.safetensors",
        "adapter_step_4/adapter_model.safetensors",
    ):
        fs.get(f"runs/lora/{name}", str(tmp_path / "got.safetensors"))
        got, want = load_file(str(tmp_path / "got.safetensors")), load_file(str(tmp_path / "disk" / name))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), name
    with pytest.raises(CheckpointError, match="is a LoRA checkpoint: it holds the adapters only"):
        read_model(location("s3://runs/lora/checkpoints/step_4_ckp", "ckpt_load_path"))  # only what trains


def test_a_checkpoint_bucket_that_cannot_be_used_is_one_line_before_training(s3, tmp_path, monkeypatch, capsys):
    import s3fs

    from fms_fsdp.startup import facts
    from fms_fsdp.train.loop import run_training

    def error(flag: str, path: str) -> str:
        s3fs.S3FileSystem.clear_instance_cache()  # a new client, which reads the endpoint variable again
        saved = dict(os.environ)  # run_training() sets the process group's variables (RANK, MASTER_PORT, ...)
        try:
            with pytest.raises(ConfigError) as e:
                flags = [*TINY, "--num_steps=2", f"--ckpt_save_path={tmp_path / 'run'}", f"--{flag}={path}"]
                run_training(lambda: facts(parse_args(flags)))
        finally:
            os.environ.clear()
            os.environ.update(saved)
        assert "\n" not in str(e.value) and "step 1 |" not in capsys.readouterr().out  # nothing trained
        return str(e.value)

    assert error("ckpt_save_path", "s3://no-such-bucket/run").startswith(
        "--ckpt_save_path: cannot write s3://no-such-bucket/run ("
    )
    assert (
        error("ckpt_load_path", "s3://runs/no-such-model") == "--ckpt_load_path: s3://runs/no-such-model does not exist"
    )
    # the run lease holds in a bucket too: a live owner's marker refuses a second run
    beat = time.time()
    (location("s3://runs/leased", "ckpt_save_path") / "owner.json").write_text(
        json.dumps(dict(host="other-node", pid=1, job="", started=beat, heartbeat=beat, token="0" * 32))
    )
    assert error("ckpt_save_path", "s3://runs/leased").startswith(
        "--ckpt_save_path: s3://runs/leased belongs to a running run (pid 1 on other-node"
    )
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    assert error("ckpt_save_path", "s3://runs/run").startswith("--ckpt_save_path: cannot write s3://runs/run (")
    port = free_port()
    guarded = start_server(port, INITIAL_NO_AUTH_ACTION_COUNT="0")  # checks credentials: these are unknown
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
        message = error("ckpt_save_path", "s3://runs/run")
    finally:
        guarded.kill()
        s3fs.S3FileSystem.clear_instance_cache()
    assert message.startswith("--ckpt_save_path: cannot write s3://runs/run (PermissionError") and SECRET not in message
    with pytest.raises(ConfigError, match="--tracker_dir: set a local folder"):  # files that grow stay local
        parse_args([*TINY, "--ckpt_save_path=s3://runs/run", "--tracker=tensorboard"])


@pytest.mark.slow
def test_a_hugging_face_folder_in_a_bucket_is_read_by_ranges_and_exported_to_one(s3, tmp_path):
    """--ckpt_load_path of a sharded Hugging Face folder in a bucket, read slice by slice by byte ranges
    (nothing downloaded whole), then one step at learning rate 0 exported as a Hugging Face folder to a
    bucket by every rank (2), marked COMPLETE: the folder's weights, in bf16. A model file in the bucket,
    read the same way."""
    import s3fs
    from test_hf_sharded import save_hf, scaled_config

    from test_hf import read_hf_model

    fs = s3fs.S3FileSystem()
    hf = save_hf(tmp_path / "hf")
    fs.put(f"{hf}/", "runs/hf_in/", recursive=True)
    proc = launch(
        "main_training.py",
        [
            *TINY,
            "--rope_scaling_factor=4",
            "--vocab_size=512",
            "--num_steps=1",
            "--learning_rate=0",
            "--checkpoint_interval=0",
            "--export_interval=1",
            "--export_format=hf",
            "--ckpt_load_path=s3://runs/hf_in",
            "--ckpt_save_path=s3://runs/hf_out",
        ],
        2,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    listing = {p.removeprefix("runs/hf_out/exports/step_1/") for p in fs.find("runs/hf_out/exports/step_1")}
    shards = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    assert listing == {*shards, "model.safetensors.index.json", "config.json", "generation_config.json", "COMPLETE"}
    fs.get("runs/hf_out/exports/step_1/", str(tmp_path / "out"), recursive=True)
    want, got = read_hf_model(str(hf), scaled_config()), read_hf_model(str(tmp_path / "out"), scaled_config())
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k].bfloat16()) for k in want)
    # a model file in the bucket: each rank reads its rows of it by byte ranges
    save_file(want, str(tmp_path / "m.safetensors"))
    fs.put(str(tmp_path / "m.safetensors"), "runs/m.safetensors")
    common = [*TINY, "--rope_scaling_factor=4", "--vocab_size=512", "--num_steps=1", "--learning_rate=0"]
    proc = launch(
        "main_training.py",
        [
            *common,
            "--checkpoint_interval=0",
            "--export_model_at_end=True",
            "--ckpt_load_path=s3://runs/m.safetensors",
            f"--ckpt_save_path={tmp_path / 'from_file'}",
        ],
        2,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    end = load_file(str(tmp_path / "from_file" / "model_step_1.safetensors"))
    assert end.keys() == want.keys() and all(torch.equal(end[k], want[k]) for k in want)
