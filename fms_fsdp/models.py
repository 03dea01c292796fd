"""Model variants (names -> ibm-fms LLaMAConfig), model construction, weight init and FLOPs.

The model is ibm-fms's LLaMA; `CausalLM` only gives it a head that, given labels, returns the loss
without materialising the logits (loss.py). `init_weights` draws the same values fms's `reset_parameters`
distributions call for, but from generators seeded per parameter and per block of rows, so a
parameter initialised whole (eager path) and one initialised shard by shard after FSDP2 on the
meta device (low_cpu_fsdp) get bit-identical values, whatever the number of ranks.
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from fms.models.llama import LLaMA, LLaMAConfig
from fms.modules.head import LinearClassificationHead
from fms.modules.layernorm import LayerNormParameterized
from torch.distributed.tensor import DTensor, Shard

from fms_fsdp.errors import ConfigError
from fms_fsdp.loss import ChunkFn, chunk_loss, chunked_cross_entropy

_L3 = dict(src_vocab_size=128256, rope_theta=500000.0)

# Arguments to fms LLaMAConfig; unspecified fields keep LLaMAConfig's defaults.
VARIANTS: dict[str, dict[str, Any]] = {
    # small variants for CPU tests and the quick start
    "tiny": dict(src_vocab_size=4096, emb_dim=256, nheads=4, kvheads=2, nlayers=4, multiple_of=64, max_expected_seq_len=1024),
    "tiny_llama3": dict(src_vocab_size=4096, emb_dim=256, nheads=4, kvheads=2, nlayers=4, multiple_of=64,
                        max_expected_seq_len=1024, rope_theta=500000.0),
    "small": dict(src_vocab_size=32000, emb_dim=768, nheads=12, kvheads=4, nlayers=12, multiple_of=256, max_expected_seq_len=2048),
    # fms-fsdp's variants, with exactly its dimensions
    "llama2_1.4b": dict(emb_dim=2048, nheads=16, nlayers=24, hidden_grow_factor=3, kvheads=4),
    "llama2_7b": dict(hidden_grow_factor=11008 / 4096, kvheads=32),
    "llama2_13b": dict(emb_dim=5120, nheads=40, nlayers=40, hidden_grow_factor=13824 / 5120),
    "llama2_34b": dict(emb_dim=8192, nheads=64, kvheads=8, nlayers=48, hidden_grow_factor=22016 / 8192,
                       max_expected_seq_len=16384, rope_theta=1000000.0),
    "llama2_70b": dict(emb_dim=8192, multiple_of=4096, nheads=64, kvheads=8, nlayers=80, hidden_grow_factor=28672 / 8192),
    "llama3_194m_4k": dict(_L3, emb_dim=1024, nheads=8, nlayers=10, max_expected_seq_len=4096),
    "llama3_1.8b": dict(_L3, emb_dim=2048, nheads=16, kvheads=8, nlayers=24, hidden_grow_factor=3.5, max_expected_seq_len=8192),
    "llama3_3.2b": dict(_L3, emb_dim=3072, nheads=24, kvheads=8, nlayers=24, hidden_grow_factor=8 / 3, max_expected_seq_len=8192),
    "llama3_8b": dict(_L3, emb_dim=4096, nheads=32, kvheads=8, nlayers=32, hidden_grow_factor=3.5, max_expected_seq_len=8192),
    "llama3_70b": dict(_L3, emb_dim=8192, nheads=64, kvheads=8, nlayers=80, hidden_grow_factor=3.5, max_expected_seq_len=8192),
}
for _name in ("llama3_1.8b", "llama3_3.2b", "llama3_8b", "llama3_70b"):
    VARIANTS[f"{_name}_4k"] = dict(VARIANTS[_name], max_expected_seq_len=4096)

ALIASES = {"7b": "llama2_7b", "13b": "llama2_13b", "34b": "llama2_34b", "70b": "llama2_70b"}

# Rows of a parameter drawn from one seeded generator: a block of about 4M values.
_INIT_BLOCK_NUMEL = 1 << 22


def resolve_variant(name: str) -> str:
    """The canonical variant name for `name` (aliases included); ConfigError listing the valid ones."""
    if name in VARIANTS:
        return name
    if name in ALIASES:
        return ALIASES[name]
    valid = ", ".join(list(VARIANTS) + list(ALIASES))
    raise ConfigError(f"--model_variant: unknown variant {name!r}; valid: {valid}")


def get_model_config(name: str, vocab_size: Optional[int] = None, seq_length: Optional[int] = None) -> LLaMAConfig:
    """The fms LLaMAConfig of variant `name`, with its vocabulary replaced by `vocab_size` if given and
    its rotary cache grown to `seq_length` if that is longer (a run setting, not a model limit: the
    weights do not depend on it)."""
    args = dict(VARIANTS[resolve_variant(name)])
    if vocab_size is not None:
        args["src_vocab_size"] = vocab_size
    config = LLaMAConfig(**args)
    if seq_length is not None and seq_length > config.max_expected_seq_len:
        config = config.updated(max_expected_seq_len=seq_length)
    return config


class LMHead(LinearClassificationHead):
    """fms's output head; called with labels it returns the mean cross entropy (chunked, see loss.py)
    instead of the logits. `chunk_fn` is replaced by a compiled copy when the run compiles;
    `max_chunk_bytes` (default: by device) is set by the memory plan to trace a GPU's chunks on the CPU."""

    chunk_fn: ChunkFn = staticmethod(chunk_loss)
    max_chunk_bytes: Optional[int] = None

    def forward(self, x: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        if labels is None:
            return super().forward(x)
        return chunked_cross_entropy(x, self.weight, labels, self.chunk_fn, self.max_chunk_bytes)


class CausalLM(LLaMA):
    """fms's LLaMA whose forward also takes `labels` and then returns the loss, not the logits."""

    def __init__(self, config: LLaMAConfig):
        super().__init__(config)
        self.head = LMHead(config.emb_dim, config.src_vocab_size, bias=False)

    def forward(self, x: torch.Tensor, labels: Optional[torch.Tensor] = None, **kwargs: Any) -> torch.Tensor:
        if labels is None:
            return super().forward(x, **kwargs)
        hidden, _ = self.base_model(x, **kwargs)
        return self.head(hidden, labels)


def build_model(model_config: LLaMAConfig, device: torch.device) -> CausalLM:
    """An fms LLaMA with uninitialised weights on `device` (use torch.device('meta') to allocate nothing)."""
    with device:
        return CausalLM(model_config)


def count_params(model_config: LLaMAConfig) -> int:
    """Parameters of a model with this config, counted on the meta device."""
    return sum(p.numel() for p in build_model(model_config, torch.device("meta")).parameters())


def flops_per_token(model_config: LLaMAConfig, seq_length: int) -> float:
    """Training FLOPs per token, PaLM count: 6*N + 12*L*H*Q*T, N the parameters without the input
    embedding (the output head is a real matmul and counts)."""
    n = count_params(model_config) - model_config.src_vocab_size * model_config.emb_dim
    head_dim = model_config.emb_dim // model_config.nheads
    return 6 * n + 12 * model_config.nlayers * model_config.nheads * head_dim * seq_length


def _init_rules(model: LLaMA) -> dict[str, Callable[[torch.Tensor, torch.Generator], Any]]:
    """Per parameter name, the fill fms's reset_parameters applies to it."""
    cfg = model.config

    def trunc_normal(std: float) -> Callable[[torch.Tensor, torch.Generator], Any]:
        return lambda t, g: nn.init.trunc_normal_(t, mean=0.0, std=std, generator=g)

    rules: dict[str, Callable[[torch.Tensor, torch.Generator], Any]] = {}
    for mod_name, module in model.named_modules():
        for p_name, _ in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if p_name in ("lora_A", "lora_B"):  # an adapter starts as nothing: B = 0 (A as PEFT draws it)
                bound = 1 / math.sqrt(module.in_features)
                rules[full] = ((lambda t, g: t.zero_()) if p_name == "lora_B" else
                               (lambda t, g, b=bound: t.uniform_(-b, b, generator=g)))
            elif p_name == "bias" or isinstance(module, LayerNormParameterized):
                rules[full] = (lambda t, g: t.zero_()) if p_name == "bias" else (lambda t, g: t.fill_(1.0))
            elif module is model.head:
                std = 1 / math.sqrt(math.sqrt(cfg.emb_dim * cfg.src_vocab_size))
                rules[full] = lambda t, g, std=std: t.normal_(0.0, std, generator=g)
            elif isinstance(module, nn.Embedding):
                rules[full] = trunc_normal(cfg.emb_dim**-0.5)
            elif isinstance(module, nn.Linear):
                rules[full] = trunc_normal(0.02)
            else:
                raise TypeError(f"no init rule for parameter {full} of {type(module).__name__}")
    return rules


def _row_range(param: torch.Tensor) -> tuple[int, int]:
    """The rows [start, stop) of the full parameter that this rank holds."""
    if not isinstance(param, DTensor):
        return 0, param.shape[0]
    start, rows = 0, param.shape[0]
    coordinate = param.device_mesh.get_coordinate()
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard):
            if placement.dim != 0:
                raise NotImplementedError(f"init of a parameter sharded on dim {placement.dim}")
            n = param.device_mesh.size(mesh_dim)
            chunk = -(-rows // n)
            start += min(coordinate[mesh_dim] * chunk, rows)
            rows = max(0, min(chunk, rows - coordinate[mesh_dim] * chunk))
    return start, start + rows


@torch.no_grad()
def init_weights(model: LLaMA, seed: int) -> None:
    """Initialise every parameter (whole or FSDP2-sharded) identically for a given seed, then set up
    the rotary embedding cache on the parameters' device."""
    rules = _init_rules(model)
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        start, stop = _row_range(param)
        if local.shape[0] != stop - start:
            raise RuntimeError(f"{name}: local shard has {local.shape[0]} rows, expected {stop - start}")
        row_numel = math.prod(param.shape[1:])
        block = max(1, _INIT_BLOCK_NUMEL // max(1, row_numel))
        name_seed = zlib.crc32(name.encode())
        for b in range(start // block, -(-stop // block)):
            lo, hi = b * block, min((b + 1) * block, param.shape[0])
            g = torch.Generator().manual_seed((seed * 1_000_003 + name_seed) * 65_537 + b)
            values = torch.empty((hi - lo, *param.shape[1:]), dtype=torch.float32)
            rules[name](values, g)
            s, e = max(lo, start), min(hi, stop)
            local[s - start : e - start].copy_(values[s - lo : e - lo])
    model.post_init()
