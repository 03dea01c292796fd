"""The training loss: next-token cross entropy through the output head, chunk by chunk over the tokens.

A micro-batch of N tokens and a vocabulary of V would need N x V fp32 logits (16 GiB for Llama 3's
128k vocabulary at 8 x 4096 tokens). Here the head's matmul, the fp32 log-softmax and the gradients
of the logits are computed for one chunk of tokens at a time, in the forward pass (as Liger's fused
linear cross entropy does): each chunk's gradient w.r.t. the hidden states and the head weight is
kept, its logits are dropped, and backward only scales them. The head weight's gradient sums the
chunks' products (each in the hidden states' dtype) in fp32. `chunk_loss` is what torch.compile
fuses when the run compiles. Without gradients (evaluation) only the cross entropy is computed.

z-loss (--z_loss_weight w, PaLM's and OLMo's): w * logsumexp(logits)^2 per token is added to the
cross entropy, inside the same chunks; its gradient w.r.t. the logits is 2 w lse * softmax.

Under tensor parallelism (loss parallel) each rank's head holds a slice of the vocabulary
(`VocabShard`): per chunk, the maximum and the sum of exponentials are all-reduced over the group,
with the target logit from the rank that holds it, so no rank computes the whole vocabulary's logits;
the hidden states' gradient is then a partial sum, reduced by the caller (models.LMHead). This path
runs eager (its collectives are not compiled).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist

IGNORE_INDEX = -100
# fp32 logits of one chunk at most this big: small on CPU, where eager ops held 2-3 copies of a chunk
# (measured then: 128 MiB kept the vocab-128k tiny benchmark at 2.18 GiB RSS, 256 MiB 2.55; the softmax
# is now made in place of the logits), larger on GPU
# where the compiled chunk is fused and bigger matmuls run closer to peak (1 GiB: not yet measured)
CHUNK_BYTES = 1 << 27
CUDA_CHUNK_BYTES = 1 << 30

ChunkFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class VocabShard(NamedTuple):
    """Loss parallel: this rank's head holds vocabulary rows [start, start + its rows) of the tensor-
    parallel `group`; the log-sum-exp and the target logits are reduced over the group."""

    group: dist.ProcessGroup
    start: int


@functools.lru_cache(maxsize=64)
def chunk_tokens(n_tokens: int, vocab_size: int, max_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk: the fewest chunks whose fp32 logits fit `max_bytes`, all equal when a divisor
    of the token count at least half as big exists (one shape for torch.compile), else with a shorter
    last chunk (two shapes, never thousands of tiny chunks)."""
    need = max(1, -(-n_tokens * vocab_size * 4 // max_bytes))
    even = next(n_tokens // k for k in range(need, n_tokens + 1) if n_tokens % k == 0)
    uneven = -(-n_tokens // need)
    return even if 2 * even >= uneven else uneven


class _Chunk(NamedTuple):
    """One chunk's terms. `exps`: exp(logits - max), made in place of its fp32 logits (no second
    chunk-sized tensor, which logsumexp would make). Over the whole vocabulary (every slice under loss
    parallel), [C, 1] each: the sum of those exponentials, the log-sum-exp, the valid-label mask, the
    targets, and the one-hot's value at each target (-1; 0 where another slice holds it). `loss`: the
    summed cross entropy over labels != IGNORE_INDEX."""

    exps: torch.Tensor
    sums: torch.Tensor
    lse: torch.Tensor
    valid: torch.Tensor
    target: torch.Tensor
    one_hot: torch.Tensor
    loss: torch.Tensor


def _summed_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> _Chunk:
    """One chunk's terms over the whole vocabulary."""
    logits = (hidden @ weight.t()).float()
    valid = (labels != IGNORE_INDEX).unsqueeze(1)
    target = labels.clamp(min=0).unsqueeze(1)
    picked = logits.gather(1, target)
    top = logits.amax(dim=-1, keepdim=True)
    exps = logits.sub_(top).exp_()
    sums = exps.sum(dim=-1, keepdim=True)
    lse = top + sums.log()
    loss = torch.where(valid, lse - picked, 0.0).sum()
    return _Chunk(exps, sums, lse, valid, target, torch.full_like(lse, -1.0), loss)


def _parallel_summed_loss(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, shard: VocabShard
) -> _Chunk:
    """One chunk's terms when `weight` is a slice of the vocabulary: the max, then the sum of
    exponentials with the target logit from the slice that holds it, are all-reduced over the group
    ([C, 1] and [C, 2]); `exps` and `target` stay this slice's."""
    logits = (hidden @ weight.t()).float()
    top = logits.amax(dim=-1, keepdim=True)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=shard.group)
    valid = (labels != IGNORE_INDEX).unsqueeze(1)
    target = (labels - shard.start).unsqueeze(1)
    owned = valid & (target >= 0) & (target < logits.shape[1])
    target = target.clamp(0, logits.shape[1] - 1)
    picked = torch.where(owned, logits.gather(1, target), 0.0)
    exps = logits.sub_(top).exp_()
    sums = torch.cat([exps.sum(dim=-1, keepdim=True), picked], dim=1)
    dist.all_reduce(sums, group=shard.group)
    lse = top + sums[:, :1].log()
    loss = torch.where(valid, lse - sums[:, 1:], 0.0).sum()
    return _Chunk(exps, sums[:, :1], lse, valid, target, torch.where(owned, -1.0, 0.0), loss)


def _z_terms(lse: torch.Tensor, valid: torch.Tensor, z_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed lse^2 over valid rows, and the factor (1 + 2 w lse) that turns softmax into the
    gradient of cross entropy + w lse^2 (before the one-hot is subtracted)."""
    return torch.where(valid, lse.square(), 0.0).sum(), 1.0 + 2.0 * z_weight * lse


def _loss_and_gradient(
    chunk: _Chunk, z_weight: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The summed cross entropy and lse^2, and the gradient w.r.t. the logits: softmax (1 + 2 w lse) -
    one-hot, zero on ignored rows, made in place of `chunk.exps`, in `dtype`."""
    z, factor = _z_terms(chunk.lse, chunk.valid, z_weight)
    grad = chunk.exps.div_(chunk.sums)
    if z_weight:
        grad.mul_(factor)
    grad = grad.scatter_add_(1, chunk.target, chunk.one_hot).masked_fill_(~chunk.valid, 0.0)
    return chunk.loss, z, grad.to(dtype)


def parallel_chunk_loss(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, z_weight: float, shard: VocabShard
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """chunk_loss over a slice of the vocabulary: the summed cross entropy and lse^2 (the same on every
    rank of the group) and the gradient w.r.t. this slice's logits."""
    return _loss_and_gradient(_parallel_summed_loss(hidden, weight, labels, shard), z_weight, hidden.dtype)


def chunk_loss(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, z_weight: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For one chunk: the summed cross entropy and lse^2 over labels != IGNORE_INDEX (fp32) and the
    gradient of cross entropy + z_weight * lse^2 w.r.t. the logits (softmax (1 + 2 w lse) - one-hot,
    zero on ignored rows), in the hidden states' dtype."""
    return _loss_and_gradient(_summed_loss(hidden, weight, labels), z_weight, hidden.dtype)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,  # type: ignore[override]
        fn: ChunkFn,
        max_bytes: int,
        z_weight: float,
        backward_twice: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        step = chunk_tokens(n, weight.shape[0], max_bytes)
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        z_total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, n, step):
            h, y = hidden[start : start + step], labels[start : start + step]
            loss, z, grad = fn(h, weight, y, z_weight)
            total += loss
            z_total += z
            if grad_h is not None:
                torch.mm(grad, weight, out=grad_h[start : start + step])
            if grad_w is not None:
                if grad.dtype == torch.float32:
                    grad_w.addmm_(grad.t(), h)
                else:
                    grad_w += grad.t() @ h
        scale = 1.0 / (labels != IGNORE_INDEX).sum().clamp(min=1).float()
        ctx.save_for_backward(*(t for t in (grad_h, grad_w) if t is not None), scale)
        ctx.has = (grad_h is not None, grad_w is not None)
        ctx.weight_dtype, ctx.backward_twice = weight.dtype, backward_twice
        z_loss = z_total * (z_weight * scale)
        ctx.mark_non_differentiable(z_loss)
        return total * scale + z_loss, z_loss

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, _grad_z: Optional[torch.Tensor]):  # type: ignore[override]
        *grads, scale = ctx.saved_tensors
        it = iter(grads)
        factor = grad_out * scale
        grad_h = next(it).mul(factor) if ctx.has[0] else None  # a 0-dim fp32 factor keeps bf16 bf16
        grad_w = None
        if ctx.has[1]:  # in place, unless a zero-bubble pipeline runs this backward again for the weights
            saved = next(it)
            grad_w = (saved.mul(factor) if ctx.backward_twice else saved.mul_(factor)).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    fn: Optional[ChunkFn] = None,
    max_chunk_bytes: Optional[int] = None,
    shard: Optional[VocabShard] = None,
    z_weight: float = 0.0,
    backward_twice: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(loss, z-loss): the mean cross entropy of `hidden @ weight.T` against `labels` over labels !=
    -100, plus `z_weight` times the mean lse^2 when training, without the full logits: at most
    `max_chunk_bytes` of fp32 logits exist at once (default: by device); and that z-loss term alone
    (detached; None without gradients, where only the cross entropy is computed). hidden: [..., D];
    labels: [...]; fn: chunk_loss or a compiled copy of it. With `shard`, `weight` is a slice of the
    vocabulary (loss parallel) and the returned gradient of `hidden` is this slice's partial sum."""
    if max_chunk_bytes is None:
        max_chunk_bytes = CUDA_CHUNK_BYTES if hidden.device.type == "cuda" else CHUNK_BYTES
    hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if shard is None:
        fn, summed = fn or chunk_loss, _summed_loss
    else:
        fn, summed = (
            functools.partial(parallel_chunk_loss, shard=shard),
            functools.partial(_parallel_summed_loss, shard=shard),
        )
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        loss, z_loss = _ChunkedCrossEntropy.apply(hidden, weight, labels, fn, max_chunk_bytes, z_weight, backward_twice)
        return loss, z_loss
    n, step = hidden.shape[0], chunk_tokens(hidden.shape[0], weight.shape[0], max_chunk_bytes)
    total = sum(summed(hidden[i : i + step], weight, labels[i : i + step]).loss for i in range(0, n, step))
    return total / (labels != IGNORE_INDEX).sum().clamp(min=1), None
