"""The loss through the output head alone (fms_fsdp/model/loss.py), at a model's head shapes: forward and
backward seconds and peak memory by chunk size, then the head gradient's accumulation both ways (a bf16
[V, D] product added into the fp32 sum, as model/loss.py does today, or one addmm with out_dtype=float32,
which CUDA has), to choose loss.CUDA_CHUNK_BYTES and that accumulation by measurement:

    python benchmarks/loss.py [--model_variant=llama3_1.8b_4k] [--tokens=8192] [--chunk_mib=128,256,512,1024,2048]
        [--device=cuda] [--dtype=bf16] [--repeat=10]

One `LOSS chunk_mib=... ms=... peak_gib=...` line per chunk size and one `GRAD_W variant=... ms=...`
line per accumulation (on CPU peak_gib is n/a, and the out_dtype variant is not there).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.options import parse_options  # noqa: E402
from fms_fsdp.model.loss import chunk_tokens, chunked_cross_entropy  # noqa: E402
from fms_fsdp.model.variants import get_model_config  # noqa: E402

OPTIONS = {
    "model_variant": "llama3_1.8b_4k",
    "tokens": "8192",
    "chunk_mib": "128,256,512,1024,2048",
    "device": "cuda",
    "dtype": "bf16",
    "repeat": "10",
}


def timed(fn: Callable[[], object], device: torch.device, repeat: int) -> float:
    """Median milliseconds of `fn` over `repeat` runs, after one warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def main(argv: list[str]) -> None:
    opts = parse_options(argv, OPTIONS, "benchmarks/loss.py")
    device, repeat, n = torch.device(opts["device"]), int(opts["repeat"]), int(opts["tokens"])
    dtype = torch.bfloat16 if opts["dtype"] == "bf16" else torch.float32
    config = get_model_config(opts["model_variant"])
    vocab, dim = config.src_vocab_size, config.emb_dim
    gen = torch.Generator(device).manual_seed(0)
    hidden = torch.randn(n, dim, device=device, dtype=dtype, generator=gen).requires_grad_()
    weight = (torch.randn(vocab, dim, device=device, dtype=dtype, generator=gen) * dim**-0.5).requires_grad_()
    labels = torch.randint(0, vocab, (n,), device=device, generator=gen)

    for mib in (int(m) for m in opts["chunk_mib"].split(",")):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0

        def step(max_bytes: int = mib << 20) -> None:
            chunked_cross_entropy(hidden, weight, labels, max_chunk_bytes=max_bytes)[0].backward()
            hidden.grad = weight.grad = None

        ms = timed(step, device, repeat)
        peak = f"{(torch.cuda.max_memory_allocated(device) - base) / 2**30:.2f}" if device.type == "cuda" else "n/a"
        chunk = chunk_tokens(n, vocab, mib << 20)
        print(
            f"LOSS variant={opts['model_variant']} tokens={n} chunk_mib={mib} chunk_tokens={chunk} ms={ms:.2f} peak_gib={peak}"
        )

    grad = torch.randn(chunk_tokens(n, vocab, 1 << 30), vocab, device=device, dtype=dtype, generator=gen)
    h = hidden.detach()[: grad.shape[0]]
    total = torch.zeros(vocab, dim, device=device, dtype=torch.float32)
    variants: dict[str, Callable[[], object]] = {"product_then_add": lambda: total.add_(grad.t() @ h)}
    if device.type == "cuda" and dtype == torch.bfloat16:  # a new fp32 sum, as grad_w = torch.addmm(grad_w, ...) makes
        variants["addmm_out_dtype_fp32"] = lambda: torch.addmm(total, grad.t(), h, out_dtype=torch.float32)
    for name, fn in variants.items():
        print(f"GRAD_W variant={name} rows={grad.shape[0]} ms={timed(fn, device, repeat):.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
