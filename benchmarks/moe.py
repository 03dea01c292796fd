"""The cost of a mixture of experts against a dense model of equal active parameters, one process:
forward and backward of a micro-batch, median over steps, fp32 on the CPU (bf16 on a GPU).

    python benchmarks/moe.py [--experts=4,8] [--top_k=2] [--batch_size=4] [--seq_length=256] [--steps=10]
        [--emb_dim=256] [--kernels=loop,grouped]

The dense model is tiny (4 blocks, --emb_dim wide) with its feed-forward layer top_k experts wide, so
both run the same matmul FLOPs per token; what the sparse one adds is the router, the grouping of tokens
by expert and the experts' matmuls: one per expert (loop) or one grouped GEMM per weight (grouped,
--moe_kernel), with a host sync per layer for the experts' sizes.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.options import parse_options  # noqa: E402
from fms_fsdp.model.initialization import init_weights  # noqa: E402
from fms_fsdp.model.variants import build_model, flops_per_token, get_model_config  # noqa: E402

OPTIONS = {
    "experts": "4,8",
    "top_k": "2",
    "batch_size": "4",
    "seq_length": "256",
    "steps": "10",
    "emb_dim": "256",
    "kernels": "loop,grouped",
}


def _step_seconds(model: torch.nn.Module, tokens: torch.Tensor, steps: int) -> float:
    times = []
    for _ in range(steps + 2):  # two warm-up steps
        start = time.perf_counter()
        model(tokens, labels=tokens).backward()
        if tokens.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def main(argv: list[str]) -> None:
    opts = parse_options(argv, OPTIONS, "benchmarks/moe.py")
    batch_size, seq_length, steps, top_k = (int(opts[k]) for k in ("batch_size", "seq_length", "steps", "top_k"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_default_dtype(torch.bfloat16 if device.type == "cuda" else torch.float32)
    tokens = torch.randint(0, 4096, (batch_size, seq_length), device=device)
    width = {"emb_dim": int(opts["emb_dim"]), "nheads": max(4, int(opts["emb_dim"]) // 128)}
    dense = get_model_config("tiny", seq_length=seq_length).updated(hidden_grow_factor=float(top_k), **width)
    configs = {f"dense, ffn {top_k} experts wide": (dense, "")}
    for n in (int(e) for e in opts["experts"].split(",")):
        moe = get_model_config("tiny_moe", seq_length=seq_length, moe={"moe_experts": n, "moe_top_k": top_k})
        for kernel in opts["kernels"].split(","):
            configs[f"{n} experts, top-{top_k}, {kernel}"] = (moe.updated(**width), kernel)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(
        f"{name}, torch {torch.__version__}, micro-batch {batch_size} x {seq_length} tokens, width {width['emb_dim']}"
    )
    base = None
    for name, (config, kernel) in configs.items():
        model = build_model(config, device)
        init_weights(model, 0)
        if kernel:
            model.routing.kernel = kernel
        seconds = _step_seconds(model, tokens, steps)
        base = base or seconds
        flops = flops_per_token(config, seq_length)
        print(
            f"{name:32s} step {seconds * 1e3:8.1f} ms  {seconds / base:5.2f}x  FLOPs/token {flops / 1e6:8.1f} M"
            f"  {flops * tokens.numel() / seconds / 1e12:7.2f} TFLOP/s"
        )
        del model


if __name__ == "__main__":
    main(sys.argv[1:])
