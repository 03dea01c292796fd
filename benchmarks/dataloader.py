"""Data loader benchmark: throughput, private memory, state size and time to the first batch.

    python benchmarks/dataloader.py [--data_path=/tmp/bench_data] [--files=1000] [--docs_per_file=50]
        [--seconds=20] [--seq_length=4096] [--batch_size=2] [--num_workers=0]
        [--layout=arrow|parquet|hf|megatron|olmo|jsonl|jsonl.gz] [--compare=arrow,hf,megatron,olmo --rounds=10]

Writes a synthetic dataset once (fms-fsdp's Arrow layout by default, or --layout: write_data; document
lengths log-normal around 1,000 tokens, 50M tokens by default) unless it exists, then in one process: time to the first batch with
1024 logical shards, tokens/s after a warm-up, the peak of RssAnon (private memory; pages of the
memory-mapped shards are the kernel's file cache and not counted) of this process and of its loader
workers, sampled every 50 ms, and the pickled loader state size. Prints one line of key=value figures.

Raw text (jsonl, jsonl.gz): documents of pseudo-words, tokenized on the fly by a byte-level BPE of 4096
tokens trained on them (written once to <data_path>/tokenizer.json); the line also gives the
tokenizer's own single-thread speed on the same documents and the loader's share of it.
"""

from __future__ import annotations

import pickle
import struct
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fms_fsdp.cli import tool  # noqa: E402
from fms_fsdp.data import get_data_loader  # noqa: E402
from fms_fsdp.flags import make_config  # noqa: E402
from fms_fsdp.startup import facts  # noqa: E402
from fms_fsdp.storage import location  # noqa: E402


def rss_anon_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def rss_anon_children_mb() -> float:
    """RssAnon of this process's children (the loader workers), the largest."""
    pids = []
    for task in Path("/proc/self/task").iterdir():
        try:
            pids += (task / "children").read_text().split()
        except OSError:  # a thread that just ended
            continue
    sizes = []
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
        except OSError:
            continue
        sizes += [int(line.split()[1]) / 1024 for line in status if line.startswith("RssAnon:")]
    return max(sizes, default=0.0)


def pseudo_text(rng: np.random.Generator, words: list[str], n_words: int) -> str:
    """Zipf-distributed pseudo-words with punctuation: text a BPE tokenizer finds structure in."""
    picks = np.minimum(rng.zipf(1.2, n_words), len(words)) - 1
    return " ".join(words[k] + ("." if k % 17 == 0 else "") for k in picks)


def write_text_data(root: Path, files: int, docs_per_file: int, layout: str) -> None:
    """A dataset `bench` of JSON-lines files (gzipped for jsonl.gz) and a 4096-token byte-level BPE
    trained on them."""
    import gzip
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = np.random.default_rng(0)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    words = ["".join(rng.choice(letters, int(rng.integers(1, 10)))) for _ in range(20000)]
    sample = []
    for f in range(files):
        lengths = np.clip(rng.lognormal(np.log(800), 0.8, docs_per_file), 1, 20000).astype(int)
        docs = [pseudo_text(rng, words, int(n)) for n in lengths]
        data = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
        path = root / "bench" / f"shard_{f:05d}.{layout}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(gzip.compress(data, 6) if layout.endswith(".gz") else data)
        if len(sample) < 2000:
            sample += docs
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        sample,
        trainers.BpeTrainer(vocab_size=4096, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False),
    )
    tok.save(str(root / "tokenizer.json"))


def tokenizer_speed(root: Path, seconds: float) -> float:
    """Tokens/s of the tokenizer alone, one thread, one document at a time, on the first file's texts."""
    import json

    from fms_fsdp.data.text import encode, load_tokenizer, open_binary

    tok = load_tokenizer(str(root / "tokenizer.json"))
    first = sorted((root / "bench").iterdir())[0]
    with open_binary(first) as f:
        texts = [json.loads(line)["text"] for line in f]
    tokens, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for text in texts:
            tokens += len(encode(tok, text))
    return tokens / (time.perf_counter() - start)


