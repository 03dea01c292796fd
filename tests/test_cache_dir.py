"""Levanter's --cache_dir with --cache_build=first: raw-text datasets tokenized once into the cache before the first step by
fms-prepare-data's code, then read from there as it reads the same text prepared by the command; a
later start reuses the cache without touching it; one made with another tokenizer or text field is
refused naming both; token datasets are read where they are; a run resumed while its cache is complete
goes on exactly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fms_fsdp.data import DataError

from conftest import ROOT, data_loader, train_here
from test_data import cfg, make_docs, take, write_dataset, write_tokenizer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A raw-text dataset (with root/tokenizer.json) and a dataset of Arrow token files."""
    root = tmp_path_factory.mktemp("raw")
    write_dataset(root, "text", make_docs(400, 80, 3), layout="jsonl")
    write_dataset(root, "web", make_docs(10, 120, 1))
    return root


def snapshot(folder: Path) -> dict[str, tuple[int, bytes]]:
    return {
        str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.rglob("*") if p.is_file()
    }


def test_the_cache_is_built_once_and_read_as_the_same_text_prepared_by_the_command(corpus, tmp_path, capsys):
    cache = tmp_path / "cache"
    first = take(data_loader(cfg(corpus, cache_dir=str(cache), cache_build="first", vocab_size=4096), 0, 1), 8)
    assert f"note: tokenizing text into {cache / 'text'} with {len(os.sched_getaffinity(0))} processes" in (
        capsys.readouterr().out
    )
    assert (cache / "meta" / "counts_text.csv").is_file() and list((cache / "text").glob("part-*.arrow"))
    assert not (cache / "web").exists()  # token files are read where they are

    prepared = tmp_path / "prepared"
    subprocess.run(
        [sys.executable, "scripts/prepare_data.py", f"--input={corpus / 'text'}", f"--output={prepared / 'text'}"]
        + [f"--tokenizer={corpus / 'tokenizer.json'}"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    (prepared / "web").symlink_to(corpus / "web")
    by_command = take(data_loader(cfg(prepared, vocab_size=4096), 0, 1), 8)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, by_command))

    built = snapshot(cache)
    again = take(data_loader(cfg(corpus, cache_dir=str(cache), cache_build="first", vocab_size=4096), 0, 1), 8)
    assert "note: text: reading the tokenized cache" in capsys.readouterr().out
    assert snapshot(cache) == built
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again))


def test_a_cache_made_with_another_text_field_or_tokenizer_is_refused_naming_both(corpus, tmp_path):
    cache = tmp_path / "cache"
    data_loader(cfg(corpus, cache_dir=str(cache), cache_build="first", vocab_size=4096), 0, 1)
    with pytest.raises(DataError) as e:
        data_loader(cfg(corpus, cache_dir=str(cache), cache_build="first", vocab_size=4096, text_field="body"), 0, 1)
    message = str(e.value)
    assert "\n" not in message and "--text_field=text" in message and "--text_field=body" in message
    other = write_tokenizer(tmp_path / "other" / "tokenizer.json", vocab=4001)
    with pytest.raises(DataError) as e:
        data_loader(
            cfg(corpus, cache_dir=str(cache), cache_build="first", vocab_size=4096, tokenizer_path=str(other)), 0, 1
        )
    assert str(corpus / "tokenizer.json") in str(e.value) and str(other) in str(e.value)


def test_a_run_resumed_while_its_cache_is_complete_goes_on_exactly(corpus, tmp_path):
    common = [
        "--use_dummy_dataset=False",
        f"--data_path={corpus}",
        f"--tokenizer_path={corpus / 'tokenizer.json'}",
        "--vocab_size=4096",
        f"--cache_dir={tmp_path / 'cache'}",
        "--cache_build=first",
        "--batch_size=2",
        "--checkpoint_interval=2",
        "--lr_schedule=constant",
    ]
    whole = train_here(tmp_path / "whole", [*common, "--num_steps=4"])
    train_here(tmp_path / "resumed", [*common, "--num_steps=2"])
    resumed = train_here(tmp_path / "resumed", [*common, "--num_steps=4"])
    losses = lambda records: {r["step"]: r["loss"] for r in records if "loss" in r}  # noqa: E731
    assert losses(resumed)[3] == losses(whole)[3] and losses(resumed)[4] == losses(whole)[4]
