"""Training data in object storage (--data_path=s3://...), against a real S3 server: moto's, started
here on 127.0.0.1 as a process of its own, reached through the standard AWS variables. The loader
reads the bucket's shards by ranges exactly as it reads them from disk; missing buckets, unreachable
endpoints and refused credentials are one line naming the path."""

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
import torch

from fms_fsdp.data import DataError, get_data_loader
from fms_fsdp.distributed import free_port

from conftest import TINY, launch, train_here
from test_data import cfg, make_docs, take, write_dataset

SECRET = "not-a-real-secret-key"


def start_server(port: int, **env: str) -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=1)
            return server
        except OSError:
            time.sleep(0.1)
    server.kill()
    raise RuntimeError("moto's S3 server did not start")


@pytest.fixture(scope="module")
def s3(tmp_path_factory) -> Iterator[tuple[dict, Path]]:
    """(the AWS variables of a running S3 server whose bucket `data` holds a corpus, the same corpus on
    disk): Arrow shards, Parquet rows and gzipped JSON lines with their tokenizer."""
    port = free_port()
    server = start_server(port)
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    local = tmp_path_factory.mktemp("corpus")
    write_dataset(local, "web", make_docs(10, 120, 1))
    write_dataset(local, "code", make_docs(200, 60, 2), layout="parquet")
    write_dataset(local, "text", make_docs(400, 80, 3), layout="jsonl.gz")
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.mkdir("data")
    fs.put(f"{local}/", "data/corpus/", recursive=True)
    try:
        yield env, local
    finally:
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
        server.kill()


def test_the_loader_reads_a_bucket_as_it_reads_the_disk(s3):
    env, local = s3
    remote = get_data_loader(cfg(local, data_path="s3://data/corpus", num_workers=2), 1, 2)
    on_disk = get_data_loader(cfg(local, num_workers=2), 1, 2)
    assert [d.tokens for d in remote.datasets] == [d.tokens for d in on_disk.datasets]
    for (x1, y1), (x2, y2) in zip(take(remote, 12), take(on_disk, 12)):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_training_and_evaluation_from_a_bucket_keep_no_credentials(s3, tmp_path):
    env, local = s3
    common = ["--use_dummy_dataset=False", "--file_type=auto", f"--tokenizer_path={local / 'tokenizer.json'}",
              "--vocab_size=4096", "--num_steps=4", "--batch_size=4", "--logical_shards=8", "--num_workers=1",
              "--eval_interval=4", "--eval_batches=2"]
    remote = train_here(tmp_path / "remote", [*common, "--data_path=s3://data/corpus",
                                              "--eval_data_path=s3://data/corpus"])
    disk = train_here(tmp_path / "disk", [*common, f"--data_path={local}", f"--eval_data_path={local}"])
    assert [r.get("loss", r.get("eval_loss")) for r in remote] == [r.get("loss", r.get("eval_loss")) for r in disk]
    saved = (tmp_path / "remote" / "run" / "config.yaml").read_text()
    assert "s3://data/corpus" in saved and SECRET not in saved and "testing" not in saved
    proc = launch("main_training.py", [*TINY, *common, "--data_path=s3://data/corpus",
                                       "--eval_interval=0", f"--ckpt_save_path={tmp_path / 'two'}"], 2, extra_env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]  # two ranks, each with a loader worker reading by ranges
    assert SECRET not in proc.stdout + proc.stderr


def test_a_bucket_that_cannot_be_read_is_one_line_naming_the_path(s3, monkeypatch):
    import s3fs

    env, local = s3

    def error() -> str:
        s3fs.S3FileSystem.clear_instance_cache()  # a new client, which reads the endpoint variable again
        with pytest.raises(DataError) as e:
            get_data_loader(cfg(local, data_path="s3://data-missing/corpus"), 0, 1)
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
    assert message.startswith("--data_path: cannot read s3://data-missing/corpus (PermissionError") \
        and SECRET not in message
