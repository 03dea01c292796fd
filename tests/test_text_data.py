"""Raw text tokenized on the fly (--tokenizer_path): bad records, one separator per document, start-up
errors, the index cache, and a training run with evaluation on raw text. Coverage, resume and rescaling
of raw text datasets are in tests/test_data.py, next to the tokenized layouts."""

import gzip
import json
import math
import os
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from fms_fsdp.data import DataError
from fms_fsdp.errors import ConfigError
from fms_fsdp.startup import facts

from conftest import data_loader, train_here
from test_data import EOS, cfg, lines_of, make_docs, spell, take, write_dataset, write_text, write_tokenizer


def epoch_stream(loader, docs: list[list[int]], seq_length: int) -> np.ndarray:
    """The first epoch's tokens (every document and its eos)."""
    total = sum(len(d) + 1 for d in docs)
    return lines_of(take(loader, total // (seq_length + 1) // 2 + 2)).reshape(-1)[:total]


def test_bad_records_are_skipped_and_counted_per_file(tmp_path, capsys):
    docs = make_docs(10, 30, 1)
    good = [json.dumps({"text": spell(d)}).encode() for d in docs]
    bad = [
        b"{not json",
        json.dumps({"content": "t5"}).encode(),
        json.dumps({"text": 7}).encode(),
        b'{"text": "t5 \xff t6"}',
        json.dumps({"text": ""}).encode(),
        b'"just a string"',
        b"   ",
    ]
    lines = [line for pair in zip(good, bad * 4) for line in pair] + good[len(bad) * 4 :]
    write_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "web").mkdir()
    (tmp_path / "web" / "mixed.jsonl.gz").write_bytes(gzip.compress(b"\n".join(lines) + b"\n"))
    pq.write_table(pa.table({"text": [spell(d) for d in docs[:4]] + [None, ""]}), tmp_path / "web" / "p.parquet")
    loader = data_loader(cfg(tmp_path, logical_shards=2, seq_length=15), 0, 1)
    stream = epoch_stream(loader, docs + docs[:4], 15)
    assert Counter(stream.tolist()) == Counter([t for d in docs + docs[:4] for t in d] + [EOS] * (len(docs) + 4))
    log = capsys.readouterr().out
    assert (
        "mixed.jsonl.gz: 24 bad records skipped ('text' is not a string 4, first at line 6, empty text 4, first at "
        "line 10, invalid JSON 4, first at line 2, invalid UTF-8 4, first at line 8, missing 'text' 4, first at "
        "line 4, not a JSON object 4, first at line 12)"
    ) in log  # blank lines are not records
    assert "p.parquet: 2 bad records skipped (empty text 1, first at row 5, missing 'text' 1, first at row 4)" in log


@pytest.mark.parametrize("appends", [[], [EOS], [5]])
def test_one_separator_per_document_whatever_the_tokenizer_appends(tmp_path, appends):
    docs = make_docs(10, 40, 2)
    write_dataset(tmp_path, "web", docs, "jsonl", files=2)
    write_tokenizer(tmp_path / "tokenizer.json", appends=appends)  # replaces the plain one
    c = cfg(tmp_path, logical_shards=4, seq_length=15)
    stream = epoch_stream(data_loader(c, 0, 1), docs, 15)
    assert Counter(stream.tolist()) == Counter([t for d in docs for t in d] + [EOS] * len(docs))
    assert (stream[np.flatnonzero(stream == EOS)[:-1] + 1] != EOS).all()  # never two in a row
    warned = any("set --eos_token=5 if that is its end-of-text token" in note for note in facts(c).notes)
    assert warned == (appends == [5])


def test_bos_token_keeps_its_meaning(tmp_path):
    docs = make_docs(10, 20, 3)
    write_dataset(tmp_path, "web", docs, "jsonl.gz", files=1)
    lines = lines_of(take(data_loader(cfg(tmp_path, bos_token=1, logical_shards=2, seq_length=23), 0, 1), 6))
    stream = lines.reshape(-1)
    starts = np.flatnonzero(stream == 1)
    assert all(stream[s - 1] == EOS for s in starts if s > 0) and len(starts) >= 10
    assert all(stream[s + 1] >= 10 for s in starts[:-1])


def test_raw_text_errors_are_one_line_at_start_up(tmp_path):
    data = tmp_path / "data"

    def error(kind: type, **kw) -> str:
        with pytest.raises(kind) as e:
            c = cfg(data, **kw)
            facts(c)
            take(data_loader(c, 0, 1), 2)
        assert "\n" not in str(e.value)
        return str(e.value)

    write_text(data / "web" / "a.jsonl", make_docs(10, 20, 4))
    with open(data / "web" / "a.jsonl", "a") as f:
        f.write("\n")  # a blank line is no record: the file still has none with text
    assert (
        "no .arrow or .parquet or .bin or .idx or .npy files (--file_type=auto); raw text (.jsonl, .jsonl.gz, .json.gz) needs "
        "--tokenizer_path" in error(DataError)
    )
    tok = write_tokenizer(tmp_path / "tok" / "tokenizer.json")
    assert "none of its 20 records has text (missing 'content' 20); check --text_field (now 'content')" in error(
        DataError, tokenizer_path=str(tok), text_field="content"
    )
    big = write_tokenizer(tmp_path / "big" / "tokenizer.json", vocab=5000)
    assert "has 5001 tokens but tiny's vocabulary is 4096; set --vocab_size=5001" in error(
        ConfigError, tokenizer_path=str(big)
    )
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "tokenizer.json").write_text("{not a tokenizer")
    assert "--tokenizer_path: cannot load" in error(ConfigError, tokenizer_path=str(tmp_path / "junk"))
    (data / "web" / "b.jsonl.gz").write_bytes(gzip.compress(b'{"text": "t5"}\n' * 50)[:-30])
    message = error(DataError, tokenizer_path=str(tok))
    assert "web/b.jsonl.gz: cannot read it" in message and "fix or remove this file" in message


