"""Attention over packed lines: --document_masking keeps every token's attention inside its own
document, --document_positions=document restarts the rotary positions at each document.

A line packs documents, each ended by --eos_token; a token belongs to the document of the eos that
ends it, and a new document starts after each eos. `Documents.kwargs` turns a batch of input tokens
into what fms's LLaMA forward takes (position_ids; the attention's mask), on the device, without a host
sync, once per forward pass and shared by every block:
- compiled runs on CUDA use FlexAttention with a BlockMask (`flex`, registered with fms as an
  attention op): blocks of the line that no query of a block may see are skipped, so the cost falls
  with the documents' lengths;
- other runs pass SDPA a boolean [batch, 1, seq, seq] mask (fms's own sdpa op), which works on every
  device and backend SDPA has for masks, at seq^2 bytes per line (FlexAttention has no backward on
  the CPU in torch 2.13, and runs unfused when not compiled).
Both give the same result (tests/test_attention.py; compiled FlexAttention: tests/test_cuda.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from fms.modules.attention import _sdpa_store_op, register_attention_op
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from fms_fsdp.config import train_config

FLEX = "fms_fsdp_flex"


@dataclass(frozen=True)
class Documents:
    """How packed documents are seen: masked apart, positions restarted, FlexAttention or SDPA."""

    eos: int
    restart_positions: bool
    flex: bool

    @staticmethod
    def of(cfg: train_config, device: torch.device) -> Optional["Documents"]:
        """--document_masking's settings; FlexAttention where it is compiled and has a backward (CUDA)."""
        if not cfg.document_masking:
            return None
        flex = cfg.use_torch_compile and device.type == "cuda"
        return Documents(cfg.eos_token, cfg.document_positions == "document", flex)

    def kwargs(self, x: torch.Tensor) -> dict[str, Any]:
        """fms forward kwargs for input tokens `x` [batch, seq]: the documents' mask and positions."""
        batch, seq = x.shape
        starts = torch.zeros_like(x, dtype=torch.bool)
        starts[:, 1:] = x[:, :-1] == self.eos  # a document starts after each eos
        doc = starts.cumsum(-1)
        out: dict[str, Any] = {}
        if self.restart_positions:
            index = torch.arange(seq, device=x.device).expand(batch, seq)
            out["position_ids"] = index - torch.where(starts, index, 0).cummax(-1).values
        if self.flex:
            out.update(attn_name=FLEX, block_mask=document_block_mask(doc))
        else:
            causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
            out.update(mask=(doc[:, :, None] == doc[:, None, :]) & causal, is_causal_mask=False)
        return out


def document_block_mask(doc: torch.Tensor) -> BlockMask:
    """FlexAttention's causal mask within documents, `doc` [batch, seq] the document of each token."""

    def same_document(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (q >= kv) & (doc[b, q] == doc[b, kv])

    batch, seq = doc.shape
    return create_block_mask(same_document, batch, None, seq, seq, device=doc.device)


def _flex_compute_op(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    nheads: int,
    kvheads: int,
    p_dropout: float,
    scale_factor: Optional[float],
    **attn_kwargs: Any,
) -> torch.Tensor:
    """fms's attention contract ([batch, seq, heads, dim] queries, keys and values as the sdpa store op
    left them) computed by FlexAttention under attn_kwargs["block_mask"]."""
    queries = query.transpose(2, 1)
    if key_cache.shape[1] != kvheads and key_cache.shape[2] == kvheads:
        key_cache, value_cache = key_cache.transpose(2, 1), value_cache.transpose(2, 1)
    out = flex_attention(
        queries,
        key_cache,
        value_cache,
        block_mask=attn_kwargs["block_mask"],
        scale=scale_factor,
        enable_gqa=nheads != kvheads,
    )
    assert isinstance(out, torch.Tensor)
    return out.transpose(2, 1).contiguous()


register_attention_op(FLEX, _sdpa_store_op, _flex_compute_op)
