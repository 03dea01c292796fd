"""Pretraining of ibm-fms LLaMA models with FSDP2 / HSDP.

`from fms_fsdp import train_config, get_model_config`. Attributes are imported on first use, so
tools that need only a light module (e.g. fms_fsdp.data.shards) do not pay for torch and fms.
"""

from typing import Any

__all__ = ["train_config", "get_model_config"]


def __getattr__(name: str) -> Any:
    if name == "train_config":
        from fms_fsdp.config import train_config

        return train_config
    if name == "get_model_config":
        from fms_fsdp.model.variants import get_model_config

        return get_model_config
    raise AttributeError(f"module 'fms_fsdp' has no attribute {name!r}")
