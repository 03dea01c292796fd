"""The optimizer's step alone, on one process: AdamW (fused, foreach) against Muon (--optimizer=muon:
the blocks' matrices orthogonalised by Newton-Schulz, AdamW for the rest) and AdamW with 8-bit states
(--optimizer_state_dtype=int8: torchao's AdamW8bit), over every parameter of a model variant, with
random gradients:

    python benchmarks/optimizer.py [--model_variant=tiny] [--device=cpu] [--repeat=5]

One `OPTIM variant=... optimizer=... ms=... state_mib=...` line per optimizer (the median step after one
warm-up, whose compile torchao's AdamW8bit pays; the bytes its state holds).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.options import parse_options  # noqa: E402
from fms_fsdp.flags import parse_args  # noqa: E402
from fms_fsdp.model.variants import build_model, get_model_config  # noqa: E402
from fms_fsdp.optim import build_optimizer  # noqa: E402
from fms_fsdp.settings import optimizer_of  # noqa: E402

OPTIONS = {"model_variant": "tiny", "device": "cpu", "repeat": "5"}
OPTIMIZERS = {
    "adamw_fused": ["--optimizer=adamw", "--optimizer_impl=fused"],
    "adamw_foreach": ["--optimizer=adamw", "--optimizer_impl=foreach"],
    "muon": ["--optimizer=muon"],
    "adamw_int8": ["--optimizer=adamw", "--optimizer_state_dtype=int8"],
}


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes of the optimizer's state tensors (a low-bit state's: its codes, scales and map)."""
    total = 0
    for state in optimizer.state.values():
        for t in state.values():
            if isinstance(t, torch.Tensor):
                inner = [getattr(t, n) for n in t.__tensor_flatten__()[0]] if hasattr(t, "__tensor_flatten__") else [t]
                total += sum(x.numel() * x.element_size() for x in inner)
    return total


def main(argv: list[str]) -> None:
    opts = parse_options(argv, OPTIONS, "benchmarks/optimizer.py")
    device, repeat = torch.device(opts["device"]), int(opts["repeat"])
    model = build_model(get_model_config(opts["model_variant"]), device)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    for name, flags in OPTIMIZERS.items():
        cfg = parse_args([f"--model_variant={opts['model_variant']}", "--use_dummy_dataset=True", *flags])
        optimizer = build_optimizer(model, optimizer_of(cfg), device)
        optimizer.step()  # the state is made at the first step
        times = []
        for _ in range(repeat):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append((time.perf_counter() - start) * 1e3)
        ms = sorted(times)[len(times) // 2]
        mib = state_bytes(optimizer) / 2**20
        print(f"OPTIM variant={opts['model_variant']} optimizer={name} ms={ms:.1f} state_mib={mib:.1f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
