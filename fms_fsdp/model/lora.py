"""LoRA fine-tuning (--lora_rank > 0): the chosen Linear layers of every block gain two small trainable
matrices, lora_A [r, in] and lora_B [out, r], and compute W x + (alpha / r) B A dropout(x); every other
weight is frozen, so it holds no gradient and no optimizer state, and checkpoints hold only the
adapters (and their optimizer state). The base weights come from --ckpt_load_path at every start.

A layer keeps its parameters' names and stays an nn.Linear (its class becomes LoRA<class>, a subclass
that adds the adapter: see LoRAMixin), so the base weights load and export under their usual keys.
Exports are the merged model (W + (alpha / r) B A), in every format the run exports, and a PEFT
adapter folder (adapter_config.json, adapter_model.safetensors) for the Hugging Face base model: the
fused q/k/v and gate/up adapters are split as the weights are, lora_A shared by the parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from fms_fsdp.config import LORA_TARGETS
from fms_fsdp.errors import ConfigError

TARGETS = LORA_TARGETS  # the layers --lora_targets may name (config.py's, its default)
ADAPTER = ("lora_A", "lora_B")


class LoRAMixin:
    """What a Linear layer gains, mixed into its class in place by add_adapters (`layer.__class__`
    becomes LoRA<class>, made once per class), as fully_shard mixes FSDPModule into the classes it
    shards and parallel.Checkpointed into checkpointed blocks.

    Why a class swap: a wrapper module (PEFT's `base_layer.weight`) or a parametrization
    (`parametrizations.weight.original`) renames the base weight, so checkpoints, exports and
    --ckpt_load_path would need their keys remapped; and the layer must stay an nn.Linear, which
    model/initialization.py's init rules and optim.py's weight decay test with isinstance. A forward hook would keep
    both too, but then `layer.forward(x)` skips the adapter, and the adapter's place among other hooks
    on the layer (tensor parallelism registers its own) would depend on the order they were registered
    in; here it is part of the layer's forward. The adapted layer keeps its state_dict keys (plus
    lora_A and lora_B) and, while lora_B is zero, computes what the base layer does (tests/test_lora.py)."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    lora_scale: float
    lora_dropout: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)  # type: ignore[attr-defined]
        h = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
        return out + (h @ self.lora_A.t() @ self.lora_B.t()) * self.lora_scale


_CLASSES: dict[type, type] = {}


@dataclass(frozen=True)
class LoRASpec:
    """--lora_rank, --lora_alpha, --lora_dropout and --lora_targets."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]


def check_lora(spec: Optional[LoRASpec], load_path: Optional[str], float8: bool) -> None:
    """--lora_* flags that make sense together, and with --ckpt_load_path and --float8 (ConfigError)."""
    if spec is None:
        return
    if not load_path:
        raise ConfigError(
            "--lora_rank needs the model to adapt: set --ckpt_load_path (a Hugging Face folder, a "
            "checkpoint of this package or an export)"
        )
    if float8:
        raise ConfigError(
            "--lora_rank with --float8 is not supported: torchao's float8 layers drop the adapters; "
            "use one or the other"
        )
    unknown = [t for t in spec.targets if t not in TARGETS]
    if unknown or not spec.targets:
        raise ConfigError(
            f"--lora_targets: unknown {', '.join(unknown) or '(none given)'}; choose from "
            f"{', '.join(TARGETS)} (q/k/v, attention output, gate/up, down projections)"
        )


def add_adapters(model: nn.Module, spec: LoRASpec) -> int:
    """Give the --lora_targets layers of every block their adapters (uninitialised: init_weights fills
    lora_A, and lora_B with zeros) and freeze every other parameter. Returns the adapted layers."""
    count = 0
    for name, module in model.named_modules():
        if not (".layers." in f".{name}" and name.rsplit(".", 1)[-1] in spec.targets):
            continue
        assert isinstance(module, nn.Linear), name
        cls = type(module)
        if cls not in _CLASSES:
            _CLASSES[cls] = type(f"LoRA{cls.__name__}", (LoRAMixin, cls), {})
        module.__class__ = _CLASSES[cls]
        device = module.weight.device
        module.lora_A = nn.Parameter(torch.empty(spec.rank, module.in_features, device=device))
        module.lora_B = nn.Parameter(torch.empty(module.out_features, spec.rank, device=device))
        module.lora_scale, module.lora_dropout = spec.alpha / spec.rank, spec.dropout
        count += 1
    for name, param in model.named_parameters():
        param.requires_grad_(name.rsplit(".", 1)[-1] in ADAPTER)
    return count


def is_adapter(key: str) -> bool:
    return key.rsplit(".", 1)[-1] in ADAPTER


def merged(state: dict[str, torch.Tensor], spec: LoRASpec) -> dict[str, torch.Tensor]:
    """A full model state without adapters: each adapted weight becomes W + (alpha / r) B A."""
    out = {k: v for k, v in state.items() if not is_adapter(k)}
    for key in state:
        if key.endswith(".lora_A"):
            layer = key.removesuffix(".lora_A")
            a, b = state[key].float(), state[f"{layer}.lora_B"].float()
            weight = out[f"{layer}.weight"]
            out[f"{layer}.weight"] = (weight.float() + (spec.alpha / spec.rank) * b @ a).to(weight.dtype)
    return out