def test_text_index_is_cached_until_a_file_changes(tmp_path):
    """In the run's folder (the data folder may be read-only); in the data folder's meta/ only when
    --data_cache_dir=meta asks for it."""
    write_dataset(tmp_path, "web", make_docs(10, 30, 5), "jsonl", files=2)
    tmp_path.chmod(0o555)  # read-only data
    try:
        data_loader(cfg(tmp_path), 0, 1)
    finally:
        tmp_path.chmod(0o755)
    assert not (tmp_path / "meta").exists()
    run_cache = list(tmp_path.with_name(tmp_path.name + ".run").glob("data_cache/*/text_index_fms_fsdp_cache.json"))
    assert len(run_cache) == 1 and sorted(json.loads(run_cache[0].read_text())["files"]) == [
        "/web/part0.jsonl",
        "/web/part1.jsonl",
    ]
    loader = data_loader(cfg(tmp_path, data_cache_dir="meta"), 0, 1)
    cache = tmp_path / "meta" / "text_index_fms_fsdp_cache.json"
    files = json.loads(cache.read_text())["files"]
    assert sorted(files) == ["/web/part0.jsonl", "/web/part1.jsonl"] and loader.datasets[0].documents == 30
    assert loader.datasets[0].tokens == pytest.approx(sum(len(d) for d in make_docs(10, 30, 5)), rel=0.01)
    before = os.stat(cache).st_mtime_ns
    data_loader(cfg(tmp_path, data_cache_dir="meta"), 0, 1)
    assert os.stat(cache).st_mtime_ns == before  # nothing indexed again
    write_text(tmp_path / "web" / "part1.jsonl", make_docs(100, 40, 6))
    assert data_loader(cfg(tmp_path, data_cache_dir="meta"), 0, 1).datasets[0].documents == 15 + 40


@pytest.mark.parametrize("layout", ["jsonl", "arrow"])
def test_a_data_cache_that_cannot_be_written_is_one_note_and_the_data_is_read(tmp_path, capsys, layout):
    """--data_cache_dir where no folder can be made (under a file): raw text's index and token files'
    counts alike, one note naming the folder and why, and the same batches as with a cache."""
    write_dataset(tmp_path / "data", "web", make_docs(10, 30, 5), layout, files=2)
    (tmp_path / "blocked").write_text("a file, not a folder")
    blocked = take(data_loader(cfg(tmp_path / "data", data_cache_dir=str(tmp_path / "blocked")), 0, 1), 4)
    notes = [line for line in capsys.readouterr().out.splitlines() if "cannot write the data cache" in line]
    assert len(notes) == 1 and str(tmp_path / "blocked") in notes[0] and "--data_cache_dir" in notes[0], notes
    cached = take(data_loader(cfg(tmp_path / "data", data_cache_dir=str(tmp_path / "cache")), 0, 1), 4)
    assert "cannot write" not in capsys.readouterr().out
    assert all(torch.equal(a[0], b[0]) for a, b in zip(blocked, cached))


def test_training_and_evaluation_on_raw_text(tmp_path):
    data, held_out = tmp_path / "data", tmp_path / "eval"
    write_dataset(data, "web", make_docs(10, 200, 7), "jsonl.gz", files=2)
    write_dataset(held_out, "web", make_docs(10, 40, 8), "jsonl", files=1)
    tokenizer = write_tokenizer(tmp_path / "tokenizer.json", vocab=250)  # the tiny test model has 256 tokens
    records = train_here(
        tmp_path,
        [
            "--use_dummy_dataset=False",
            f"--data_path={data}",
            f"--tokenizer_path={tokenizer}",
            f"--eval_data_path={held_out}",
            "--eval_interval=3",
            "--num_steps=6",
            "--report_interval=3",
            "--batch_size=4",
            "--num_workers=1",
            "--logical_shards=8",
        ],
    )
    train_losses = [r["loss"] for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert len(train_losses) == 2 and all(math.isfinite(x) for x in train_losses)
    # it learns: the held-out loss (the same lines each time; training batches differ) goes down
    assert [r["step"] for r in evals] == [3, 6] and evals[1]["eval_loss"] < evals[0]["eval_loss"], evals
    assert 0 < evals[0]["eval_tokens"] <= sum(len(d) + 1 for d in make_docs(10, 40, 8))
