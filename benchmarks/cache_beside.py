"""The first step on a raw corpus with --cache_dir: trained while the cache is built (--cache_build=beside)
against built first (--cache_build=first), 2 ranks on this machine, the process pool, a byte-level BPE.

    python benchmarks/cache_beside.py [--folder=/tmp/bench_cache] [--gigabytes=2] [--steps=30] [--runs=beside,first,built]
        [--device=cpu] [--ranks=2] [--variant=tiny] [--seq_length=512] [--batch_size=4] [--cache_workers=]

Writes the corpus once (JSON-lines files of pseudo-word documents and a 4096-token byte-level BPE trained
on them, as benchmarks/dataloader.py does; docs/data.md shows the same for your text). Then, each under
torchrun with --ranks ranks of --variant (on --device: fp32 on the CPU, bf16 on CUDA), timed from the launch:
1. beside, from an empty cache: the seconds to the first step, the median step while the cache is
   built and the share read from it; stopped (SIGTERM) after --steps steps, as a preempted run is;
2. first, from an empty cache: the seconds to the first step (the whole build before it);
3. beside again over the complete cache of 2: the median step once the cache is built.
Prints one line per run and, with all three, a summary. --runs picks some (built needs first's cache).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.dataloader import write_text_data  # noqa: E402
from benchmarks.options import parse_options  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = {
    "folder": "/tmp/bench_cache",
    "gigabytes": "2",
    "steps": "30",
    "runs": "beside,first,built",
    "device": "cpu",
    "ranks": "2",
    "variant": "tiny",
    "seq_length": "512",
    "batch_size": "4",
    "cache_workers": "",  # empty: the package's default (the node's CPUs less one per rank)
}
DOCS_PER_FILE = 8_000  # about 60 MB of JSON lines each (documents of about 7.5 kB)


def corpus(folder: Path, gigabytes: float) -> Path:
    """The corpus (written once): folder/raw/bench/*.jsonl and folder/raw/tokenizer.json."""
    raw = folder / "raw"
    if not (raw / "tokenizer.json").is_file():
        shutil.rmtree(raw, ignore_errors=True)
        files = max(1, round(gigabytes * 2**30 / (DOCS_PER_FILE * 7_550)))
        write_text_data(raw, files, DOCS_PER_FILE, "jsonl")
    size = sum(p.stat().st_size for p in (raw / "bench").iterdir())
    print(f"corpus: {size / 2**30:.2f} GiB in {len(list((raw / 'bench').iterdir()))} files", flush=True)
    return raw


def run_flags(opts: dict[str, str]) -> list[str]:
    """The model, device and batch of every run of the benchmark."""
    flags = [f"--model_variant={opts['variant']}", f"--device={opts['device']}", "--use_torch_compile=False"]
    flags += [f"--mixed_precision={opts['device'] == 'cuda'}", "--vocab_size=4096"]
    flags += [f"--seq_length={opts['seq_length']}", f"--batch_size={opts['batch_size']}"]
    return flags + ([f"--cache_workers={opts['cache_workers']}"] if opts["cache_workers"] else [])


def train(folder: Path, name: str, raw: Path, cache: Path, steps: int, opts: dict[str, str], *flags: str) -> dict:
    """One run under torchrun: seconds from the launch to step 1 and to its end, its records."""
    out = folder / name
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={opts['ranks']}"]
    command += ["main_training.py", *run_flags(opts)]
    command += [f"--data_path={raw}", f"--tokenizer_path={raw / 'tokenizer.json'}", f"--cache_dir={cache}"]
    command += [f"--ckpt_save_path={out}", "--report_interval=1", "--checkpoint_interval=0", "--num_steps=100000"]
    command += list(flags)
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    first = stop_sent = None
    for line in proc.stdout:
        if line.startswith("step 1 |") and first is None:
            first = time.perf_counter() - start
        if line.startswith(f"step {steps} |") and stop_sent is None:
            stop_sent = time.perf_counter() - start
            proc.send_signal(signal.SIGTERM)  # torchrun passes it on: the ranks stop as a preempted run does
        if line.startswith(("note:", "warning:", "error", "stopping")):
            print(f"  [{name}] {line.rstrip()}", flush=True)
    proc.wait()
    found = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {"first_step_s": first, "records": [r for r in found if "loss" in r], "status": proc.returncode}


def summary(name: str, run: dict) -> dict:
    steps = run["records"][2:]  # the first steps warm up
    result = {
        "run": name,
        "first_step_s": round(run["first_step_s"] or float("nan"), 1),
        "median_step_s": round(statistics.median(r["step_time"] for r in steps), 3) if steps else None,
        "data_wait": round(statistics.median(r["data_wait"] for r in steps), 3) if steps else None,
    }
    if steps and "documents_from_cache" in steps[-1]:
        cached = sum(r["documents_from_cache"] for r in steps)
        result["read_from_cache"] = round(cached / max(1, cached + sum(r["documents_tokenized"] for r in steps)), 3)
        result["cache_built_at_stop"] = round(steps[-1].get("cache_built", 1.0), 3)
    print("CACHE " + " ".join(f"{k}={v}" for k, v in result.items()), flush=True)
    return result


def main(argv: list[str]) -> None:
    opts = parse_options(argv, OPTIONS, "cache_beside")
    folder, steps = Path(opts["folder"]), int(opts["steps"])
    raw, runs = corpus(folder, float(opts["gigabytes"])), opts["runs"].split(",")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    found = {}
    if "beside" in runs:
        shutil.rmtree(folder / "cache_beside", ignore_errors=True)
        found["beside"] = summary("beside", train(folder, "beside", raw, folder / "cache_beside", steps, opts))
    if "first" in runs:
        shutil.rmtree(folder / "cache_first", ignore_errors=True)
        first = train(folder, "first", raw, folder / "cache_first", 5, opts, "--cache_build=first")
        found["first"] = summary("first", first)
    if "built" in runs:
        found["built"] = summary("built", train(folder, "built", raw, folder / "cache_first", steps, opts))
    if len(found) < 3:
        return
    beside, first, built = found["beside"], found["first"], found["built"]
    print(
        f"first step: {beside['first_step_s']} s trained while building, {first['first_step_s']} s built first; "
        f"step {beside['median_step_s']} s during the build, {built['median_step_s']} s after it"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
