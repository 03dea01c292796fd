"""Float8 training through torchao (--float8; the optional extra `float8`), torchtitan's way: the
Linear layers of the blocks whose in and out features are both >= --float8_min_size (and multiples of
16, as float8 matmuls need) become torchao Float8Linear under the --float8_recipe scaling (tensorwise
or rowwise); the output head never does. With tensorwise scaling the weights are all-gathered by FSDP2
in float8, their scales computed for all of them at once after each optimizer step. Parameter names,
dtypes and shapes do not change, so checkpoints and exports are the same with and without float8.
On a CPU (tests) the float8 matmuls are emulated: the values are rounded to float8 all the same.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import nn

from fms_fsdp.console import import_quietly
from fms_fsdp.errors import ConfigError

MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9), Hopper (9.0) and later


def _torchao_float8() -> Any:
    """torchao.float8, imported quietly (console.import_quietly)."""
    try:
        return import_quietly("torchao.float8")
    except ImportError:
        raise ConfigError("--float8=True needs torchao: pip install 'fms-fsdp[float8]' (or torchao)") from None


def check_float8(device: torch.device) -> None:
    """--float8 is usable here: torchao is installed and a GPU has float8 tensor cores (ConfigError)."""
    _torchao_float8()
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CAPABILITY:
            raise ConfigError(
                f"--float8=True needs a GPU of compute capability 8.9 or more (H100, H200, L4, B200); "
                f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}"
            )


def float8_filter(min_size: int) -> Callable[[nn.Module, str], bool]:
    """Which modules become Float8Linear: the blocks' Linear layers of at least min_size features in
    and out, multiples of 16."""

    def convert(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or ".layers." not in f".{fqn}":
            return False
        sizes = (module.in_features, module.out_features)
        return all(n >= min_size and n % 16 == 0 for n in sizes)

    return convert


@dataclass(frozen=True, kw_only=True)
class Float8Settings:
    """--float8_recipe and --float8_min_size of a run with --float8."""

    recipe: str
    min_size: int

    def all_gather(self, sharded: bool) -> bool:
        """Whether FSDP all-gathers the float8 weights (tensorwise scaling, sharded parameters)."""
        return sharded and self.recipe == "tensorwise"


def convert_to_float8(model: nn.Module, settings: Float8Settings, device_type: str, sharded: bool) -> int:
    """Convert the chosen Linear layers in place (before FSDP wraps them); returns how many."""
    float8 = _torchao_float8()
    config = replace(
        float8.Float8LinearConfig.from_recipe_name(settings.recipe),
        emulate=device_type != "cuda",
        enable_fsdp_float8_all_gather=settings.all_gather(sharded),
    )
    chosen = float8_filter(settings.min_size)
    count = sum(chosen(m, name) for name, m in model.named_modules())
    float8.convert_to_float8_training(model, config=config, module_filter_fn=chosen)
    return count


def scale_hook(model: nn.Module) -> Callable[..., None]:
    """An optimizer step post-hook: the float8 scales of every weight for the next all-gather, computed
    together (one all-reduce), as torchao recommends with float8 all-gather."""
    precompute = _torchao_float8().precompute_float8_dynamic_scale_for_fsdp

    def hook(*_: Any, **__: Any) -> None:
        precompute(model)

    return hook
