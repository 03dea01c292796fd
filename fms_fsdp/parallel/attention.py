"""Attention over packed lines, and lines split over ranks: --document_masking keeps every token's
attention inside its own document (--document_positions=document restarts the rotary positions at
each document); --context_parallel_size=C splits every line over C ranks (parallel/context_parallel.py: a
rank's chunks of the line, and the attentions that ops registered here call).

A line packs documents, each ended by --eos_token; a token belongs to the document of the eos that
ends it, and a new document starts after each eos. `LinePlan.prepare` turns a batch of input tokens
into what fms's LLaMA forward takes (this rank's tokens, position_ids, the attention's mask), on the
device, without a host sync, once per forward pass and shared by every block:
- documents: compiled runs on CUDA use FlexAttention with a BlockMask (`flex`, an fms attention op):
  blocks no query may see are skipped, so the cost falls with the documents' lengths; other runs pass
  SDPA a boolean [batch, 1, queries, seq] mask (fms's own sdpa op), which works on every device, at
  seq^2 bytes per line (FlexAttention has no backward on the CPU in torch 2.13, and runs unfused when
  not compiled);
- context parallel (Llama 3's approach): the line is cut into 2C chunks and rank i keeps chunks i and
  2C-1-i, so every rank does the same causal-attention work; each attention all-gathers the keys and
  values of the whole line over the C ranks (its backward reduce-scatters their gradients) and
  attends for this rank's queries: chunk by chunk with SDPA's lower-right causal mask (flash kernels on
  CUDA; the masks are made before the blocks, which torch.compile could not make them in), on the CPU
  as two flash attentions per chunk merged by their log-sum-exps (`LineAttention`: no seq^2 mask, and
  the keys and values gathered again in the backward rather than kept), or under the documents' mask
  (a BlockMask or a boolean one of this rank's queries). Rotary positions are the tokens' places in the
  whole line (or in their document). With --cp_attention=ring, causal lines go through torch's ring
  attention instead (`ring_attention_op`): C steps, each attending to the keys and values the previous
  rank passed on while passing its own to the next, so no rank ever holds the whole line's.
Results equal one rank's unsplit, unmasked-as-packed computation (tests/test_attention.py,
tests/test_meshes.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from fms.modules.attention import _sdpa_store_op, register_attention_op
from torch.nn.attention.bias import causal_lower_right
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from fms_fsdp.parallel.context_parallel import ContextParallel, LineAttention, own_values, ring_attention_op
from fms_fsdp.parallel.settings import AttentionSettings

FLEX = "fms_fsdp_flex"
CONTEXT = "fms_fsdp_context_parallel"
RING = "fms_fsdp_ring"


@dataclass(frozen=True)
class LinePlan:
    """How a line's tokens are attended to: documents (eos, positions restarted or not), a split over
    ranks (keys and values all-gathered, or passed round a ring), FlexAttention or SDPA."""

    eos: Optional[int]  # --document_masking: documents end at this token
    restart_positions: bool
    context: Optional[ContextParallel]
    flex: bool
    ring: bool = False  # --cp_attention=ring

    @staticmethod
    def of(
        settings: AttentionSettings, device: torch.device, context: Optional[ContextParallel]
    ) -> Optional["LinePlan"]:
        """The run's plan, None when lines are plain causal on one rank; FlexAttention for documents
        where it is compiled and has a backward (CUDA)."""
        if settings.eos is None and context is None:
            return None
        flex = flex_documents(settings.compile, device.type)
        ring = context is not None and settings.ring
        return LinePlan(settings.eos, settings.restart_positions, context, flex, ring)

    def prepare(
        self, x: torch.Tensor, labels: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, Optional[torch.Tensor], dict[str, Any]]:
        """(this rank's input tokens, its labels, fms forward kwargs) of a batch of lines `x` [batch, seq]."""
        batch, seq = x.shape
        index = torch.arange(seq, device=x.device)
        positions, doc = index.expand(batch, seq), None
        if self.eos is not None:
            starts = torch.zeros_like(x, dtype=torch.bool)
            starts[:, 1:] = x[:, :-1] == self.eos  # a document starts after each eos
            doc = starts.cumsum(-1)
            if self.restart_positions:
                positions = positions - torch.where(starts, positions, 0).cummax(-1).values
        kwargs: dict[str, Any] = {"position_ids": positions} if self.restart_positions else {}
        cp = self.context
        queries = index if cp is None else cp.split(index, 0)  # this rank's, by their places in the line
        if self.flex and doc is not None:  # documents, compiled on CUDA
            kwargs.update(attn_name=FLEX, block_mask=document_block_mask(doc, queries))
        elif doc is not None:  # SDPA's boolean mask: this rank's queries against the whole line
            query_doc = doc[:, queries]
            mask = (queries[:, None] >= index[None, :]) & (query_doc[:, :, None] == doc[:, None, :])
            kwargs.update(mask=mask[:, None], is_causal_mask=False)
        elif cp is not None and not self.ring and x.device.type != "cpu":
            # the chunks' causal masks, made here: torch.compile cannot build them in a block
            kwargs["causal"] = [causal_lower_right(stop - start, stop) for start, stop in cp.chunks(seq)]
        if cp is None:
            return x, labels, kwargs
        kwargs.update(attn_name=RING if self.ring else CONTEXT, context=cp, position_ids=cp.split(positions, 1))
        return cp.split(x, 1), None if labels is None else cp.split(labels, 1), kwargs


def flex_documents(compiled: bool, device_type: str) -> bool:
    """Whether documents are masked by FlexAttention's BlockMask: where it is compiled and has a
    backward (CUDA), else by SDPA's boolean mask."""
    return compiled and device_type == "cuda"


def document_block_mask(doc: torch.Tensor, queries: torch.Tensor) -> BlockMask:
    """FlexAttention's causal mask within documents, `doc` [batch, seq] the document of each token, for
    the queries at places `queries` of the line (all of them on one rank, a context-parallel rank's
    two chunks) against the whole line's keys."""
    query_doc = doc[:, queries]

    def same_document(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (queries[q] >= kv) & (query_doc[b, q] == doc[b, kv])

    batch, seq = doc.shape
    build = _compiled_block_mask() if doc.is_cuda else create_block_mask
    return build(same_document, batch, None, len(queries), seq, device=doc.device)


@functools.cache
def _compiled_block_mask() -> Any:
    """create_block_mask compiled (as torchtitan does): eagerly it would build the whole seq^2 mask
    before reducing it to blocks."""
    return torch.compile(create_block_mask)


def _heads_first(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, kvheads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[batch, heads, seq, dim] queries, keys and values from fms's attention contract."""
    if key_cache.shape[1] != kvheads and key_cache.shape[2] == kvheads:
        key_cache, value_cache = key_cache.transpose(2, 1), value_cache.transpose(2, 1)
    return query.transpose(2, 1), key_cache, value_cache


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
    """FlexAttention under attn_kwargs["block_mask"], in fms's attention contract."""
    q, k, v = _heads_first(query, key_cache, value_cache, kvheads)
    out = flex_attention(
        q, k, v, block_mask=attn_kwargs["block_mask"], scale=scale_factor, enable_gqa=nheads != kvheads
    )
    assert isinstance(out, torch.Tensor)
    return out.transpose(2, 1).contiguous()


def _context_compute_op(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    nheads: int,
    kvheads: int,
    p_dropout: float,
    scale_factor: Optional[float],
    **attn_kwargs: Any,
) -> torch.Tensor:
    """This rank's queries against the whole line's keys and values, all-gathered (see the module)."""
    cp: ContextParallel = attn_kwargs["context"]
    q, k, v = _heads_first(query, key_cache, value_cache, kvheads)
    gqa = nheads != kvheads
    mask, biases = attn_kwargs.get("mask"), attn_kwargs.get("causal")
    block_mask = attn_kwargs.get("block_mask")
    if mask is None and biases is None and block_mask is None:  # the CPU: no seq^2 mask, the line's keys not kept
        out = LineAttention.apply(q, k, own_values(v), cp, scale_factor)
        return out.transpose(2, 1).contiguous()  # no copy: laid out tokens first
    k, v = cp.gather(k, 2), cp.gather(v, 2)
    if block_mask is not None:  # documents, compiled on CUDA
        out = flex_attention(q, k, v, block_mask=block_mask, scale=scale_factor, enable_gqa=gqa)
        assert isinstance(out, torch.Tensor)
    elif mask is not None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale_factor, enable_gqa=gqa)
    else:  # query i sees keys up to start + i: SDPA's flash kernels take this mask unmaterialised
        assert biases is not None
        outs, offset = [], 0
        for (start, stop), causal in zip(cp.chunks(k.shape[2]), biases):
            n = stop - start
            part, keys, values = q[:, :, offset : offset + n], k[:, :, :stop], v[:, :, :stop]
            outs.append(
                F.scaled_dot_product_attention(part, keys, values, attn_mask=causal, scale=scale_factor, enable_gqa=gqa)
            )
            offset += n
        out = torch.cat(outs, 2)
    return out.transpose(2, 1).contiguous()


def _ring_compute_op(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    nheads: int,
    kvheads: int,
    p_dropout: float,
    scale_factor: Optional[float],
    **attn_kwargs: Any,
) -> torch.Tensor:
    """This rank's queries against the whole line, causal, by torch's ring attention (--cp_attention=ring)."""
    q, k, v = _heads_first(query, key_cache, value_cache, kvheads)
    cp: ContextParallel = attn_kwargs["context"]
    out, _ = ring_attention_op(q, k, own_values(v), cp.group.group_name, scale_factor)
    return out


register_attention_op(FLEX, _sdpa_store_op, _flex_compute_op)
register_attention_op(CONTEXT, _sdpa_store_op, _context_compute_op)
register_attention_op(RING, _sdpa_store_op, _ring_compute_op)
