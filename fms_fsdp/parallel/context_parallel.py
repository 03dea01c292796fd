"""Context parallelism (--context_parallel_size=C): a line split over C ranks, and the attention of
a rank's queries against the whole line (parallel/attention.py registers the ops that call these).

`ContextParallel` is a rank's place in its group (Llama 3's approach): the line is cut into 2C chunks
and rank i keeps chunks i and 2C-1-i, so every rank does the same causal-attention work; it splits a
batch, gathers the whole line back (the backward reduce-scattering) and scales the loss by the rank's
share of the line's tokens. On the CPU without a seq^2 mask, `LineAttention` attends as two flash
attentions per chunk merged by their log-sum-exps, the keys and values all-gathered and gathered again
in the backward rather than kept. With --cp_attention=ring, causal lines go through torch's ring
attention (`ring_attention_op`, a custom op opaque to torch.compile): C steps, each attending to the
keys and values the previous rank passed on while passing its own to the next, so no rank ever holds
the whole line's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

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
from fms_fsdp.model.loss import IGNORE_INDEX


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


def _tokens_major(out: torch.Tensor) -> torch.Tensor:
    """`out` [batch, heads, seq, dim] laid out as [batch, seq, heads, dim] in memory, as SDPA's kernels
    make theirs: the attention keeps it for its backward and the output projection, transposed back,
    keeps the same tensor instead of a copy of it."""
    return out.transpose(1, 2).contiguous().transpose(1, 2)


def own_values(v: torch.Tensor) -> torch.Tensor:
    """A copy of the values for an attention that keeps them for its backward: v is a view into the
    fused q, k, v projection's output, which the view would keep whole (heads / KV heads + 2 times the
    values: 4x in `tiny`, 6x in Llama 3 8B); with the copy it goes once the block's forward ends."""
    return v.clone(memory_format=torch.contiguous_format)


@torch.library.custom_op("fms_fsdp::ring_attention", mutates_args=())
def ring_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: str, scale: Optional[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's ring attention (compat.ring_attention) over the process group named `group`: (output
    [batch, seq, heads, dim], tokens first as the output projection reads it, so that the one copy is
    kept for both backwards; log-sum-exp). An op of its own, opaque to torch.compile, which cannot
    trace torch's ring."""
    out, lse = ring_attention(group_named(group), q, k, v, scale)
    return out.transpose(1, 2).contiguous(), lse.contiguous()


@ring_attention_op.register_fake
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
    """(dq, dk, dv) of `ring_attention_op` (`grad` and `out` tokens first): the keys and values go round
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


ring_attention_op.register_autograd(_ring_backward, setup_context=_ring_setup)
RING_ATTENTION = torch.ops.fms_fsdp.ring_attention.default  # the op --ac_mode=op keeps (parallel.py)


class LineAttention(torch.autograd.Function):
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
