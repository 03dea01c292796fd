"""A training loop outside the package, to check the package's numerics against: Hugging Face
transformers' LlamaForCausalLM trained by plain PyTorch (torch.optim.AdamW with the package's weight
decay groups, gradient clipping, the package's default LR schedule written out from its definition)
on the same batches, from the same Hugging Face folder the package's run loads (--ckpt_load_path).

What is written here from the package's documented behaviour, not imported from it: the decay groups
(every Linear weight decays, embeddings and norms do not), the schedule (fms-fsdp's quadratic warmup
then cosine to min_lr_ratio: min(1 - (1 - min(x, w)/w)^2, r + (1 - r)/2 (1 + cos(pi x / N))), with
w = min(2000, N // 20)), the loss (mean cross entropy over the global batch's tokens) and clipping
(the global norm to grad_clip_thresh). The batches are the package's synthetic lines (its data, not
its numerics): rank r of W's batch k holds lines (k W + r) b to (k W + r + 1) b - 1, so the global
batch of a step is the same on any data-parallel layout of the same global size."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

LR, WEIGHT_DECAY, BETAS, EPS, CLIP, MIN_RATIO = 3e-4, 0.1, (0.9, 0.95), 1e-8, 1.0, 0.1


def multiplier(x: int, steps: int) -> float:
    """fms-fsdp's default schedule at 0-based step x of `steps`."""
    warmup = min(2000, steps // 20)
    warm = 1.0 if warmup == 0 else 1 - (1 - min(x, warmup) / warmup) ** 2
    return min(warm, MIN_RATIO + (1 - MIN_RATIO) / 2 * (1 + math.cos(math.pi * min(x, steps) / steps)))


def logits_by_document(model, inputs: torch.Tensor, eos: int) -> torch.Tensor:
    """The logits of packed lines whose documents do not see each other (--document_masking, positions
    counted along the line): each document (ending at `eos`) run through the model alone."""
    rows = []
    for line in inputs:
        ends = [i + 1 for i, t in enumerate(line.tolist()) if t == eos]
        bounds = [0, *[e for e in ends if e < len(line)], len(line)]
        pieces = [
            model(input_ids=line[None, a:z], position_ids=torch.arange(a, z)[None]).logits[0]
            for a, z in zip(bounds, bounds[1:])
        ]
        rows.append(torch.cat(pieces))
    return torch.stack(rows)


def train(
    source: Path, steps: int, batch: int, seq_length: int, vocab_size: int, seed: int, eos: Optional[int] = None
) -> list[tuple[float, float]]:
    """(loss, gradient norm before clipping) of each step of transformers' model trained from `source`;
    with `eos`, the documents of a line do not see each other."""
    from transformers import LlamaForCausalLM

    from fms_fsdp.data.dummy import DummyDataLoader

    torch.manual_seed(seed)
    model = LlamaForCausalLM.from_pretrained(str(source), torch_dtype=torch.float32).train()
    linear = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    decay = [p for p in model.parameters() if id(p) in linear]
    exempt = [p for p in model.parameters() if id(p) not in linear]
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": exempt, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda x: multiplier(x, steps))
    loader = DummyDataLoader(
        batch_size=batch, seq_length=seq_length, vocab_size=vocab_size, seed=seed, rank=0, world_size=1
    )
    batches = iter(loader)
    found = []
    for _ in range(steps):
        inputs, labels = next(batches)
        logits = model(input_ids=inputs).logits if eos is None else logits_by_document(model, inputs, eos)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        found.append((loss.item(), norm.item()))
    return found
