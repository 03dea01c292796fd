"""The sizes fms's LLaMA derives from its config: the FFN's width and the rows where the fused weights'
parts start; light to import (no model)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fms.models.llama import LLaMA, LLaMAConfig


def part_rows(model: LLaMA) -> dict[str, tuple[int, ...]]:
    """For a model built fused: each fused weight's name -> the rows its parts start at, and its rows
    (q, k, v; gate, up), so that what works on whole matrices (Muon) treats the parts as the unfused
    model's separate weights. Empty for a model built unfused."""
    config = model.config
    head_dim = config.emb_dim // config.nheads
    q, kv, ffn = config.nheads * head_dim, config.kvheads * head_dim, hidden_dim(config)
    rows = {"qkv_fused": (0, q, q + kv, q + 2 * kv), "wg1_fused": (0, ffn, 2 * ffn)}
    return {name: rows[name.split(".")[-2]] for name, _ in model.named_parameters() if name.split(".")[-2] in rows}


def hidden_dim(model_config: LLaMAConfig) -> int:
    """fms GatedLinearUnit's hidden size (the FFN width)."""
    hidden = int(model_config.hidden_grow_factor * model_config.emb_dim)
    multiple = model_config.multiple_of
    return multiple * ((hidden + multiple - 1) // multiple) if multiple else hidden
