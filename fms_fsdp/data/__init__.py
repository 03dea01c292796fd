"""Training data: get_data_loader(cfg, rank, world_size) -> an iterable of (inputs, labels) batches
with state_dict()/load_state_dict()."""

from __future__ import annotations

from fms_fsdp.config import train_config
from fms_fsdp.data.dummy import DummyDataLoader
from fms_fsdp.models import get_model_config


def get_data_loader(cfg: train_config, rank: int, world_size: int) -> DummyDataLoader:
    """The loader for this rank. Only the synthetic loader exists in this version; config validation
    refuses use_dummy_dataset=False with a clear message."""
    if not cfg.use_dummy_dataset:
        raise NotImplementedError("the Arrow/Parquet data loader is not in this version yet")
    vocab = get_model_config(cfg.model_variant, cfg.vocab_size).src_vocab_size
    return DummyDataLoader(cfg.batch_size, cfg.seq_length, vocab, cfg.seed, rank, world_size)
