"""Context parallelism's memory: one long line trained on one rank (C=1) against the same line split
over C ranks (--context_parallel_size=C), each launch through torchrun:

    python benchmarks/context_parallel.py [--model_variant=tiny] [--seq_length=32768] [--cp=2] [--steps=3]
        [--device=cpu] [--document_masking=False] [--cp_attention=allgather]

One `CP variant=... seq=... cp=... max_rss_gb=... peak_memory_gb=... step_s=... loss=...` line per run
(the peak resident memory per rank on the CPU, the peak allocated GPU memory on CUDA), then the ratio
of C's peak to C=1's. Both runs get MALLOC_MMAP_THRESHOLD_=131072 (unless set): glibc then maps large
blocks and returns them when freed, so the resident peak follows the live tensors, not the heap's
high-water mark.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.options import parse_options  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = {
    "model_variant": "tiny",
    "seq_length": "32768",
    "cp": "2",
    "steps": "3",
    "device": "cpu",
    "document_masking": "False",
    "cp_attention": "allgather",
}


def run(opts: dict[str, str], cp: int, out: Path) -> dict:
    """One launch of `cp` ranks (C=cp) training one line per step; its last metrics record."""
    flags = [
        f"--model_variant={opts['model_variant']}",
        f"--device={opts['device']}",
        f"--seq_length={opts['seq_length']}",
        f"--num_steps={opts['steps']}",
        f"--document_masking={opts['document_masking']}",
        f"--context_parallel_size={cp}",
        f"--cp_attention={opts['cp_attention']}",
        "--use_dummy_dataset=True",
        "--use_torch_compile=False",
        f"--mixed_precision={opts['device'] != 'cpu'}",
        "--batch_size=1",
        "--vocab_size=4096",
        "--checkpoint_interval=0",
        "--report_interval=1",
        f"--ckpt_save_path={out}",
    ]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cp}"]
    env = {
        "MALLOC_MMAP_THRESHOLD_": "131072",
        **os.environ,
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // cp)),
    }
    proc = subprocess.run([*cmd, str(ROOT / "main_training.py"), *flags], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: the C={cp} run failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]


def main(argv: list[str]) -> None:
    opts = parse_options(argv, OPTIONS, "benchmarks/context_parallel.py")
    peaks = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cp in (1, int(opts["cp"])):
            r = run(opts, cp, Path(tmp) / f"cp{cp}")
            peak = r.get("peak_memory_allocated_gb", r.get("max_rss_gb", 0.0))
            peaks[cp] = peak
            print(
                f"CP variant={opts['model_variant']} seq={opts['seq_length']} cp={cp} "
                f"max_rss_gb={r.get('max_rss_gb', 0.0):.3f} peak_memory_gb={r.get('peak_memory_allocated_gb', 0.0):.3f} "
                f"step_s={r['step_time']:.3f} loss={r['loss']:.4f}",
                flush=True,
            )
    cp = int(opts["cp"])
    print(f"CP ratio cp={cp}/cp=1 peak={peaks[cp] / peaks[1]:.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
