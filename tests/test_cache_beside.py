"""Training while --cache_dir is built (--cache_build=beside, the default; external): the batches are raw
text's, whatever the build has done (none of it, some pieces, all; a builder killed and started again,
stopped midway, or with a pool worker killed; an array's task killed in a piece); the cache it leaves is
fms-prepare-data's, byte for byte; a stop or resume mid-build goes on exactly and keeps the pieces
finished before; a checkpoint that read the cache in its own order says how to resume."""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from fms_fsdp.data import DataError
from fms_fsdp.data.prepare.build import Engine, Share, prepare_files, recipe_of
from fms_fsdp.data.text import TextFile, TextSpec, index_file
from fms_fsdp.data.text_cache import BuildingCache, CachedTextFile

from conftest import ROOT, data_loader, records, run_here, train_here
from held_at import wait_held
from test_data import cfg, make_docs, spell, take, write_dataset, write_tokenizer


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def prepare(corpus: Path, output: Path, *flags: str) -> None:
    """fms-prepare-data over corpus/text into `output` (its flags: a share of an array's tasks, ...)."""
    command = [sys.executable, "scripts/prepare_data.py", f"--input={corpus / 'text'}", f"--output={output}"]
    command += [f"--tokenizer={corpus / 'tokenizer.json'}", *flags]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True)


# ---------------------------------------------------------------- one file, document by document


def write_messy(path: Path, kind: str) -> int:
    """A text file of 1000 records, some of them blank lines, bad JSON or empty texts; its documents."""
    rng = np.random.default_rng(5)
    texts = [spell([k % 4000] * int(rng.integers(1, 30))) for k in range(1000)]
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "text_parquet":
        pq.write_table(pa.table({"text": [t if k % 37 else "" for k, t in enumerate(texts)]}), path, row_group_size=9)
        return len(texts)
    lines = []
    for k, text in enumerate(texts):
        lines.append(
            "" if k % 41 == 5 else "{bad json" if k % 53 == 7 else json.dumps({"text": text if k % 37 else ""})
        )
    data = ("\n".join(lines) + "\n").encode()
    path.write_bytes(gzip.compress(data) if kind == "jsonl.gz" else data)
    return len(lines)


@pytest.mark.parametrize("kind", ["jsonl", "jsonl.gz", "text_parquet"])
def test_a_file_reads_the_same_documents_from_its_cache_as_from_its_text(tmp_path, kind):
    """Every document of a file cut in several pieces, with blank lines, bad records and empty texts, read
    through the cache with none, half and all of its pieces built: the text's own tokens each time."""
    name = "part.parquet" if kind == "text_parquet" else f"part.{kind}"
    path, tokenizer = tmp_path / "text" / name, write_tokenizer(tmp_path / "tokenizer.json")
    documents = write_messy(path, kind)
    spec = TextSpec(str(tokenizer), "text")
    index = index_file(path, spec)
    assert index.documents == documents and index.empty
    expected = every_document(TextFile(path, index, spec))
    recipe = recipe_of(str(tokenizer), "text", piece_bytes=piece_bytes(path, kind))
    output = tmp_path / "cache"
    cache = BuildingCache(str(output), {str(path.resolve()): 0}, recipe.settings())
    built = {"none": None, "half": Share(0, 2), "all": Share(0, 1)}
    for state, share in built.items():
        if share is not None:
            prepare_files([path], output, recipe, Engine(), share)
        read_from: Counter = Counter()
        cached = CachedTextFile(path, index, spec, cache, read_from)
        assert kind == "jsonl.gz" or len(cached.pieces) >= 3, "the file must be cut in pieces"
        found = every_document(cached)
        assert len(found) == len(expected) and all(np.array_equal(a, b) for a, b in zip(found, expected)), state
        some_tokenized = state == "none" or (state == "half" and kind != "jsonl.gz")  # a gzipped file is one piece
        assert (read_from["cache"] > 0, read_from["tokenized"] > 0) == (state != "none", some_tokenized), state