def write_data(root: Path, files: int, docs_per_file: int, vocab: int, layout: str) -> None:
    """A dataset `bench` of `files` shards in one layout: arrow (fms-fsdp's, one record batch per
    document), parquet (one row per document, row groups of 500), hf (an Arrow stream with one row per
    document in record batches of 1,000, as `datasets` writes), megatron (<prefix>.bin/.idx, uint16, laid
    out as Megatron's IndexedDatasetBuilder writes them) or olmo (a raw uint16 token memmap, documents
    ending at eos 0)."""
    rng = np.random.default_rng(0)
    schema = pa.schema([("tokens", pa.uint32())])
    for f in range(files):
        path = root / "bench" / f"shard_{f:05d}"
        path.parent.mkdir(parents=True, exist_ok=True)
        lengths = np.clip(rng.lognormal(np.log(800), 0.8, docs_per_file), 1, 20000).astype(int)
        docs = [rng.integers(1, vocab, n, dtype=np.uint32) for n in lengths]
        if layout == "parquet":
            table = pa.table({"tokens": pa.array(docs, pa.list_(pa.uint32()))})
            pq.write_table(table, path.with_suffix(".parquet"), row_group_size=500)
        elif layout == "hf":
            table = pa.table({"input_ids": pa.array(docs, pa.list_(pa.int32()))})
            with pa.ipc.new_stream(str(path.with_suffix(".arrow")), table.schema) as w:
                for batch in table.to_batches(max_chunksize=1000):
                    w.write_batch(batch)
        elif layout == "megatron":
            write_megatron(path, docs)
        elif layout == "olmo":
            tokens = np.concatenate([np.append(d, 0) for d in docs]).astype(np.uint16)
            tokens.tofile(path.with_suffix(".npy"))
        else:
            with pa.ipc.new_file(str(path.with_suffix(".arrow")), schema) as w:
                for d in docs:
                    w.write_batch(pa.record_batch([pa.array(d)], schema=schema))


