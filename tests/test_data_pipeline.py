"""Raw text -> prepare_data -> the loader -> training, end to end."""

import json
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from fms_fsdp.flags import make_config

from conftest import ROOT, data_loader, train

SENTENCES = [
    "the quick brown fox jumps over the lazy dog. ",
    "pack my box with five dozen liquor jugs. ",
    "how vexingly quick daft zebras jump! ",
]


def texts(n: int) -> list[str]:
    rng = np.random.default_rng(0)
    return ["".join(SENTENCES[i] for i in rng.integers(0, 3, int(rng.integers(1, 12)))) + f"#{k}" for k in range(n)]


def prepare(tmp, docs: list[str]) -> None:
    raw = tmp / "raw"
    raw.mkdir()
    (raw / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[: len(docs) // 2]))
    for k, t in enumerate(docs[len(docs) // 2 :]):
        (raw / f"b{k}.txt").write_text(t)
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/prepare_data.py",
            f"--input={raw}",
            f"--output={tmp / 'data' / 'web'}",
            "--tokenizer=byte",
            "--shard_tokens=2000",
            "--workers=2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr


def test_text_in_the_same_tokens_out_of_the_loader(tmp_path):
    docs = texts(60)
    prepare(tmp_path, docs)
    cfg = make_config(
        data_path=str(tmp_path / "data"),
        model_variant="tiny",
        seq_length=63,
        batch_size=4,
        logical_shards=6,
        num_workers=0,
    )
    total = sum(len(t.encode()) + 1 for t in docs)
    it = iter(data_loader(cfg, 0, 1))
    lines = []
    while sum(len(x) for x in lines) < total:
        x, y = next(it)
        lines.extend(np.concatenate([x.numpy(), y[:, -1:].numpy()], axis=1))
    stream = np.concatenate(lines)[:total]
    assert stream[-1] == 0  # the eos after the last document of the epoch
    out = [bytes(d.astype(np.uint8).tolist()).decode() for d in np.split(stream[:-1], np.flatnonzero(stream[:-1] == 0))]
    out = [d.lstrip("\0") for d in out]
    assert Counter(out) == Counter(docs)


@pytest.mark.slow  # 17 s: preparation, then two ranks training
def test_training_on_prepared_shards_two_ranks(tmp_path):
    prepare(tmp_path, texts(200))
    records = train(
        tmp_path,
        [
            "--use_dummy_dataset=False",
            f"--data_path={tmp_path / 'data'}",
            "--num_steps=12",
            "--batch_size=4",
            "--num_workers=1",
            "--logical_shards=16",
        ],
        nproc=2,
    )
    assert records[-1]["loss"] < records[0]["loss"] - 1.0, [r["loss"] for r in records]
    assert all(0 <= r["data_wait"] < 1 for r in records)
