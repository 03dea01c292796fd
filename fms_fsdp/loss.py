"""The training loss: next-token cross entropy through the output head, chunk by chunk over the tokens.

A micro-batch of N tokens and a vocabulary of V would need N x V fp32 logits (16 GiB for Llama 3's
128k vocabulary at 8 x 4096 tokens). Here the head's matmul, the fp32 log-softmax and the gradients
of the logits are computed for one chunk of tokens at a time, in the forward pass (as Liger's fused
linear cross entropy does): each chunk's gradient w.r.t. the hidden states and the head weight is
kept, its logits are dropped, and backward only scales them. The head weight's gradient sums the
chunks' products (each in the hidden states' dtype) in fp32. `chunk_loss` is what torch.compile
fuses when the run compiles. Without gradients (evaluation) only the loss is computed.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

IGNORE_INDEX = -100
# fp32 logits of one chunk at most this big: small on CPU, where eager ops hold 2-3 copies of a chunk
# (measured: 128 MiB keeps the vocab-128k tiny benchmark at 2.18 GiB RSS, 256 MiB 2.55), larger on GPU
# where the compiled chunk is fused and bigger matmuls run closer to peak (1 GiB: not yet measured)
CHUNK_BYTES = 1 << 27
CUDA_CHUNK_BYTES = 1 << 30

ChunkFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@functools.lru_cache(maxsize=64)
def chunk_tokens(n_tokens: int, vocab_size: int, max_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk: the fewest chunks whose fp32 logits fit `max_bytes`, all equal when a divisor
    of the token count at least half as big exists (one shape for torch.compile), else with a shorter
    last chunk (two shapes, never thousands of tiny chunks)."""
    need = max(1, -(-n_tokens * vocab_size * 4 // max_bytes))
    even = next(n_tokens // k for k in range(need, n_tokens + 1) if n_tokens % k == 0)
    uneven = -(-n_tokens // need)
    return even if 2 * even >= uneven else uneven


def _summed_loss(hidden: torch.Tensor, weight: torch.Tensor,
                 labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's fp32 logits, their log-sum-exp, the valid-label mask and targets ([C, 1] each), and
    the summed cross entropy over labels != IGNORE_INDEX."""
    logits = (hidden @ weight.t()).float()
    lse = logits.logsumexp(dim=-1, keepdim=True)
    valid = (labels != IGNORE_INDEX).unsqueeze(1)
    target = labels.clamp(min=0).unsqueeze(1)
    return logits, lse, valid, target, torch.where(valid, lse - logits.gather(1, target), 0.0).sum()


def chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For one chunk: the summed cross entropy over labels != IGNORE_INDEX (fp32) and its gradient
    w.r.t. the logits (softmax - one-hot, zero on ignored rows), in the hidden states' dtype."""
    logits, lse, valid, target, loss = _summed_loss(hidden, weight, labels)
    # in place: one chunk of logits becomes its gradient
    grad = logits.sub_(lse).exp_().scatter_add_(1, target, torch.full_like(lse, -1.0)).masked_fill_(~valid, 0.0)
    return loss, grad.to(hidden.dtype)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,  # type: ignore[override]
                fn: ChunkFn, max_bytes: int) -> torch.Tensor:
        n = hidden.shape[0]
        step = chunk_tokens(n, weight.shape[0], max_bytes)
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, n, step):
            h, y = hidden[start : start + step], labels[start : start + step]
            loss, grad = fn(h, weight, y)
            total += loss
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
        ctx.weight_dtype = weight.dtype
        return total * scale

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        *grads, scale = ctx.saved_tensors
        it = iter(grads)
        factor = grad_out * scale
        grad_h = next(it).mul(factor) if ctx.has[0] else None  # a 0-dim fp32 factor keeps bf16 bf16
        grad_w = next(it).mul_(factor).to(ctx.weight_dtype) if ctx.has[1] else None  # in place: once only
        return grad_h, grad_w, None, None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          fn: Optional[ChunkFn] = None, max_chunk_bytes: Optional[int] = None) -> torch.Tensor:
    """Mean cross entropy of `hidden @ weight.T` against `labels` over labels != -100, without the full
    logits: at most `max_chunk_bytes` of fp32 logits exist at once (default: by device). hidden: [..., D];
    labels: [...]; fn: chunk_loss or a compiled copy of it."""
    if max_chunk_bytes is None:
        max_chunk_bytes = CUDA_CHUNK_BYTES if hidden.device.type == "cuda" else CHUNK_BYTES
    hidden, labels, fn = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1), fn or chunk_loss
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _ChunkedCrossEntropy.apply(hidden, weight, labels, fn, max_chunk_bytes)
    n, step = hidden.shape[0], chunk_tokens(hidden.shape[0], weight.shape[0], max_chunk_bytes)
    total = sum(_summed_loss(hidden[i : i + step], weight, labels[i : i + step])[-1] for i in range(0, n, step))
    return total / (labels != IGNORE_INDEX).sum().clamp(min=1)
