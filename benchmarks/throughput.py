"""Training throughput on synthetic data: tokens/s/GPU, achieved TFLOP/s and MFU for a variant.

    torchrun --nproc_per_node=1 benchmarks/throughput.py --model_variant=llama3_1.8b_4k \
        --batch_size=2 --seq_length=4096 --use_torch_compile=True --num_steps=30 [--bench_skip=10]

Takes every training flag (use_dummy_dataset is forced on, report_interval to 1). The first
--bench_skip steps (compilation, allocator warm-up) are left out of the figures; the rest are
summarised by their median. Rank 0 prints one line of key=value figures.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from fms_fsdp.config import parse_args  # noqa: E402
from fms_fsdp.errors import ConfigError  # noqa: E402
from fms_fsdp.models import flops_per_token, get_model_config  # noqa: E402
from fms_fsdp.train import check_config, run  # noqa: E402


def main(argv: list[str]) -> None:
    skip = 5
    flags = []
    for arg in argv:
        if arg.startswith("--bench_skip="):
            skip = int(arg.split("=", 1)[1])
        else:
            flags.append(arg)
    try:
        cfg = parse_args(["--use_dummy_dataset=True", "--ckpt_save_path=output/bench", *flags, "--report_interval=1"])
        check_config(cfg)
    except ConfigError as e:
        raise SystemExit(f"error: {e}")
    if cfg.num_steps <= skip:
        raise SystemExit(f"error: --num_steps={cfg.num_steps} must exceed --bench_skip={skip}")
    records = run(cfg)[skip:]
    if os.environ.get("RANK", "0") != "0":
        return
    tps = statistics.median(r["tokens_per_sec_per_gpu"] for r in records)
    fpt = flops_per_token(get_model_config(cfg.model_variant, cfg.vocab_size), cfg.seq_length)
    figures = {
        "variant": cfg.model_variant,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() and cfg.device != "cpu" else "cpu",
        "torch": torch.__version__,
        "world": int(os.environ.get("WORLD_SIZE", "1")),
        "batch": cfg.batch_size,
        "seq": cfg.seq_length,
        "compile": cfg.use_torch_compile,
        "ac": cfg.selective_checkpointing if cfg.fsdp_activation_checkpointing else "off",
        "bf16": cfg.mixed_precision,
        "step_time_s": round(statistics.median(r["step_time"] for r in records), 4),
        "tokens_per_sec_per_gpu": round(tps, 1),
        "achieved_tflops": round(tps * fpt / 1e12, 4),
        "mfu": round(statistics.median(r["mfu"] for r in records), 4) if "mfu" in records[0] else "n/a",
        "peak_mem_gb": round(max(r.get("peak_memory_reserved_gb", r.get("max_rss_gb", 0)) for r in records), 2),
    }
    print("BENCH " + " ".join(f"{k}={v}" for k, v in figures.items()), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
