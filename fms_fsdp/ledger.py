"""Which documents a checkpoint's run has consumed, per dataset (fms-inspect-data --ledger).

Worked out exactly from the data positions the checkpoint holds (data/consumed.py) and the data it was
trained on.

    fms-inspect-data --ledger=<run>/checkpoints/step_1000_ckp
    fms-inspect-data --ledger=<ckpt> --compare=<another ckpt>     # what one saw that the other did not
    fms-inspect-data --ledger=<ckpt> --list_documents=True        # every document seen: file:index, times, tokens

A fault-tolerant run's replica groups each hold their own ranks' positions: give every group's checkpoint
of the same step, comma-separated. --data_path reads the data from where it is now, when it moved.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from fms_fsdp.data.consumed import DatasetLedger, check_one_run, ledger_of
from fms_fsdp.data.make_loader import open_datasets
from fms_fsdp.data.shards import dataset_sources
from fms_fsdp.errors import CheckpointError, ConfigError
from fms_fsdp.flags import recorded_config
from fms_fsdp.settings import data_of, layout_of, packing_of
from fms_fsdp.startup import model_config_of
from fms_fsdp.storage import location
from fms_fsdp.versions import check_layout


def _load(path: Path) -> Any:
    if not path.is_file():
        raise CheckpointError(f"--ledger: {path.parent} is not a checkpoint folder (no {path.name})")
    with path.open("rb") as f:
        return torch.load(io.BytesIO(f.read()), weights_only=True)


def read_checkpoints(paths: str) -> tuple[dict[str, Any], list[dict[str, Any]], int]:
    """The run's config, every rank's loader state and the step of the comma-separated checkpoint folders
    (one run's, at one step: a fault-tolerant run's groups each hold their own ranks')."""
    configs, states, steps = [], [], set()
    for text in paths.split(","):
        folder = location(text, "ledger")
        meta = _load(folder / "metadata.pth")
        check_layout(meta, folder)
        configs.append(meta["config"])
        steps.add(int(meta["step"]))
        ranks = sorted(folder.glob("loader_state_*.pth"), key=lambda p: int(p.stem.rsplit("_", 1)[1]))
        if not ranks:
            raise CheckpointError(f"--ledger: {folder} holds no loader_state_<rank>.pth: no data positions")
        states += [_load(p)["loader"] for p in ranks]
    if len(steps) > 1:
        raise ConfigError(f"--ledger: the checkpoints are of different steps ({sorted(steps)}): give one step's")
    if any("readers" not in s for s in states):
        raise ConfigError("--ledger: the run read synthetic lines (--use_dummy_dataset): there is no ledger")
    return configs[0], states, steps.pop()


def ledger(paths: str, data_path: Optional[str] = None) -> tuple[list[DatasetLedger], str]:
    """The ledgers of the checkpoints `paths`, and a header line saying what they cover."""
    config, states, step = read_checkpoints(paths)
    if data_path:
        config = {**config, "data_path": data_path}
    cfg = recorded_config(config)
    vocab = model_config_of(cfg).src_vocab_size
    settings = data_of(cfg, layout_of(cfg, vocab), packing_of(cfg, vocab))  # the run's own data cache
    datasets = open_datasets(settings, dataset_sources(settings.data_path, settings.datasets))
    held, world = check_one_run(states)
    ledgers = ledger_of(states, datasets, settings.seed, settings.logical_shards, settings.packing)
    header = f"ledger of {paths} (step {step}): the data positions of {held} of {world} data-parallel ranks"
    if held < world:
        header += " (a replica group's: give every group's checkpoint of this step for the whole run)"
    return ledgers, header


def summary(ledger: DatasetLedger) -> str:
    """One dataset's line: documents seen once, twice, more often and not yet; tokens read."""
    times = np.bincount(np.minimum(ledger.seen, 3), minlength=4)
    own = int(ledger.tokens.sum())
    return (
        f"{ledger.name}: {ledger.documents:,} documents: {times[1]:,} seen once, {times[2]:,} twice, "
        f"{times[3]:,} more often, {times[0]:,} not yet; {ledger.framed:,} tokens read ({own:,} of the "
        f"documents' own, without bos/eos)"
    )


def comparison(a: DatasetLedger, b: DatasetLedger) -> str:
    """What two ledgers of one dataset saw: in both, only in the first, only in the second."""
    sa, sb = a.seen > 0, b.seen > 0
    return (
        f"{a.name}: the first saw {int(sa.sum()):,} documents, the second {int(sb.sum()):,}: "
        f"{int((sa & sb).sum()):,} in both, {int((sa & ~sb).sum()):,} only in the first, "
        f"{int((sb & ~sa).sum()):,} only in the second"
    )


def show_ledger(paths: str, compare: Optional[str], list_documents: bool, data_path: Optional[str]) -> None:
    """Print the ledger of `paths`: each dataset's summary, compared with `compare`'s, or every document."""
    if compare and list_documents:
        raise ConfigError("--list_documents lists one checkpoint's documents: leave out --compare")
    ledgers, header = ledger(paths, data_path)
    print(header)
    if compare:
        others, other_header = ledger(compare, data_path)
        print(other_header)
        if [x.name for x in others] != [x.name for x in ledgers]:
            raise ConfigError("--compare: the two runs read different datasets: they cannot be compared")
        for a, b in zip(ledgers, others):
            print(comparison(a, b))
        return
    for one in ledgers:
        print(summary(one))
    if list_documents:
        print("dataset file:document times tokens")
        for one in ledgers:
            for doc in np.flatnonzero(one.seen).tolist():
                print(f"{one.name} {one.where(doc)} {int(one.seen[doc])} {int(one.tokens[doc])}")
