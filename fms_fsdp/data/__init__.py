"""The training data, read from every layout users bring into batches that resume exactly.

`from fms_fsdp.data import get_data_loader, DataError`:
get_data_loader(settings, rank, world_size) -> an iterable of (inputs, labels) batches with
state_dict()/load_state_dict(). Imported on first use, so fms_fsdp.data.shards stays light for tools.
"""

from typing import Any

__all__ = ["DataError", "get_data_loader"]


def __getattr__(name: str) -> Any:
    if name == "get_data_loader":
        from fms_fsdp.data.make_loader import get_data_loader

        return get_data_loader
    if name == "DataError":
        from fms_fsdp.errors import DataError

        return DataError
    raise AttributeError(f"module 'fms_fsdp.data' has no attribute {name!r}")
