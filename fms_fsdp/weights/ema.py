"""--ema_decay: an exponential moving average of the weights, kept beside them for the final model.

After every applied optimizer step, average = decay x average + (1 - decay) x weights, on each rank's
own shards (the average is sharded exactly as the weights are, and lives where they live: on the
host with --cpu_offload; --ema_on_host holds it there in any case, pinned on a GPU, each step's shards
copied there before the update: a blocking copy, which a host-side update must wait for). A step that
--skip_bad_steps leaves out leaves the average alone too.
Checkpoints hold it under `ema_state` (checkpoint/save.py), evaluation reports it as eval_loss_ema
(evaluation/evaluate.py) and --export_ema exports it (checkpoint/export.py); for both, `swapped` puts
the average into the model for a while.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fms_fsdp.compat import local_tensor
from fms_fsdp.weights.fused import plain_tensor


def _local(value: torch.Tensor) -> torch.Tensor:
    """The tensor that holds this rank's part of a state-dict entry (a DTensor's shard)."""
    return plain_tensor(local_tensor(plain_tensor(value)))


def _copy(value: torch.Tensor, host: bool) -> torch.Tensor:
    """A copy of a state-dict entry, sharded as it is; with `host`, its shard in host memory (pinned
    where there is a GPU to copy from)."""
    value = plain_tensor(value).detach()
    if not host:
        return value.clone()
    shard = _local(value)
    held = torch.empty(shard.shape, dtype=shard.dtype, pin_memory=shard.device.type == "cuda").copy_(shard)
    if isinstance(value, DTensor):
        return DTensor.from_local(held, value.device_mesh, value.placements, shape=value.shape, stride=value.stride())
    return held


class WeightAverage:
    """The moving average of `model`'s trained weights (with LoRA, of its adapters), under the names
    checkpoints use for the model."""

    def __init__(self, model: torch.nn.Module, decay: float, options: StateDictOptions, host: bool = False):
        assert 0 < decay < 1, "config.validate: 0 < --ema_decay < 1"
        self.decay = decay
        live = {k: v for k, v in get_model_state_dict(model, options=options).items() if v.is_floating_point()}
        self.weights = [_local(v) for v in live.values()]  # the parameters' own storage, updated in place
        self.average = {k: _copy(v, host) for k, v in live.items()}  # `host`: --ema_on_host
        self.held = [_local(v) for v in self.average.values()]
        self.units = [m for m in model.modules() if isinstance(m, FSDPModule)]

    def reset(self) -> None:
        """Start the average at the current weights (a run with no average to resume)."""
        for average, weight in zip(self.held, self.weights):
            average.copy_(weight)

    def update(self, kept: Optional[torch.Tensor] = None) -> None:
        """Move the average towards the weights after a step; `kept` (a device flag, --skip_bad_steps)
        says whether the step was applied, without reading it on the host."""
        if kept is None:
            for average, value in zip(self.held, self.weights):
                average.lerp_(value.to(average.device), 1 - self.decay)
            return
        weights: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}  # the flag where each average lives
        for average, value in zip(self.held, self.weights):
            where = (average.device, average.dtype)
            if where not in weights:
                weights[where] = kept.to(average.device, average.dtype) * (1 - self.decay)
            average.lerp_(value.to(average.device), weights[where])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The average, sharded as the weights (loading into it restores it in place)."""
        return self.average

    @contextmanager
    def swapped(self) -> Iterator[None]:
        """The average in the model's weights inside the block, the weights back after it. FSDP's units
        that keep their gathered weights after a forward (the last block, the head) let them go on
        both ways, so that the next forward gathers what the shards hold."""
        trained = [w.clone() for w in self.weights]
        for weight, average in zip(self.weights, self.held):
            weight.copy_(average)
        self._let_go()
        try:
            yield
        finally:
            for weight, value in zip(self.weights, trained):
                weight.copy_(value)
            self._let_go()

    def _let_go(self) -> None:
        for unit in self.units:
            unit.reshard()
