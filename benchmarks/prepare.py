"""fms-prepare-data's speed: tokens/s of the process pool and of Ray with 1 and 2 workers on this machine.

    python benchmarks/prepare.py [--folder=/tmp/bench_prepare] [--files=16] [--docs_per_file=2000]
        [--runs=pool:1,pool:2,ray:1,ray:2] [--piece_bytes=4_000_000]

Writes a corpus once (JSON-lines files of pseudo-word documents, and a 4096-token byte-level BPE trained
on them: benchmarks/dataloader.py's text), then runs scripts/prepare_data.py on it once per entry of
--runs (engine:workers; Ray's a local cluster of that many CPUs, started and stopped by the command,
its start-up included), each into a fresh output, timed end to end as a user runs it. Prints one line
per run (seconds, input MB/s, tokens/s) and checks that every run wrote the same shards and counts.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.dataloader import write_text_data  # noqa: E402
from fms_fsdp.cli import tool  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def digest(data: Path) -> str:
    """One hash of every shard and the counts of a prepared <data>/bench."""
    h = hashlib.sha256()
    for path in sorted((data / "bench").glob("part-*.arrow")) + [data / "meta" / "counts_bench.csv"]:
        h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()[:16]


def one_run(raw: Path, out: Path, engine: str, workers: int, piece_bytes: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    args = [f"--input={raw / 'bench'}", f"--output={out / 'bench'}", f"--tokenizer={raw / 'tokenizer.json'}"]
    args += [f"--engine={engine}", f"--workers={workers}", f"--piece_bytes={piece_bytes}"]
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "scripts/prepare_data.py", *args], cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"error: {engine}:{workers} failed: {proc.stderr.strip().splitlines()[-1]}")
    ledger = json.loads((out / "bench" / ".done" / "complete.json").read_text())
    return {"seconds": seconds, "tokens": ledger["tokens"], "pieces": ledger["pieces"], "digest": digest(out)}


def main(
    folder: str = "/tmp/bench_prepare",
    files: int = 16,
    docs_per_file: int = 2000,
    runs: str = "pool:1,pool:2,ray:1,ray:2",
    piece_bytes: int = 4_000_000,
) -> None:
    """Time fms-prepare-data on each engine and worker count of --runs."""
    raw = Path(folder) / "raw"
    if not (raw / "tokenizer.json").exists():
        write_text_data(raw, files, docs_per_file, "jsonl")
    size = sum(p.stat().st_size for p in (raw / "bench").rglob("*.jsonl"))
    digests = set()
    for spec in runs.split(","):
        name, _, workers = spec.partition(":")
        engine = {"pool": "local", "ray": "ray"}[name]
        r = one_run(raw, Path(folder) / f"out-{name}-{workers}", engine, int(workers), piece_bytes)
        digests.add(r["digest"])
        print(
            f"engine={name} workers={workers} input_mb={size / 1e6:.1f} pieces={r['pieces']} "
            f"seconds={r['seconds']:.1f} mb_per_s={size / 1e6 / r['seconds']:.2f} "
            f"tokens_per_s={r['tokens'] / r['seconds'] / 1e3:.0f}k digest={r['digest']}",
            flush=True,
        )
    print(f"same_bytes={len(digests) == 1}")


if __name__ == "__main__":
    tool(main)
