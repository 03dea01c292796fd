"""The optimizer's step alone, on one process: AdamW (fused, foreach) against Muon (--optimizer=muon:
the blocks' matrices orthogonalised by Newton-Schulz, AdamW for the rest), over every parameter of a
model variant, with random gradients:

    python benchmarks/optimizer.py [--model_variant=tiny] [--device=cpu] [--repeat=5]

One `OPTIM variant=... optimizer=... ms=...` line per optimizer (the median step after one warm-up).
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
}


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
        print(f"OPTIM variant={opts['model_variant']} optimizer={name} ms={ms:.1f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