def write_megatron(prefix: Path, docs: list[np.ndarray]) -> None:
    """<prefix>.bin and .idx as Megatron's IndexedDatasetBuilder lays them out (uint16, dtype code 8; one
    sequence per document)."""
    lengths = np.array([len(d) for d in docs], np.int32)
    np.concatenate(docs).astype(np.uint16).tofile(prefix.with_suffix(".bin"))
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1].astype(np.int64) * 2)]).astype(np.int64)
    with prefix.with_suffix(".idx").open("wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, len(docs), len(docs) + 1))
        f.write(lengths.tobytes() + pointers.tobytes() + np.arange(len(docs) + 1, dtype=np.int64).tobytes())


def main(
    data_path: str = "/tmp/bench_data",
    files: int = 1000,
    docs_per_file: int = 50,
    seconds: float = 20.0,
    seq_length: int = 4096,
    batch_size: int = 2,
    num_workers: int = 0,
    logical_shards: int = 1024,
    layout: str = "arrow",
    upload_to: str = "",
    compare: str = "",
    rounds: int = 10,
) -> None:
    """--upload_to=s3://bucket/prefix: copy the dataset there (once) and read it from there.
    --compare=arrow,hf,megatron,olmo: the same documents in each layout under <data_path>_<layout>, read
    in one process in turns of --seconds each for --rounds rounds (a busy machine slows every layout
    alike): each layout's median tokens/s and its median ratio to the first's over the rounds."""
    if compare:
        compare_layouts(data_path, compare.split(","), files, docs_per_file, seconds, rounds, seq_length, batch_size)
        return
    root = Path(data_path)
    text = layout.startswith("jsonl")
    if not (root / "bench").is_dir():
        print(f"writing {files} shards to {root} ...", flush=True)
        if text:
            write_text_data(root, files, docs_per_file, layout)
        else:
            write_data(root, files, docs_per_file, 32000, layout)
    raw = dict(tokenizer_path=str(root / "tokenizer.json")) if text else {}
    if upload_to:
        remote = location(upload_to, "upload_to")
        if not (remote / "bench").is_dir():
            print(f"uploading {root / 'bench'} to {upload_to} ...", flush=True)
            remote.fs.put(str(root / "bench"), f"{remote.path}/", recursive=True)
        data_path = upload_to
    cfg = make_config(
        data_path=data_path,
        model_variant="llama2_7b",
        seq_length=seq_length,
        batch_size=batch_size,
        num_workers=num_workers,
        logical_shards=logical_shards,
        file_type="auto",
        data_cache_dir=str(root) + ".cache",  # counts and offsets: built at the first start, then read
        **raw,
    )
    peak, worker_peak, stop = [rss_anon_mb()], [0.0], threading.Event()

    def sample() -> None:
        while not stop.wait(0.05):
            peak.append(rss_anon_mb())
            worker_peak.append(rss_anon_children_mb())

    threading.Thread(target=sample, daemon=True).start()
    start = time.perf_counter()
    loader = get_data_loader(facts(cfg).settings.data, 0, 1)
    it = iter(loader)
    next(it)
    first_batch = time.perf_counter() - start
    warm_until = time.perf_counter() + min(5.0, seconds / 4)
    while time.perf_counter() < warm_until:
        next(it)
    batches, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        next(it)
        batches += 1
    elapsed = time.perf_counter() - t0
    stop.set()
    tokens_per_s = batches * batch_size * seq_length / elapsed
    state_kb = len(pickle.dumps(loader.state_dict())) / 1024
    figures = ""
    if text:
        del it  # the workers stop before the tokenizer is timed alone
        alone = tokenizer_speed(root, min(seconds, 10.0))
        figures = f" tokenizer_alone_tokens_per_s={alone / 1e3:.0f}k share={tokens_per_s / alone:.2f}"
    print(
        f"BENCH data={data_path} layout={layout} files={files} logical_shards={logical_shards} seq={seq_length} batch={batch_size} "
        f"workers={num_workers} first_batch_s={first_batch:.3f} tokens_per_s={tokens_per_s / 1e6:.3f}M "
        f"peak_rss_anon_mb={max(peak):.0f} worker_peak_rss_anon_mb={max(worker_peak):.0f} "
        f"state_kb={state_kb:.1f}{figures}",
        flush=True,
    )


def compare_layouts(
    data_path: str,
    layouts: list[str],
    files: int,
    docs_per_file: int,
    seconds: float,
    rounds: int,
    seq: int,
    batch: int,
) -> None:
    """See main's --compare."""
    iters, rates = {}, {name: [] for name in layouts}
    for name in layouts:
        root = Path(f"{data_path}_{name}")
        if not (root / "bench").is_dir():
            write_data(root, files, docs_per_file, 32000, name)
        cfg = make_config(
            data_path=str(root),
            model_variant="llama2_7b",
            seq_length=seq,
            batch_size=batch,
            num_workers=0,
            logical_shards=1024,
            data_cache_dir=str(root) + ".cache",
        )
        loader = get_data_loader(facts(cfg).settings.data, 0, 1)
        iters[name] = (loader, iter(loader))
        warm = time.perf_counter() + 2.0
        while time.perf_counter() < warm:
            next(iters[name][1])
    for _ in range(rounds):
        for name in layouts:
            batches, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                next(iters[name][1])
                batches += 1
            rates[name].append(batches * batch * seq / (time.perf_counter() - t0))
    first = np.array(rates[layouts[0]])
    for name in layouts:
        state_kb = len(pickle.dumps(iters[name][0].state_dict())) / 1024
        print(
            f"COMPARE layout={name} median_tokens_per_s={np.median(rates[name]) / 1e6:.2f}M "
            f"median_ratio_to_{layouts[0]}={np.median(np.array(rates[name]) / first):.2f} state_kb={state_kb:.1f}",
            flush=True,
        )


if __name__ == "__main__":
    tool(main)
