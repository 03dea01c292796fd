"""get_data_loader(settings, rank, world_size): the synthetic loader, or the stateful loader over the shards
(every layout: data/shards.py) or raw text under data_path, as the data's settings say (data/settings.py,
built from the flags once in fms_fsdp/settings.py); and the tokenizer's check at start-up."""

from __future__ import annotations

import os
from dataclasses import replace
from datetime import timedelta
from typing import Any, Union

import torch.distributed as dist

from fms_fsdp.data.dummy import DummyDataLoader
from fms_fsdp.data.loader import StatefulLoader
from fms_fsdp.data.settings import DataSettings
from fms_fsdp.data.shards import Dataset, FileEntry, Layout, dataset_sources, scan
from fms_fsdp.data.sources import Source
from fms_fsdp.data.stream import Packing
from fms_fsdp.data.text import added_tokens, load_tokenizer
from fms_fsdp.errors import ConfigError, DataError
from fms_fsdp.parallel.process_group import on_rank0
from fms_fsdp.storage import location


def get_data_loader(settings: DataSettings, rank: int, world_size: int) -> Union[StatefulLoader, DummyDataLoader]:
    """The loader of data-parallel rank `rank` of `world_size`: synthetic lines with use_dummy_dataset,
    else the shards under data_path, their token ids checked against the run's vocabulary (the packing's).
    Bad data raises DataError (one line naming the file or flag)."""
    packing = settings.packing
    if settings.use_dummy_dataset:
        return DummyDataLoader(
            batch_size=settings.batch_size,
            seq_length=packing.seq_length,
            vocab_size=packing.vocab_size,
            seed=settings.seed,
            rank=rank,
            world_size=world_size,
            ramp=settings.ramp,
            accum=settings.grad_accum_steps,
        )
    sources = dataset_sources(settings.data_path, settings.datasets)  # the same on every rank: rank 0 reports errors
    names = [s.name for s in sources]
    schedule = settings.schedule
    given = settings.weights if schedule is None else schedule.stages[0][1]
    if given is not None and len(given) != len(names):
        flag = "--weights" if schedule is None else "--weights_schedule"
        raise DataError(
            f"{flag} has {len(given)} values but {settings.data_path} has {len(names)} datasets: "
            f"{', '.join(names)}; give one weight per dataset or set --datasets",
            every_rank=True,
        )
    datasets = open_datasets(settings, sources)
    weights = list(given) if given is not None else [float(d.tokens) for d in datasets]  # default: the natural mixture
    builder = _builder(settings, datasets, rank)
    return StatefulLoader(
        datasets=datasets,
        weights=weights,
        packing=packing,
        batch_size=settings.batch_size,
        logical_shards=settings.logical_shards,
        seed=settings.seed,
        rank=rank,
        world_size=world_size,
        num_workers=settings.num_workers,
        schedule=schedule,
        grad_accum=settings.grad_accum_steps,
        ramp=settings.ramp,
        builder=builder,
    )


def _builder(settings: DataSettings, datasets: list[Dataset], rank: int) -> Any:
    """Rank 0's build of the caches the datasets are read from while they are built (data/prepare/beside.py),
    or None."""
    caches = {d.name: d.building for d in datasets if d.building is not None}
    first = dist.get_rank() == 0 if dist.is_initialized() else rank == 0  # the job's first process builds
    if not caches or settings.cache is None or not first:
        return None
    from fms_fsdp.data.prepare.beside import start_builder

    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return start_builder(caches, settings.cache, local_ranks, lambda line: print(line, flush=True))


def open_datasets(settings: DataSettings, sources: list[Source]) -> list[Dataset]:
    """The datasets of `sources` as the loader reads them (raw text with --cache_dir: read while the cache
    is built, or tokenized into it first, on rank 0); rank 0 alone opens and counts the files, while the
    others wait."""
    layout = settings.layout
    layouts = {s.name: layout for s in sources}
    caches: dict[str, Any] = {}
    if settings.cache is not None and settings.cache.beside:  # read as raw text, from the cache where built
        from fms_fsdp.data.prepare.beside import building_caches

        caches = building_caches(sources, layout, settings.cache)
    elif settings.cache is not None:  # raw text tokenized into the cache first (rank 0), then read from there
        from fms_fsdp.data.prepare.cache_dir import cached_sources  # the preparation only for --cache_dir

        built = cached_sources(sources, layout, settings.cache)
        tokenized = replace(layout, file_type="arrow", text=None)
        layouts.update({b.name: tokenized for s, b in zip(sources, built) if b != s})
        sources = built
    entries = on_rank0(
        lambda: scan_each(sources, layouts),
        DataError,
        lambda message: DataError(message, every_rank=True),
        timeout=timedelta(hours=6),
    )
    return [
        Dataset(s.name, location(s.root, "data_path"), entries[s.name], layouts[s.name], caches.get(s.name))
        for s in sources
    ]


def scan_each(sources: list[Source], layouts: dict[str, Layout]) -> dict[str, list[FileEntry]]:
    """scan() of the datasets, each under its own layout (the cache's tokenized ones are Arrow shards)."""
    entries: dict[str, list[FileEntry]] = {}
    for layout in set(layouts.values()):
        entries.update(scan([s for s in sources if layouts[s.name] == layout], layout))
    return entries


def check_tokenizer(tokenizer_path: str, variant: str, packing: Packing) -> list[str]:
    """--tokenizer_path loads and fits the vocabulary of the model `variant` (`packing`'s: the run's;
    ConfigError otherwise); returns notes on how raw text will be framed under `packing`'s eos and bos
    tokens, for the log. Run once, at start-up (startup.py)."""
    tokenizer = load_tokenizer(tokenizer_path)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > packing.vocab_size:
        raise ConfigError(
            f"--tokenizer_path: {tokenizer_path} has {size} tokens but {variant}'s "
            f"vocabulary is {packing.vocab_size}; set --vocab_size={size} (or larger)"
        )
    before, after = added_tokens(tokenizer)
    notes = []
    if after and packing.eos not in after:
        notes.append(
            f"warning: the tokenizer ends a text with token(s) {after}, but --eos_token={packing.eos} "
            f"separates raw text documents; set --eos_token={after[-1]} if that is its end-of-text token"
        )
    if before and packing.bos is None:
        notes.append(
            f"note: the tokenizer starts a text with token(s) {before}; raw text documents get no bos "
            f"token unless --bos_token is set (e.g. --bos_token={before[0]})"
        )
    return notes
