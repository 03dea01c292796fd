"""Weight init that gives one model at any mesh: `init_weights` draws the values fms's
`reset_parameters` distributions call for, but from generators seeded per parameter and per block of
rows, so a parameter initialised whole (eager path) and one initialised shard by shard after FSDP2 and
tensor parallelism on the meta device (low_cpu_fsdp) get bit-identical values, whatever the number of
ranks. A model built unfused (tensor parallel: q, k, v and gate, up apart) draws the values of the fused
weights it is cut from (variants.FUSED), so it starts from the same weights too.
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Callable

import torch
import torch.nn as nn
from fms.models.llama import LLaMA
from fms.modules.feedforward import ConditionalFeedForward
from fms.modules.layernorm import LayerNormParameterized
from torch.distributed.tensor import DTensor

from fms_fsdp.compat import local_box
from fms_fsdp.model.variants import fused_parts

# Rows of a parameter drawn from one seeded generator: a block of about 4M values.
_INIT_BLOCK_NUMEL = 1 << 22


def trunc_normal_(t: torch.Tensor, std: float, g: torch.Generator, bound: float = 2.0) -> torch.Tensor:
    """nn.init.trunc_normal_(t, 0, std, -bound, bound) drawn by the inverse CDF (uniform, then erfinv),
    as torch drew it before 2.13: its draws changed between releases (2.11's and 2.13's differ), these
    are the same on every release, so a seed gives one model on any supported torch. `t` is fp32 (the
    init draws into fp32 buffers); unlike torch's old draws, never -bound from a uniform draw of -1."""
    edge = math.erf(bound / std / math.sqrt(2.0))
    t.uniform_(-edge, edge, generator=g).clamp_(-(1 - 2**-24), 1 - 2**-24)  # erfinv(+-1) is +-inf
    t.erfinv_()
    return t.mul_(std * math.sqrt(2.0)).clamp_(-bound, bound)


Fill = Callable[[torch.Tensor, torch.Generator], Any]


def _zeros(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    return t.zero_()


def _ones(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    return t.fill_(1.0)


def _uniform(bound: float) -> Fill:
    return lambda t, g: t.uniform_(-bound, bound, generator=g)


def _normal(std: float) -> Fill:
    return lambda t, g: t.normal_(0.0, std, generator=g)


def _trunc_normal(std: float) -> Fill:
    return lambda t, g: trunc_normal_(t, std, g)


def _init_rules(model: LLaMA) -> dict[str, Fill]:
    """Per parameter name, the fill fms's reset_parameters applies to it."""
    model_config = model.config
    rules: dict[str, Fill] = {}
    for mod_name, module in model.named_modules():
        for p_name, _ in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if p_name in ("lora_A", "lora_B"):  # an adapter starts as nothing: B = 0 (A as PEFT draws it)
                rules[full] = _zeros if p_name == "lora_B" else _uniform(1 / math.sqrt(module.in_features))
            elif p_name == "bias" or isinstance(module, LayerNormParameterized):
                rules[full] = _zeros if p_name == "bias" else _ones
            elif module is model.head:
                rules[full] = _normal(1 / math.sqrt(math.sqrt(model_config.emb_dim * model_config.src_vocab_size)))
            elif isinstance(module, nn.Embedding):
                rules[full] = _trunc_normal(model_config.emb_dim**-0.5)
            elif isinstance(module, (nn.Linear, ConditionalFeedForward)):  # a Linear, or experts' stacked weights
                rules[full] = _trunc_normal(0.02)
            else:
                raise TypeError(f"no init rule for parameter {full} of {type(module).__name__}")
    return rules


@torch.no_grad()
def init_weights(model: LLaMA, seed: int) -> None:
    """Initialise every parameter (whole, FSDP2- or tensor-parallel-sharded, fused or not) identically
    for a given seed, then set up the rotary embedding cache on the parameters' device."""
    rules = _init_rules(model)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    origin = {}  # unfused part -> (fused name, its first row there, the fused weight's rows)
    for fused, members in fused_parts(shapes).items():
        total = members[-1][1] + shapes[members[-1][0]][0]
        origin.update({m: (fused, row, total) for m, row in members})
    head, embedding = getattr(model, "head", None), model.base_model.embedding
    if head is not None and embedding is not None and head.weight is embedding.weight:  # tied, and listed once
        rules["base_model.embedding.weight"] = rules["head.weight"]  # the head's draw, as post_init ties them
        origin["base_model.embedding.weight"] = ("head.weight", 0, head.weight.shape[0])
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        offset, shape = local_box(param)
        if tuple(local.shape) != shape:
            raise RuntimeError(f"{name}: local shard is {tuple(local.shape)}, expected {shape}")
        # an unfused part draws the rows of the fused weight it is cut from: the same values at any T
        seed_name, first, rows = origin.get(name, (name, 0, param.shape[0]))
        start, stop = first + offset[0], first + offset[0] + shape[0]
        cols = tuple(slice(o, o + n) for o, n in zip(offset[1:], shape[1:]))
        row_numel = math.prod(param.shape[1:])
        block = max(1, _INIT_BLOCK_NUMEL // max(1, row_numel))
        name_seed = zlib.crc32(seed_name.encode())
        for b in range(start // block, -(-stop // block)):
            lo, hi = b * block, min((b + 1) * block, rows)
            g = torch.Generator().manual_seed((seed * 1_000_003 + name_seed) * 65_537 + b)
            values = torch.empty((hi - lo, *param.shape[1:]), dtype=torch.float32)
            rules[name](values, g)
            s, e = max(lo, start), min(hi, stop)
            local[s - start : e - start].copy_(values[(slice(s - lo, e - lo), *cols)])
    model.post_init()
