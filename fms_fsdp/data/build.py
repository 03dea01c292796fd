"""get_data_loader(cfg, rank, world_size, vocab_size): the synthetic loader, or the stateful loader over
the shards (every layout: data/shards.py) or raw text under data_path; and the settings of the data flags: how
documents become lines (`packing_of`), which files are read how (`layout_of`), the tokenizer's check."""

from __future__ import annotations

import os
from dataclasses import replace
from datetime import timedelta
from typing import Optional, Union

from fms_fsdp.config import train_config
from fms_fsdp.data.cache import IN_DATA
from fms_fsdp.data.dummy import DummyDataLoader
from fms_fsdp.data.loader import StatefulLoader
from fms_fsdp.data.mixture import MixtureSchedule
from fms_fsdp.data.reader import Options
from fms_fsdp.data.shards import Dataset, FileEntry, Layout, dataset_sources, scan
from fms_fsdp.data.sources import Source
from fms_fsdp.data.stream import Packing
from fms_fsdp.data.text import TextSpec, added_tokens, load_tokenizer
from fms_fsdp.data.token_cache import CacheSettings, RaySettings, cached_sources
from fms_fsdp.errors import ConfigError, DataError
from fms_fsdp.parallel.process_group import on_rank0
from fms_fsdp.storage import is_remote, location


def get_data_loader(
    cfg: train_config, rank: int, world_size: int, vocab_size: int
) -> Union[StatefulLoader, DummyDataLoader]:
    """The loader of data-parallel rank `rank` of `world_size`: synthetic lines with use_dummy_dataset,
    else the shards under data_path, their token ids checked against `vocab_size` (the run's: run.py).
    Bad data raises DataError (one line naming the file or flag)."""
    if cfg.use_dummy_dataset:
        return DummyDataLoader(cfg.batch_size, cfg.seq_length, vocab_size, cfg.seed, rank, world_size)
    sources = dataset_sources(cfg.data_path, cfg.datasets)  # the same on every rank: rank 0 reports errors
    names = [s.name for s in sources]
    schedule = None if cfg.weights_schedule is None else MixtureSchedule.parse(cfg.weights_schedule)
    given = cfg.weights if schedule is None else schedule.stages[0][1]
    if given is not None and len(given) != len(names):
        flag = "--weights" if schedule is None else "--weights_schedule"
        raise DataError(
            f"{flag} has {len(given)} values but {cfg.data_path} has {len(names)} datasets: "
            f"{', '.join(names)}; give one weight per dataset or set --datasets",
            every_rank=True,
        )
    layout = layout_of(cfg, vocab_size)
    layouts = {s.name: layout for s in sources}
    if cfg.cache_dir is not None:  # raw text tokenized into the cache first (rank 0), then read from there
        built = cached_sources(sources, layout, cache_of(cfg))
        tokenized = replace(layout, file_type="arrow", text=None)
        layouts.update({b.name: tokenized for s, b in zip(sources, built) if b != s})
        sources = built
    # rank 0 alone opens and counts the files, for a long time on a large corpus: the others wait
    entries = on_rank0(
        lambda: scan_each(sources, layouts),
        DataError,
        lambda message: DataError(message, every_rank=True),
        timeout=timedelta(hours=6),
    )
    datasets = [Dataset(s.name, location(s.root, "data_path"), entries[s.name], layouts[s.name]) for s in sources]
    weights = list(given) if given is not None else [float(d.tokens) for d in datasets]  # default: the natural mixture
    return StatefulLoader(
        datasets,
        weights,
        packing_of(cfg, vocab_size),
        cfg.batch_size,
        cfg.logical_shards,
        cfg.seed,
        rank,
        world_size,
        cfg.num_workers,
        schedule,
        cfg.grad_accum_steps,
    )


def scan_each(sources: list[Source], layouts: dict[str, Layout]) -> dict[str, list[FileEntry]]:
    """scan() of the datasets, each under its own layout (the cache's tokenized ones are Arrow shards)."""
    entries: dict[str, list[FileEntry]] = {}
    for layout in set(layouts.values()):
        entries.update(scan([s for s in sources if layouts[s.name] == layout], layout))
    return entries


def cache_of(cfg: train_config) -> CacheSettings:
    """--cache_dir and how it is tokenized (data/token_cache.py)."""
    assert cfg.cache_dir is not None and cfg.tokenizer_path is not None
    ray = RaySettings(cfg.ray_address, cfg.ray_start_workers, cfg.ray_auto_start_cluster)
    return CacheSettings(cfg.cache_dir, cfg.tokenizer_path, cfg.text_field, ray)


def packing_of(cfg: train_config, vocab_size: int) -> Packing:
    """How documents become lines under cfg's separator, bos/bol/eol and strip tokens."""
    strip = {cfg.eos_token, *cfg.strip_tokens} | ({cfg.bos_token} if cfg.bos_token is not None else set())
    return Packing(
        cfg.seq_length, cfg.eos_token, cfg.bos_token, cfg.bol_token, cfg.eol_token, frozenset(strip), vocab_size
    )


def layout_of(cfg: train_config, vocab_size: Optional[int], run_cache: bool = True) -> Layout:
    """Which files the datasets hold and how they are read, from cfg and the run's vocabulary; the
    cache folder is --data_cache_dir, else (`run_cache`: a training run's) <ckpt_save_path>/data_cache
    (data/cache.py), else none."""
    text = None if cfg.tokenizer_path is None else TextSpec(cfg.tokenizer_path, cfg.text_field)
    options = Options(cfg.col_name, cfg.token_dtype, cfg.eos_token, vocab_size)
    cache = cfg.data_cache_dir
    if cache is None and run_cache:
        save = cfg.ckpt_save_path
        cache = (
            f"{save.rstrip('/')}/data_cache"
            if is_remote(save)
            else str(location(save, "ckpt_save_path") / "data_cache")
        )
    if cache is not None and cache != IN_DATA and not is_remote(cache):
        cache = os.path.abspath(cache.removeprefix("file://"))
    return Layout(cfg.file_type, options, text, cache)


def check_tokenizer(cfg: train_config, vocab: int) -> list[str]:
    """--tokenizer_path loads and fits the model's vocabulary `vocab` (ConfigError otherwise); returns
    notes on how raw text will be framed, for the log. Run once, at start-up (run.py)."""
    tokenizer = load_tokenizer(cfg.tokenizer_path)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > vocab:
        raise ConfigError(
            f"--tokenizer_path: {cfg.tokenizer_path} has {size} tokens but {cfg.model_variant}'s "
            f"vocabulary is {vocab}; set --vocab_size={size} (or larger)"
        )
    before, after = added_tokens(tokenizer)
    notes = []
    if after and cfg.eos_token not in after:
        notes.append(
            f"warning: the tokenizer ends a text with token(s) {after}, but --eos_token={cfg.eos_token} "
            f"separates raw text documents; set --eos_token={after[-1]} if that is its end-of-text token"
        )
    if before and cfg.bos_token is None:
        notes.append(
            f"note: the tokenizer starts a text with token(s) {before}; raw text documents get no bos "
            f"token unless --bos_token is set (e.g. --bos_token={before[0]})"
        )
    return notes