def piece_bytes(path: Path, kind: str) -> int:
    """About a third of the file, so that it is cut in 3 or 4 pieces; for plain JSON lines the offset of a
    line, so that a piece begins exactly where a line does (the next piece's start falls inside one)."""
    if kind != "jsonl":
        return path.stat().st_size // (4 if kind == "text_parquet" else 3) + 1  # Parquet's metadata are not cut
    starts = np.cumsum([0] + [len(line) for line in path.read_bytes().splitlines(keepends=True)])
    return int(starts[np.searchsorted(starts, path.stat().st_size // 3)])


def every_document(f: TextFile) -> list[np.ndarray]:
    assert f.blocks is not None
    found = []
    for b in range(len(f.blocks) - 1):
        block = f.block(b)
        found += [f.row(block, r) for r in range(int(f.blocks[b + 1] - f.blocks[b]))]
    return found


# ---------------------------------------------------------------- the loader


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A raw-text dataset of three JSON-lines files (with root/tokenizer.json) and a dataset of token files."""
    root = tmp_path_factory.mktemp("raw")
    write_dataset(root, "text", make_docs(400, 600, 3), layout="jsonl")
    write_dataset(root, "web", make_docs(10, 120, 1))
    return root


def batches(corpus: Path, **flags) -> tuple[list, object]:
    loader = data_loader(cfg(corpus, vocab_size=4096, **flags), 0, 1)
    return take(loader, 6), loader


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


def test_the_batches_are_raw_texts_whatever_the_build_has_done(corpus, tmp_path, capsys):
    """Raw text read as it is (no --cache_dir) against a cache: built beside the loader from nothing,
    half built by an array's task (external), complete; the cache left is fms-prepare-data's, byte for byte."""
    raw, _ = batches(corpus)
    cache = tmp_path / "cache"
    beside, loader = batches(corpus, cache_dir=str(cache))
    assert "note: training while text is tokenized into" in capsys.readouterr().out
    loader.finish()
    assert same(raw, beside)
    prepare(corpus, tmp_path / "prepared" / "text")
    assert snapshot(cache / "text") == snapshot(tmp_path / "prepared" / "text")
    assert snapshot(cache / "meta") == snapshot(tmp_path / "prepared" / "meta")

    half = tmp_path / "half"
    prepare(corpus, half / "text", "--num_tasks=2", "--task_index=1")
    assert not (half / "text" / ".done" / "complete.json").exists()
    external, loader = batches(corpus, cache_dir=str(half), cache_build="external")
    assert same(raw, external)
    report = loader.data_report()
    assert report["documents_from_cache"] > 0 and report["documents_tokenized"] > 0, report
    assert 0.2 < report["cache_built"] < 0.8, report  # the other job's half, watched through its markers

    complete, loader = batches(corpus, cache_dir=str(cache))
    report = loader.data_report()
    assert same(raw, complete) and report["documents_from_cache"] > 0 and report["documents_tokenized"] == 0


# ---------------------------------------------------------------- a run


def flags(corpus: Path, cache: Path, *more: str) -> list[str]:
    return [
        "--use_dummy_dataset=False",
        f"--data_path={corpus}",
        f"--tokenizer_path={corpus / 'tokenizer.json'}",
        "--vocab_size=4096",
        f"--cache_dir={cache}",
        "--batch_size=2",
        "--checkpoint_interval=2",
        "--lr_schedule=constant",
        "--report_interval=1",
        *more,
    ]


def losses(found: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in found if "loss" in r}


def run(out: Path, args: list[str]) -> tuple[list[dict], str]:
    """A run in this process: its metrics records and what it printed."""
    printed = run_here([f"--ckpt_save_path={out}", *args])
    return records(out), printed


def test_a_run_stopped_mid_build_resumes_exactly_and_keeps_what_was_finished(corpus, tmp_path):
    """A run that starts while an array's task has built a third of the cache (external), stops at step
    2, and resumes while rank 0 builds the rest (beside): its losses are those of raw text read without a
    cache; the pieces finished before keep their files; the metrics say how much came from the cache and
    how far the build is; the cache ends complete."""
    no_cache = [f for f in flags(corpus, tmp_path, "--num_steps=4") if not f.startswith("--cache_dir")]
    whole = train_here(tmp_path / "whole", no_cache)
    cache = tmp_path / "cache"
    prepare(corpus, cache / "text", "--num_tasks=3", "--task_index=0")
    early = {p.name: p.stat().st_mtime_ns for p in (cache / "text").glob("part-*.arrow")}
    first, printed = run(tmp_path / "resumed", flags(corpus, cache, "--num_steps=2", "--cache_build=external"))
    assert "training while another job tokenizes text" in printed
    assert re.search(r"step 2 \|.* documents \d+ from the cache, \d+ tokenized, \d+% built", printed), printed
    resumed, printed = run(tmp_path / "resumed", flags(corpus, cache, "--num_steps=4"))
    assert "training while text is tokenized into" in printed
    assert {**losses(first), **losses(resumed)} == pytest.approx(losses(whole), rel=0, abs=0)
    assert {p: (cache / "text" / p).stat().st_mtime_ns for p in early} == early
    assert (cache / "text" / ".done" / "complete.json").is_file()
    reports = [r for r in first + resumed if "loss" in r]
    assert sum(r["documents_from_cache"] for r in reports) > 0 and sum(r["documents_tokenized"] for r in reports) > 0
    # the other job's third (watched through its markers), then rank 0's build
    assert all(0 < r["cache_built"] < 1 for r in reports if r["step"] <= 2), reports
    assert all(0 <= r["cache_built"] <= 1 for r in reports if r["step"] > 2)


def forget_cache_build(checkpoint: Path) -> None:
    """Make `checkpoint` one written before --cache_build existed: its recorded flags lack it."""
    meta = torch.load(checkpoint / "metadata.pth", weights_only=True)
    del meta["config"]["cache_build"]
    torch.save(meta, checkpoint / "metadata.pth")


def test_a_checkpoint_that_read_the_built_cache_resumes_in_its_order(corpus, tmp_path):
    """A checkpoint of a run that read its cache once built (--cache_build=first, or made before the flag
    existed) resumes without --cache_build in the cache's order, with a note, and goes on exactly; given
    --cache_build=beside, or made without --cache_dir, it says how to resume."""
    cache = tmp_path / "cache"
    whole = losses(train_here(tmp_path / "whole", flags(corpus, cache, "--num_steps=4", "--cache_build=first")))
    for made_before_the_flag in (False, True):
        out = tmp_path / f"run_{made_before_the_flag}"
        train_here(out, flags(corpus, cache, "--num_steps=2", "--cache_build=first"))
        if made_before_the_flag:
            forget_cache_build(out / "run" / "checkpoints" / "step_2_ckp")
        resumed, printed = run(out / "run", flags(corpus, cache, "--num_steps=4"))
        assert "note: the checkpoint resumed read its --cache_dir once built" in printed
        assert losses(resumed) == pytest.approx(whole, rel=0, abs=0)
    with pytest.raises(DataError) as e:  # given, the flag is obeyed: this order is not the checkpoint's
        train_here(tmp_path / "run_False", flags(corpus, cache, "--num_steps=6", "--cache_build=beside"))
    assert "resume as it was made, with --cache_build=first" in str(e.value)
    no_cache = [f for f in flags(corpus, tmp_path, "--num_steps=2") if not f.startswith("--cache_dir")]
    train_here(tmp_path / "raw", no_cache)
    with pytest.raises(DataError) as e:
        train_here(tmp_path / "raw", flags(corpus, cache, "--num_steps=4"))
    assert "--cache_build=first or without --cache_dir" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow  # the stop mid-build stays in the default tier
def test_a_builder_killed_mid_build_is_started_again_and_the_batches_do_not_change(
    corpus, tmp_path, capsys, monkeypatch
):
    """kill -9 of rank 0's builder (the process pool's parent) while it holds its first piece
    (tests/held_pieces.py) costs only time: it is started again, the batches stay raw text's, and the cache
    ends complete and equal to the command's."""
    from fms_fsdp.data.prepare import beside

    raw, _ = batches(corpus)
    cache, tickets = tmp_path / "cache", tmp_path / "tickets"
    monkeypatch.setattr(beside, "BUILDER", held_builder(tickets, 0))
    loader = data_loader(cfg(corpus, cache_dir=str(cache), vocab_size=4096), 0, 1)
    wait_held(tickets, 1, [], timeout=60, files="held-0", said=lambda: list(loader.builder._lines))
    assert not (cache / "text" / ".done").exists() or not list((cache / "text" / ".done").iterdir())
    os.kill(loader.builder._process.pid, signal.SIGKILL)
    (tickets / "release").mkdir()  # the builder started again goes on
    assert same(raw, take(loader, 6))
    loader.finish()
    assert "warning: the cache's builder ended" in capsys.readouterr().out
    prepare(corpus, tmp_path / "prepared" / "text")
    assert snapshot(cache / "text") == snapshot(tmp_path / "prepared" / "text")


def held_builder(tickets: Path, first_held: int) -> list[str]:
    """beside.BUILDER with its pieces from `first_held` on held until `<tickets>/release` exists."""
    return [str(ROOT / "tests" / "held_pieces.py"), str(tickets), str(first_held), "-m", "fms_fsdp.data.prepare.beside"]


@pytest.fixture(scope="module")
def pieces(tmp_path_factory) -> Path:
    """A raw-text dataset of sixteen files (a piece each, about 0.1 s of a worker's time: a stop lands
    mid-build even on a busy machine)."""
    root = tmp_path_factory.mktemp("pieces")
    write_dataset(root, "text", make_docs(400, 16000, 3), layout="jsonl", files=16)
    return root


def pool_workers(builder_pid: int) -> list[int]:
    """The process pool's workers under the builder: the children of its forkserver."""
    from test_checkpoint import descendants

    below = descendants(builder_pid)
    servers = [p for p in below if b"forkserver" in Path(f"/proc/{p}/cmdline").read_bytes()]
    return [
        p
        for p in below
        if any(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1] == str(s) for s in servers)
    ]


@pytest.mark.slow  # a pool of its own and a kill: the slow tier
def test_a_builder_stopped_midway_then_a_pool_worker_killed_leaves_the_batches_as_they_are(
    pieces, tmp_path, monkeypatch
):
    """Rank 0's builder in a pool of two (--cache_workers=2), its first piece finished and both workers
    holding the next (tests/held_pieces.py): stopped (SIGSTOP) while the loader reads on; then let go on, one
    held worker SIGKILLed, and the pieces released. The batches are raw text's throughout, the pool is
    started again without redoing the piece finished before, and the cache ends equal to fms-prepare-data's."""
    from fms_fsdp.data.prepare import beside

    raw, _ = batches(pieces)
    cache, tickets = tmp_path / "cache", tmp_path / "tickets"
    monkeypatch.setattr(beside, "BUILDER", held_builder(tickets, 1))
    loader = data_loader(cfg(pieces, cache_dir=str(cache), cache_workers=2, vocab_size=4096), 0, 1)
    builder = loader.builder
    wait_held(tickets, 2, [], timeout=60, said=lambda: list(builder._lines))
    wait_held(cache / "text" / ".done", 1, [], timeout=60, files="*.json", said=lambda: list(builder._lines))
    group = builder._process.pid  # the builder leads its own session: its pool is in its group
    os.killpg(group, signal.SIGSTOP)
    it = iter(loader)
    try:
        stopped_at = builder.progress()
        done = {p.name: p.stat().st_mtime_ns for p in (cache / "text" / ".done").glob("*.json")}
        found = [next(it) for _ in range(3)]
    finally:
        os.killpg(group, signal.SIGCONT)
    worker = int((tickets / "held-1").read_text().split()[0])
    assert worker in pool_workers(group)
    os.kill(worker, signal.SIGKILL)
    (tickets / "release").mkdir()
    found += [next(it) for _ in range(3)]
    builder._thread.join(timeout=60)
    assert not builder._thread.is_alive(), "the build did not end"
    loader.finish()
    assert 0 < stopped_at < 1 and len(done) == 1, (stopped_at, done)
    assert {p: (cache / "text" / ".done" / p).stat().st_mtime_ns for p in done} == done  # not done twice
    assert "a worker of the process pool died" in " ".join(builder._lines), list(builder._lines)
    assert same(raw, found)
    prepare(pieces, tmp_path / "prepared" / "text")
    assert snapshot(cache / "text") == snapshot(tmp_path / "prepared" / "text")


def test_a_stop_mid_build_resumes_on_the_same_batches_reading_what_its_builder_finished(pieces, tmp_path, monkeypatch):
    """A loader stopped (its builder ended, as a SIGTERM'd run does) with its first piece finished and its
    second held (tests/held_pieces.py), then a new loader from its state: the next batches are raw text's,
    the finished piece is read from the cache and left as it was, and the cache ends complete and equal to
    fms-prepare-data's."""
    from fms_fsdp.data.prepare import beside

    raw, _ = batches(pieces)
    cache, tickets = tmp_path / "cache", tmp_path / "tickets"
    monkeypatch.setattr(beside, "BUILDER", held_builder(tickets, 1))
    loader = data_loader(cfg(pieces, cache_dir=str(cache), cache_workers=1, vocab_size=4096), 0, 1)
    it = iter(loader)
    found = [next(it) for _ in range(3)]
    wait_held(tickets, 1, [], timeout=60, files="held-1", said=lambda: list(loader.builder._lines))
    state = loader.state_dict()
    loader.close()
    (tickets / "release").mkdir()  # the next builder's pieces go on
    done = {p.name: p.stat().st_mtime_ns for p in (cache / "text" / ".done").glob("*.json")}
    assert len(done) == 1 and "complete.json" not in done, done
    resumed = data_loader(cfg(pieces, cache_dir=str(cache), cache_workers=1, vocab_size=4096), 0, 1)
    resumed.load_state_dict(state)
    found += take(resumed, 3)
    assert resumed.data_report()["documents_from_cache"] > 0
    resumed.finish()
    assert same(raw, found)
    assert {p: (cache / "text" / ".done" / p).stat().st_mtime_ns for p in done} == done
    prepare(pieces, tmp_path / "prepared" / "text")
    assert snapshot(cache / "text") == snapshot(tmp_path / "prepared" / "text")


def test_an_array_task_killed_mid_build_leaves_the_batches_of_a_run_reading_beside_it_as_they_are(pieces, tmp_path):
    """fms-prepare-data (an array's task, --cache_build=external) SIGKILLed in its third piece, with a
    shard half written: a run reading beside it gets raw text's batches, and the same command run again
    finishes the cache equal to one prepared ahead."""
    raw, _ = batches(pieces)
    cache, held_in = tmp_path / "cache", tmp_path / "held"
    held = [sys.executable, str(ROOT / "tests" / "held_at.py"), str(held_in), "piece:2", "scripts/prepare_data.py"]
    task = subprocess.Popen(
        [
            *held,
            f"--input={pieces / 'text'}",
            f"--output={cache / 'text'}",
            f"--tokenizer={pieces / 'tokenizer.json'}",
            "--workers=1",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_held(held_in, 1, [task], timeout=60, files="held-0")
    task.kill()
    task.wait()
    assert len(list((cache / "text" / ".done").glob("*.json"))) == 2 and list((cache / "text").glob(".part-*.tmp"))
    external, loader = batches(pieces, cache_dir=str(cache), cache_build="external")
    assert same(raw, external) and loader.data_report()["documents_from_cache"] > 0
    prepare(pieces, cache / "text")
    prepare(pieces, tmp_path / "prepared" / "text")
    assert snapshot(cache / "text") == snapshot(tmp_path / "prepared" / "text")


@pytest.mark.slow
def test_a_rescale_mid_build_reads_every_document_at_most_once(corpus, tmp_path):
    """Two ranks to step 2 while an array's task has built a third of the cache, then three ranks on from
    their checkpoint while rank 0 builds the rest: no document read twice, the pieces finished before
    kept as they were, the cache complete."""
    from test_ramp import ledger

    from conftest import TINY, launch

    cache, out = tmp_path / "cache", tmp_path / "run"
    prepare(corpus, cache / "text", "--num_tasks=3", "--task_index=0")
    early = {p.name: p.stat().st_mtime_ns for p in (cache / "text").glob("part-*.arrow")}
    common = [*TINY, f"--ckpt_save_path={out}", *flags(corpus, cache)]
    proc = launch("main_training.py", [*common, "--num_steps=2", "--cache_build=external"], 2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    prepare(corpus, cache / "text", "--num_tasks=3", "--task_index=1")
    proc = launch("main_training.py", [*common, "--num_steps=4"], 3)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [r["step"] for r in records(out) if "loss" in r] == [1, 2, 3, 4]
    twice, read, _ = ledger(out / "checkpoints" / "step_4_ckp")
    assert twice == 0 and read > 0
    assert {p: (cache / "text" / p).stat().st_mtime_ns for p in early} == early
    assert (cache / "text" / ".done" / "complete.json").is_file()


def test_a_cache_being_built_with_another_recipe_is_refused_at_the_start(corpus, tmp_path):
    """An unfinished cache whose finished pieces were made with another tokenizer, or another --piece_bytes
    than the run reads with, is refused in one line before the first batch."""
    other = write_tokenizer(tmp_path / "other" / "tokenizer.json", vocab=4001)
    cases = {"tokenizer": [f"--tokenizer={other}"], "piece_bytes": ["--piece_bytes=4000"]}
    for name, extra in cases.items():
        cache = tmp_path / name
        command = [
            sys.executable,
            "scripts/prepare_data.py",
            f"--input={corpus / 'text'}",
            f"--output={cache / 'text'}",
        ]
        command += [f"--tokenizer={corpus / 'tokenizer.json'}", "--num_tasks=3", "--task_index=0", *extra]
        subprocess.run(command, cwd=ROOT, check=True, capture_output=True)  # the last --tokenizer counts
        with pytest.raises(DataError) as e:
            data_loader(cfg(corpus, cache_dir=str(cache), cache_build="external", vocab_size=4096), 0, 1)
        message = str(e.value)
        assert "\n" not in message and str(cache / "text") in message, message
        assert ("--text_field" if name == "tokenizer" else "--piece_bytes=4000") in message, message
