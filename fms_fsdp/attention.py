"""Attention over packed lines, and lines split over ranks: --document_masking keeps every token's
attention inside its own document (--document_positions=document restarts the rotary positions at
each document); --context_parallel_size=C splits every line over C ranks.

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
  as two flash attentions per chunk merged by their log-sum-exps (`_LineAttention`: no seq^2 mask, and
  the keys and values gathered again in the backward rather than kept), or under the documents' mask
  (a BlockMask or a boolean one of this rank's queries). Rotary positions are the tokens' places in the
  whole line (or in their document). With --cp_attention=ring, causal lines go through torch's ring
  attention instead (`_ring_attention`): C steps, each attending to the keys and values the previous
  rank passed on while passing its own to the next, so no rank ever holds the whole line's.
Results equal one rank's unsplit, unmasked-as-packed computation (tests/test_attention.py,
tests/test_meshes.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from fms.modules.attention import _sdpa_store_op, register_attention_op
from torch.nn.attention.bias import causal_lower_right
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from fms_fsdp.compat import (
    all_gather_autograd,
    all_gather_rows,
    all_reduce_sum,
    cpu_flash_attention,
    cpu_flash_attention_backward,
    group_named,
    reduce_scatter_rows,
    ring_attention,
    ring_attention_backward,
)
from fms_fsdp.config import train_config
from fms_fsdp.loss import IGNORE_INDEX

FLEX = "fms_fsdp_flex"
CONTEXT = "fms_fsdp_context_parallel"
RING = "fms_fsdp_ring"


@dataclass(frozen=True)
class ContextParallel:
    """This rank's place in its --context_parallel_size group: which chunks of a line it holds."""

    group: dist.ProcessGroup
    rank: int
    size: int

    def chunks(self, seq: int) -> list[tuple[int, int]]:
        """(start, stop) in the line of this rank's two chunks: chunk `rank` and chunk 2C-1-`rank` of 2C."""
        n, c = seq // (2 * self.size), self.size
        return [(self.rank * n, (self.rank + 1) * n), ((2 * c - 1 - self.rank) * n, (2 * c - self.rank) * n)]

    def split(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's part of `t` along its sequence dimension `dim`."""
        return torch.cat([t.narrow(dim, start, stop - start) for start, stop in self.chunks(t.shape[dim])], dim)

    def gather(self, local: torch.Tensor, dim: int, autograd: bool = True) -> torch.Tensor:
        """The whole line from every rank's part (`split`'s inverse): differentiable, the backward
        reduce-scattering the gradient; or without autograd (attention's inputs, gathered again in its
        own backward, which `scatter`s their gradients)."""
        moved = local.movedim(dim, 0).contiguous()
        whole = all_gather_autograd(moved, 0, self.group) if autograd else all_gather_rows(moved, self.group)
        return self._line_order(whole).movedim(0, dim)

    def scatter(self, whole: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's part along `dim` of `whole`, summed over the group: `gather`'s backward."""
        parts = whole.movedim(dim, 0).chunk(2 * self.size)
        by_rank = [parts[i] for r in range(self.size) for i in (r, 2 * self.size - 1 - r)]
        return reduce_scatter_rows(torch.cat(by_rank, 0), self.group).movedim(0, dim)

    def _line_order(self, by_rank: torch.Tensor) -> torch.Tensor:
        """Rank-ordered parts along dim 0 (rank r: chunks r, 2C-1-r) in the line's order."""
        parts = by_rank.chunk(2 * self.size)
        ordered = [parts[2 * g] for g in range(self.size)] + [parts[2 * g + 1] for g in reversed(range(self.size))]
        return torch.cat(ordered, 0)

    def loss_scale(self, labels: torch.Tensor) -> torch.Tensor:
        """C x this rank's share of the group's counted tokens: the loss of the line's mean over all its
        tokens, once FSDP averages the gradients over the C ranks too."""
        local = (labels != IGNORE_INDEX).sum().to(torch.float32)
        total = all_reduce_sum(local, self.group)
        return self.size * local / total.clamp_min(1.0)


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
    def of(cfg: train_config, device: torch.device, context: Optional[ContextParallel]) -> Optional["LinePlan"]:
        """The run's plan, None when lines are plain causal on one rank; FlexAttention for documents
        where it is compiled and has a backward (CUDA)."""
        if not cfg.document_masking and context is None:
            return None
        eos = cfg.eos_token if cfg.document_masking else None
        flex = flex_documents(cfg.use_torch_compile, device.type)
        ring = context is not None and cfg.cp_attention == "ring"
        return LinePlan(eos, cfg.document_positions == "document", context, flex, ring)

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
        out = _LineAttention.apply(q, k, _own_values(v), cp, scale_factor)
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


def _tokens_major(out: torch.Tensor) -> torch.Tensor:
    """`out` [batch, heads, seq, dim] laid out as [batch, seq, heads, dim] in memory, as SDPA's kernels
    make theirs: the attention keeps it for its backward and the output projection, transposed back,
    keeps the same tensor instead of a copy of it."""
    return out.transpose(1, 2).contiguous().transpose(1, 2)


def _own_values(v: torch.Tensor) -> torch.Tensor:
    """A copy of the values for an attention that keeps them for its backward: v is a view into the
    fused q, k, v projection's output, which the view would keep whole (heads / KV heads + 2 times the
    values: 4x in `tiny`, 6x in Llama 3 8B); with the copy it goes once the block's forward ends."""
    return v.clone(memory_format=torch.contiguous_format)


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
    out, _ = _ring_attention(q, k, _own_values(v), cp.group.group_name, scale_factor)
    return out


@torch.library.custom_op("fms_fsdp::ring_attention", mutates_args=())
def _ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: str, scale: Optional[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's ring attention (compat.ring_attention) over the process group named `group`: (output
    [batch, seq, heads, dim], tokens first as the output projection reads it, so that the one copy is
    kept for both backwards; log-sum-exp). An op of its own, opaque to torch.compile, which cannot
    trace torch's ring."""
    out, lse = ring_attention(group_named(group), q, k, v, scale)
    return out.transpose(1, 2).contiguous(), lse.contiguous()


@_ring_attention.register_fake
def _(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: str, scale: Optional[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, heads, seq, dim = q.shape
    return q.new_empty(batch, seq, heads, dim), q.new_empty(batch, heads, seq, dtype=torch.float32)


@torch.library.custom_op("fms_fsdp::ring_attention_backward", mutates_args=())
def _ring_attention_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    group: str,
    scale: Optional[float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of `_ring_attention` (`grad` and `out` tokens first): the keys and values go round
    the ring again."""
    grad, out = grad.transpose(1, 2).contiguous(), out.transpose(1, 2)
    dq, dk, dv = ring_attention_backward(group_named(group), grad, q, k, v, out, lse, scale)
    return dq.contiguous(), dk.clone(), dv.clone()  # dk, dv: views of one buffer, and outputs may not alias


@_ring_attention_backward.register_fake
def _(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    group: str,
    scale: Optional[float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _ring_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    """The backward keeps only this rank's queries, keys, values, output and log-sum-exp."""
    q, k, v, ctx.group, ctx.scale = inputs
    ctx.save_for_backward(q, k, v, *output)


def _ring_backward(
    ctx: Any, grad: torch.Tensor, _grad_lse: Optional[torch.Tensor]
) -> tuple[Optional[torch.Tensor], ...]:
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _ring_attention_backward(grad, q, k, v, out, lse, ctx.group, ctx.scale)
    return dq, dk, dv, None, None


_ring_attention.register_autograd(_ring_backward, setup_context=_ring_setup)
RING_ATTENTION = torch.ops.fms_fsdp.ring_attention.default  # the op --ac_mode=op keeps (parallel.py)


class _LineAttention(torch.autograd.Function):
    """This rank's queries (its two chunks) over the whole line's keys and values, causal, on the CPU
    without a seq^2 mask. The keys and values are all-gathered here and again in the backward (whose
    gradients are reduce-scattered back), so each block keeps only this rank's part of them between
    forward and backward. A chunk's queries (global positions start, start + 1, ...) see the keys
    before it, all visible, and its own, causal: two flash attentions merged by their log-sum-exps;
    the backward runs each one's flash backward with the merged output and log-sum-exp (as ring
    attention does). Keys and values stay one per KV head: the CPU flash kernel takes grouped-query
    attention as is."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cp: ContextParallel,
        scale: Optional[float],
    ) -> torch.Tensor:
        keys, values = cp.gather(k, 2, autograd=False), cp.gather(v, 2, autograd=False)
        outs, lses, offset = [], [], 0
        for start, stop in cp.chunks(keys.shape[2]):
            n = stop - start
            o, s = _chunk_forward(q[:, :, offset : offset + n], keys, values, start, stop, scale)
            outs.append(o)
            lses.append(s)
            offset += n
        out = torch.cat([o.transpose(1, 2) for o in outs], 1).transpose(1, 2)  # laid out as _tokens_major's
        ctx.save_for_backward(q, k, v, out, torch.cat(lses, 2))
        ctx.cp, ctx.scale = cp, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        q, k, v, out, lse = ctx.saved_tensors
        cp: ContextParallel = ctx.cp
        keys, values = cp.gather(k, 2, autograd=False), cp.gather(v, 2, autograd=False)
        dk, dv = torch.zeros_like(keys), torch.zeros_like(values)
        grad, dqs, offset = _tokens_major(grad), [], 0  # as the output: no copy when it already is
        for start, stop in cp.chunks(keys.shape[2]):
            part = slice(offset, offset + stop - start)
            chunk = (q[:, :, part], out[:, :, part], lse[:, :, part])
            dqs.append(_chunk_backward(grad[:, :, part], *chunk, keys, values, dk, dv, start, stop, ctx.scale))
            offset += stop - start
        return torch.cat(dqs, 2), cp.scatter(dk, 2), cp.scatter(dv, 2), None, None


def _pieces(start: int, stop: int) -> list[tuple[slice, bool]]:
    """The keys a chunk [start, stop) of queries attends to: its own, causal, then those before it."""
    return [(slice(start, stop), True)] + [(slice(0, start), False)] * (start > 0)


def _chunk_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    stop: int,
    scale: Optional[float],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp) of one chunk's queries `q` over the line's keys `k` and values `v`."""
    out, lse = None, None
    for keys, causal in _pieces(start, stop):
        o, s = cpu_flash_attention(q, k[:, :, keys], v[:, :, keys], causal, scale)
        if out is None or lse is None:
            out, lse = o.float(), s
            continue
        merged = torch.logaddexp(lse, s)
        out = out * (lse - merged).exp()[..., None] + o.float() * (s - merged).exp()[..., None]
        lse = merged
    assert out is not None and lse is not None
    return out.to(q.dtype), lse


def _chunk_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    start: int,
    stop: int,
    scale: Optional[float],
) -> torch.Tensor:
    """One chunk's query gradient; its key and value gradients are added into the line's `dk`, `dv`."""
    dq = torch.zeros_like(q, dtype=torch.float32)  # two pieces' sum, in fp32 under bf16
    for keys, causal in _pieces(start, stop):
        gq, gk, gv = cpu_flash_attention_backward(grad, q, k[:, :, keys], v[:, :, keys], out, lse, causal, scale)
        dq += gq
        dk[:, :, keys] += gk
        dv[:, :, keys] += gv
    return dq.to(q.dtype)


register_attention_op(FLEX, _sdpa_store_op, _flex_compute_op)
register_attention_op(CONTEXT, _sdpa_store_op, _context_compute_op)
register_attention_op(RING, _sdpa_store_op, _ring_compute_op)
