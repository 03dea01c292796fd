"""The ledger of what a loader consumed (data/consumed.py, fms-inspect-data --ledger): worked out from
the saved positions alone, it names exactly the tokens the batches held, document by document, across a
resume, a 2 -> 3 rescale, a change of the mixture (by hand and by --weights_schedule) and a second epoch; no document twice within an epoch.
The command reads a run's checkpoints, compares two and lists documents (tests/test_checkpoint.py, beside
the run it reads; a fault-tolerant run's groups: tests/test_ft.py)."""

import pickle
from collections import Counter

import numpy as np
import pytest

from fms_fsdp.data.consumed import ledger_of
from fms_fsdp.errors import DataError

from conftest import data_loader, inspect_data
from test_data import EOS, cfg, consumed_from_states, lines_of, make_docs, take, write_dataset


def read(batches) -> Counter:
    seen = Counter(lines_of(batches).reshape(-1).tolist())
    del seen[EOS]
    return seen


def once_within_the_epoch(loader, states) -> None:
    ledgers = ledger_of(states, loader.datasets, loader.seed, loader.logical_shards, loader.packing)
    assert all(int(ledger.seen.max()) == 1 for ledger in ledgers), [np.bincount(x.seen) for x in ledgers]


@pytest.fixture
def two(tmp_path):
    """Two datasets, one read by document (Arrow), one by row group (Parquet: documents shuffled inside
    their block)."""
    write_dataset(tmp_path, "a", make_docs(10, 300, 7))
    write_dataset(tmp_path, "b", make_docs(1000, 200, 8), layout="parquet")
    return tmp_path


def test_the_ledger_names_every_token_read_across_a_resume_a_rescale_and_a_new_mixture(two):
    settings = dict(num_workers=1, logical_shards=24, batch_size=4, seq_length=32)
    seen: Counter = Counter()
    old = []
    for rank in range(2):
        loader = data_loader(cfg(two, **settings), rank, 2)
        seen += read(take(loader, 5))
        old.append(pickle.loads(pickle.dumps(loader.state_dict())))
    assert consumed_from_states(loader, old) == seen
    once_within_the_epoch(loader, old)
    resumed = []  # stopped and resumed at the same size, under a new mixture (--weights 1:3 from here)
    for rank in range(2):
        loader = data_loader(cfg(two, weights=[1.0, 3.0], **settings), rank, 2)
        loader.load_state_dict(old[rank])
        seen += read(take(loader, 4))
        resumed.append(pickle.loads(pickle.dumps(loader.state_dict())))
    assert consumed_from_states(loader, resumed) == seen
    rescaled = []  # then 3 ranks of 2 workers
    for rank in range(3):
        loader = data_loader(cfg(two, **{**settings, "num_workers": 2}), rank, 3)
        loader.load_state_dict(resumed)
        seen += read(take(loader, 4))
        rescaled.append(loader.state_dict())
    assert consumed_from_states(loader, rescaled) == seen
    once_within_the_epoch(loader, rescaled)
    assert {t // 1000 for t in seen} == {0, 1} and sum(seen.values()) > 3000


def test_the_ledger_names_every_token_read_through_a_switch_of_the_weights_schedule(two):
    """--weights_schedule switching from 1:1 to 1:3 after step 3, read by two ranks through the switch: the
    ledger of their positions names exactly the tokens their batches held."""
    settings = dict(num_workers=1, logical_shards=24, batch_size=4, seq_length=32, weights_schedule="0:1,1;3:1,3")
    seen: Counter = Counter()
    states = []
    for rank in range(2):
        loader = data_loader(cfg(two, **settings), rank, 2)
        seen += read(take(loader, 7))
        states.append(loader.state_dict())
    assert consumed_from_states(loader, states) == seen
    once_within_the_epoch(loader, states)
    assert {t // 1000 for t in seen} == {0, 1}


def test_a_second_epoch_counts_every_document_again(tmp_path):
    write_dataset(tmp_path, "a", make_docs(10, 40, 3))
    loader = data_loader(cfg(tmp_path, logical_shards=4, batch_size=4, seq_length=32), 0, 1)
    tokens = sum(len(d) for d in make_docs(10, 40, 3))
    batches = take(loader, (tokens * 3 // 2) // (4 * 33) + 1)  # past the first epoch, before the second ends
    state = loader.state_dict()
    ledger = ledger_of([state], loader.datasets, loader.seed, loader.logical_shards, loader.packing)[0]
    assert consumed_from_states(loader, [state]) == read(batches)
    assert list(np.unique(ledger.seen)) == [1, 2]  # the second epoch has begun, not ended
    assert ledger.framed == len(batches) * 4 * 33  # every token of the lines, bos/eos included


def test_states_of_two_runs_or_of_other_data_are_refused(two):
    loader = data_loader(cfg(two, logical_shards=8), 0, 2)
    take(loader, 1)
    other = data_loader(cfg(two, logical_shards=8), 0, 3)
    take(other, 1)
    with pytest.raises(DataError, match=r"not one run's ranks: ranks \[0, 0\] of world sizes \[2, 3\]"):
        ledger_of([loader.state_dict(), other.state_dict()], loader.datasets, 7, 8, loader.packing)
    with pytest.raises(
        DataError, match=r"^the data changed since this checkpoint: documents was \{'a': 300, 'b': 200\}, "
    ):
        ledger_of([loader.state_dict()], loader.datasets[:1], 7, 8, loader.packing)


def test_the_command_refuses_what_it_cannot_answer_in_one_line(tmp_path):
    proc = inspect_data(f"--compare={tmp_path}")
    assert proc.returncode != 0 and proc.stderr.strip().splitlines() == [
        "error: --compare and --list_documents read a checkpoint's ledger: give --ledger=<checkpoint>"
    ], proc.stderr
    proc = inspect_data(f"--ledger={tmp_path}")
    assert proc.returncode != 0 and proc.stderr.strip().splitlines() == [
        f"error: --ledger: {tmp_path} is not a checkpoint folder (no metadata.pth)"
    ], proc.stderr
