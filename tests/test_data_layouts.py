"""Data as other projects write it, written by their own code: Hugging Face `datasets` (save_to_disk
folders of several shards, cache files: Arrow streams), OLMo's raw token memmaps and np.save arrays,
Dolma's metadata, and Megatron-Core's IndexedDatasetBuilder (.bin/.idx: importing megatron-core alone
takes about 20 s here, so the slow tier writes them and checks that tests/data/megatron, which the other
tests read, is what it writes). Every layout (and the package's Arrow shards, raw text on the fly and
through --cache_dir) read with its exact tokens, every document exactly once in an epoch of 2 ranks,
exact resume and 2 -> 3 rescaling with every layout in one run, the caches, and each bad file as one
line at start-up."""

import gzip
import pickle
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from fms_fsdp.data import DataError
from fms_fsdp.data.file_reader import Options
from fms_fsdp.data.inspection import inspect_data
from fms_fsdp.data.shards import CACHED_COUNTS, Layout, dataset_sources, scan

from conftest import data_loader
from test_data import EOS, cfg, consumed_from_states, doc_starts, lines_of, make_docs, take, write_dataset

LAYOUTS = ("hf_save_to_disk", "hf_cache", "olmo", "olmo_uint32", "olmo_flag", "dolma", "npy")
# and the package's own Arrow shards, raw text tokenized on the fly or once into --cache_dir
EPOCH_LAYOUTS = (*LAYOUTS, "megatron", "arrow", "jsonl", "jsonl_cache_dir", "jsonl_cache_beside")
MEGATRON = Path(__file__).parent / "data" / "megatron"  # MEGATRON_DOCS as megatron-core writes them (uint16)
MEGATRON_DOCS = make_docs(500, 60, 7)


def write_megatron(folder: Path) -> None:
    shutil.copytree(MEGATRON, folder)


def write_hf(folder: Path, docs: list[list[int]], shards: int = 3) -> None:
    """datasets' save_to_disk: data-0000i-of-0000n.arrow streams, an input_ids column beside others."""
    from datasets import Dataset

    masks = [[1] * len(d) for d in docs]
    Dataset.from_dict({"input_ids": docs, "attention_mask": masks, "id": list(range(len(docs)))}).save_to_disk(
        str(folder), num_shards=shards
    )


def write_hf_cache(folder: Path, docs: list[list[int]]) -> None:
    """A datasets cache file, as .map() writes one (its only list-of-integers column is `ids`)."""
    from datasets import Dataset

    folder.mkdir(parents=True, exist_ok=True)
    Dataset.from_dict({"x": docs}).map(
        lambda b: {"ids": b["x"]}, batched=True, remove_columns=["x"], cache_file_name=str(folder / "cache-1a2b.arrow")
    )


def write_olmo(folder: Path, docs: list[list[int]], dtype=np.uint16, files: int = 2, metadata: bool = False) -> None:
    """OLMo's token files: raw memmaps (np.memmap mode w+) of documents each ending with eos; with
    `metadata`, no eos but Dolma's <name>.csv.gz of start,end,id,src,loc rows beside each."""
    folder.mkdir(parents=True, exist_ok=True)
    for f, part in enumerate(np.array_split(np.arange(len(docs)), files)):
        chunk = [docs[i] + ([] if metadata else [EOS]) for i in part]
        tokens = np.concatenate([np.array(d) for d in chunk])
        out = np.memmap(folder / f"part-{f}-00000.npy", mode="w+", dtype=dtype, shape=(len(tokens),))
        out[:] = tokens
        out.flush()
        del out
        if metadata:
            ends = np.cumsum([len(d) for d in chunk])
            rows = [f"{e - len(d)},{e},doc{k},s3://src/{f}.json.gz,{k}" for k, (d, e) in enumerate(zip(chunk, ends))]
            (folder / f"part-{f}-00000.csv.gz").write_bytes(gzip.compress("\n".join(rows).encode() + b"\n"))


def write_npy(folder: Path, docs: list[list[int]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "tokens.npy", np.concatenate([np.array(d + [EOS], np.uint32) for d in docs]))


def write_layout(root: Path, name: str, docs: list[list[int]], layout: str) -> dict:
    """Write docs as `layout` (megatron: the fixture, whose documents are MEGATRON_DOCS); returns the
    flags it needs."""
    folder = root / name
    if layout == "hf_save_to_disk":
        write_hf(folder, docs)
    elif layout == "hf_cache":
        write_hf_cache(folder, docs)
    elif layout == "npy":
        write_npy(folder, docs)
    elif layout == "olmo_uint32":  # a vocabulary beyond uint16: OLMo's rule reads uint32
        write_olmo(folder, docs, np.uint32)
        return {"vocab_size": 70000}
    elif layout == "olmo_flag":
        write_olmo(folder, docs, np.uint32)
        return {"token_dtype": "uint32"}
    elif layout == "megatron":
        assert docs == MEGATRON_DOCS
        write_megatron(folder)
    elif layout in ("arrow", "jsonl"):  # the package's own shards; raw text tokenized on the fly
        write_dataset(root, name, docs, layout, files=2)  # files in the documents' order
    elif layout == "jsonl_cache_dir":  # raw text tokenized once into --cache_dir, then read from there
        write_dataset(root, name, docs, "jsonl", files=2)
        return {"cache_dir": str(root.with_name(root.name + ".cache")), "cache_build": "first"}
    elif layout == "jsonl_cache_beside":  # raw text read while --cache_dir is built, from there where it is
        write_dataset(root, name, docs, "jsonl", files=2)
        return {"cache_dir": str(root.with_name(root.name + ".cache"))}
    else:
        write_olmo(folder, docs, metadata=layout == "dolma")
    return {}


def read_all(loader) -> list[list[int]]:
    """Every document of the loader's first dataset, in file order, through its readers."""
    ds = loader.datasets[0]
    return [ds.read(f, j).tolist() for f, e in enumerate(ds.entries) for j in range(e.documents)]


def epochs(loader, n: int, cap: int) -> list[tuple[list[list[int]], int]]:
    """A reader's first n epochs, each as the documents (their tokens) it gives before it gives one of
    them again, and that document, which starts the next: its epochs when it neither drops nor
    repeats a document. Read batch by batch (a document's first token names it); more than `cap`
    tokens without n of them fail."""
    it, stream = iter(loader), np.empty(0, np.int64)
    while len(stream) <= cap:
        stream = np.concatenate([stream, lines_of([next(it)]).reshape(-1)])
        starts = np.flatnonzero((stream != EOS) & np.concatenate([[True], stream[:-1] == EOS])).tolist()
        out, first, seen = [], 0, set()
        for i in starts:
            if int(stream[i]) in seen:  # the end of an epoch
                docs = np.split(stream[first:i], np.flatnonzero(stream[first:i] == EOS) + 1)[:-1]
                out.append(([d[:-1].tolist() for d in docs], int(stream[i])))
                if len(out) == n:
                    return out
                first, seen = i, set()
            seen.add(int(stream[i]))
    raise AssertionError(f"{len(stream)} tokens and not {n} epochs: more than every document")


@pytest.mark.parametrize("layout", EPOCH_LAYOUTS)
def test_every_document_exactly_once_in_an_epoch_of_two_ranks(tmp_path, layout, request):
    """Both ranks' first epochs (what each reads before it reads a document again) together are the
    documents, each exactly once with its exact tokens: none dropped, none twice, none read by both
    ranks; and each rank's second epoch reads the documents of its first (none repeated at the turn)."""
    docs = MEGATRON_DOCS if layout == "megatron" else make_docs(10, 48, seed=3)
    flags = write_layout(tmp_path, "web", docs, layout)
    c = cfg(tmp_path, seq_length=31, **flags)
    loaders = [data_loader(c, rank, 2) for rank in (0, 1)]
    request.addfinalizer(loaders[0].close)  # jsonl_cache_beside: rank 0's build of the cache, not left running
    ends_with_eos = layout.startswith("olmo") or layout == "npy"
    assert read_all(loaders[0]) == [d + [EOS] if ends_with_eos else d for d in docs]
    read_in = flags["cache_dir"] if flags.get("cache_build") == "first" else str(tmp_path)  # jsonl_cache_dir: the cache
    assert str(loaders[0].datasets[0].root) == read_in
    ranks = [epochs(loader, 2, 2 * sum(len(d) + 1 for d in docs)) for loader in loaders]
    (rank0, again0), (rank1, again1) = (first for first, _ in ranks)  # each rank's first epoch
    read = Counter(d[0] if d else None for d in rank0 + rank1)  # a document's first token names it
    dropped, twice = sorted({d[0] for d in docs} - set(read)), sorted(k for k, n in read.items() if n > 1)
    assert sorted(rank0 + rank1) == sorted(docs), (
        f"documents missing: {dropped}, read by both ranks: {twice}; the ranks read {len(rank0)} and "
        f"{len(rank1)} of {len(docs)} documents before reading one again ({again0} and {again1})"
    )
    assert min(len(rank0), len(rank1)) > len(docs) / 4  # the ranks share the documents
    for rank, ((first, _), (second, again)) in enumerate(ranks):
        assert sorted(second) == sorted(first), (
            f"rank {rank} read {len(second)} documents in its second epoch before reading {again} again, "
            f"not the {len(first)} of its first"
        )


def mixed(root: Path, dtype=np.uint16) -> dict:
    """One run's datasets, one per layout (OLMo's and Dolma's headerless arrays of `dtype`)."""
    write_dataset(root, "fms", make_docs(10, 60, 1))
    write_hf(root / "hf", make_docs(1000, 60, 2))
    write_olmo(root / "olmo", make_docs(2000, 60, 3), dtype)
    write_olmo(root / "dolma", make_docs(3000, 60, 4), dtype, metadata=True)
    write_npy(root / "npy", make_docs(4000, 60, 5))
    write_megatron(root / "megatron")
    return dict(logical_shards=6, batch_size=4, seq_length=32)


@pytest.mark.parametrize("arrays", ["uint16", "uint32", "token_dtype"])
def test_every_layout_in_one_run_resumes_and_rescales_exactly(tmp_path, arrays):
    """Every layout in one run, with a mixture schedule (dolma and hf rest from step 2) and worker
    processes for the resume. A run's headerless token arrays have one dtype: uint16 by OLMo's rule for
    its vocabulary, with raw text tokenized on the fly; uint32 by that rule (olmo_uint32), with raw text
    read from a --cache_dir built first; or uint32 by --token_dtype (olmo_flag), with raw text read while
    its --cache_dir is built beside the run."""
    dtype = np.dtype("uint16" if arrays == "uint16" else "uint32")
    flags = mixed(tmp_path, dtype)
    write_hf_cache(tmp_path / "hf_cache", make_docs(1500, 60, 6))
    write_dataset(tmp_path, "text", make_docs(3500, 60, 7), "jsonl")  # with tmp_path/tokenizer.json
    cache_dir = str(tmp_path.with_name(tmp_path.name + ".cache"))
    if arrays == "uint32":
        flags.update(vocab_size=70000, cache_dir=cache_dir, cache_build="first")
    elif arrays == "token_dtype":
        flags.update(token_dtype="uint32", cache_dir=cache_dir, cache_build="beside")

    c = cfg(tmp_path, **flags, weights_schedule="0:1,1,1,1,1,1,1,1;2:0,1,0,1,1,1,1,1", num_workers=2)
    full, _ = batches_of(c, 0, 2, 9)
    _, state = batches_of(c, 0, 2, 4)
    assert all(torch.equal(x1, x2) for (x1, _), (x2, _) in zip(full[4:], batches_of(c, 0, 2, 5, state)[0]))
    late = lines_of(full[2:]).reshape(-1)
    assert not np.isin(late, np.arange(1000, 1060)).any() and not np.isin(late, np.arange(3000, 3060)).any()
    c = cfg(tmp_path, **flags)
    loader = data_loader(c, 0, 1)  # the weights' order; raw text from --cache_dir, arrays read as `arrays`
    loader.close()  # its builder (beside), if any: the loaders below build the cache one after the other
    assert [ds.name for ds in loader.datasets] == ["dolma", "fms", "hf", "hf_cache", "megatron", "npy", "olmo", "text"]
    assert [ds.file(0).dtype for ds in loader.datasets[0::6]] == [dtype] * 2  # dolma, olmo
    read_in = cache_dir if arrays == "uint32" else str(tmp_path)  # beside: raw text's own files, then the cache
    assert str(loader.datasets[-1].root) == read_in
    seen: Counter = Counter()
    old = []
    for rank in range(2):
        found, state = batches_of(c, rank, 2, 5)
        seen.update(lines_of(found).reshape(-1).tolist())
        old.append(state)
    new = []
    for rank in range(3):
        found, state = batches_of(c, rank, 3, 4, old)
        seen.update(lines_of(found).reshape(-1).tolist())
        new.append(state)
    del seen[EOS]
    assert seen == consumed_from_states(loader, new)
    # every layout was read (ids from 10, 500, 1000, 1500, 2000, 3000, 3500, 4000)
    assert {t // 500 for t in seen} == {0, 1, 2, 3, 4, 6, 7, 8}


def batches_of(c, rank: int, ranks: int, n: int, state=None) -> tuple[list, object]:
    """A loader's first `n` batches (from `state`, given) and its state after them; its builder of
    --cache_dir (beside), if any, ended before the next loader's starts."""
    loader = data_loader(c, rank, ranks)
    try:
        if state is not None:
            loader.load_state_dict(pickle.loads(pickle.dumps(state)))
        return take(loader, n), loader.state_dict()
    finally:
        loader.close()


def test_eval_datasets_of_every_layout_give_the_lines_of_the_same_documents(tmp_path):
    from fms_fsdp.evaluation.evaluate import eval_lines
    from fms_fsdp.settings import packing_of

    docs = make_docs(10, 30, 9)
    write_dataset(tmp_path, "fms", docs, files=2)
    layouts = ("hf_save_to_disk", "olmo", "dolma", "npy")
    for layout in layouts:
        write_layout(tmp_path, layout, docs, layout)
    write_dataset(tmp_path, "fms_of_megatron", MEGATRON_DOCS, files=2)
    write_megatron(tmp_path / "megatron")
    c = cfg(tmp_path)
    lines = {ds.name: eval_lines(ds, packing_of(c, 4096), None) for ds in data_loader(c, 0, 1).datasets}
    assert len(lines) == 7 and all(np.array_equal(lines["fms"], lines[layout]) for layout in layouts)
    assert np.array_equal(lines["fms_of_megatron"], lines["megatron"])


def test_offsets_are_cached_once_the_column_is_said_once_and_inspect_reads_every_layout(tmp_path, capsys):
    flags = mixed(tmp_path)
    write_hf(tmp_path / "hf2", make_docs(5000, 30, 6), shards=2)
    data_loader(cfg(tmp_path, **flags), 0, 1)
    out = capsys.readouterr().out
    assert out.count("no 'tokens' column; reading its list-of-integers column 'input_ids'") == 2  # once a dataset
    index = list(tmp_path.with_name(tmp_path.name + ".run").glob("data_cache/*/index/*.npy"))
    assert len(index) == 3 + 2 + 2 + 2 + 1  # the streams' batch offsets, the token arrays' documents
    mtimes = {p: p.stat().st_mtime_ns for p in index}
    data_loader(cfg(tmp_path, **flags), 0, 1)
    assert {p: p.stat().st_mtime_ns for p in index} == mtimes and not (tmp_path / "meta").exists()
    only = data_loader(cfg(tmp_path, file_type="numpy", datasets=["olmo", "npy"], **flags), 0, 1)  # as configs say
    assert [d.documents for d in only.datasets] == [60, 60]
    assert "hf: no .npy files (--file_type=numpy)" in error(tmp_path, file_type="numpy", datasets=["hf"])
    inspect_data(str(tmp_path), ["hf", "olmo", "dolma", "npy", "megatron"], 4096, EOS, None, "tokens")
    report = capsys.readouterr().out
    rows = [line.split() for line in report.splitlines()]
    assert ["hf", "hf/data-00000-of-00003.arrow", "20", "383", "1019"] in rows  # relative: no leading slash
    assert ["npy", "npy/tokens.npy", "60", "1212", "4059"] in rows
    megatron = ["megatron", "megatron/corpus_text_document.bin", "60", str(sum(map(len, MEGATRON_DOCS))), "559"]
    assert megatron in rows and ["all", "total", "(5", "datasets)", "300", "6345", "4059"] in rows
    assert "doubled separators (documents beginning or ending with eos 0; the loader adds one, so they get two): 0" in (
        report
    )  # a token array's documents end at eos by design


def scanned(root: Path, cache: Path) -> list[int]:
    """The documents of each file of dataset `olmo`, scanned with the data cache in `cache`."""
    entries = scan(
        dataset_sources(str(root), None),
        Layout(file_type="auto", options=Options(vocab_size=4096), cache_dir=str(cache)),
    )
    return [e.documents for e in entries["olmo"]]


def test_a_damaged_data_cache_is_computed_again_and_dolma_metadata_keys_the_index(tmp_path):
    root, cache = tmp_path / "data", tmp_path / "cache"
    write_olmo(root / "olmo", make_docs(10, 20, seed=1), metadata=True)
    assert scanned(root, cache) == [10, 10]
    index = sorted(cache.glob("*/index/*.npy"))
    counts = next(cache.glob(f"*/{CACHED_COUNTS}"))
    assert len(index) == 2
    index[0].write_bytes(index[0].read_bytes()[:40])  # cut off in its header
    index[1].write_bytes(index[1].read_bytes()[:-16])  # cut off in its data
    counts.write_text("dataset/fil")
    assert scanned(root, cache) == [10, 10]  # no traceback: computed again and replaced
    assert [np.load(p).shape for p in index] == [(11,), (11,)]
    assert counts.read_text().startswith("dataset/filename,documents,tokens\n/olmo/part-0-00000.npy,10,")
    assert not [p for p in cache.rglob(".*")]  # no temporary file left behind
    meta = root / "olmo" / "part-0-00000.csv.gz"  # the same tokens, its first two documents made one
    rows = [r.split(",") for r in gzip.decompress(meta.read_bytes()).decode().splitlines()]
    rows[:2] = [[rows[0][0], rows[1][1], *rows[0][2:]]]
    meta.write_bytes(gzip.compress("\n".join(",".join(r) for r in rows).encode() + b"\n"))
    assert scanned(root, cache) == [9, 10]
    meta.unlink()  # no metadata: documents end at eos, which these have none of
    assert scanned(root, cache) == [1, 10]


def test_indexes_made_by_other_checks_are_made_again(tmp_path, monkeypatch):
    """An index cached under another INDEX_VERSION (made before a check was added) is not used: the file is
    read and checked again, and its index cached beside the old one."""
    from fms_fsdp.data import data_cache_dir

    root, cache = tmp_path / "data", tmp_path / "cache"
    write_olmo(root / "olmo", make_docs(10, 20, seed=1))
    assert scanned(root, cache) == [10, 10]
    before = set(cache.glob("*/index/*.npy"))
    monkeypatch.setattr(data_cache_dir, "INDEX_VERSION", data_cache_dir.INDEX_VERSION + 1)
    assert scanned(root, cache) == [10, 10]
    after = set(cache.glob("*/index/*.npy"))
    assert len(before) == 2 and before < after and len(after) == 4


def error(root: Path, **kw) -> str:
    with pytest.raises(DataError) as e:
        data_loader(cfg(root, **kw), 0, 1)  # at start-up: before any batch
    assert "\n" not in str(e.value)
    return str(e.value)


def test_bad_files_are_one_line_at_start_up(tmp_path):
    write_hf(tmp_path / "cut", make_docs(10, 300, 1), shards=1)
    shard = tmp_path / "cut" / "data-00000-of-00001.arrow"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    assert "cut/data-00000-of-00001.arrow: the Arrow stream is cut off midway" in error(tmp_path, datasets=["cut"])
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "part-0.npy").write_bytes(b"\x01\x00\x02")
    message = error(tmp_path, datasets=["odd"])
    assert "odd/part-0.npy: 3 bytes is not a whole number of uint16 tokens" in message and "--token_dtype" in message
    write_olmo(tmp_path / "wide", make_docs(10, 20, 2), np.uint16)  # read as uint32 by OLMo's rule for 70000
    message = error(tmp_path, datasets=["wide"], vocab_size=70000)
    assert "wide/part-0-00000.npy: token id" in message and ">= vocab_size 70000 (read as uint32" in message
    for lone in ("x.bin", "y.idx"):
        folder = tmp_path / f"lone_{lone[0]}"
        folder.mkdir()
        (folder / lone).write_bytes(b"\0" * 64)
        other = "x.idx" if lone == "x.bin" else "y.bin"
        assert f"{lone}: no {other} beside it (a Megatron dataset is a .bin and .idx pair)" in error(
            tmp_path, datasets=[folder.name]
        )
    write_megatron(tmp_path / "megatron")
    idx, data = (tmp_path / "megatron" / f"corpus_text_document.{end}" for end in ("idx", "bin"))
    good = idx.read_bytes()
    for bad, message in (
        (b"MMIDIDY" + good[7:], "corpus_text_document.idx: not a Megatron index (no MMIDIDX header)"),
        (good[:9] + (2).to_bytes(8, "little") + good[17:], "Megatron index version 2, this reader knows version 1"),
        (
            good[:17] + bytes([9]) + good[18:],
            "corpus_text_document.idx: unknown Megatron dtype code 9 (known: 1 (uint8)",
        ),
        (good[:-20], f"corpus_text_document.idx: cut off: {len(good) - 20} bytes, its header says {len(good)}"),
    ):
        idx.write_bytes(bad)
        assert message in error(tmp_path, datasets=["megatron"])
    idx.write_bytes(good)
    data.write_bytes(data.read_bytes()[:-10])
    message = error(tmp_path, datasets=["megatron"])
    assert "megatron/corpus_text_document.bin:" in message and "shorter than its .idx says" in message


def test_ids_read_at_half_their_width_are_refused_and_real_narrow_data_is_not(tmp_path):
    """OLMo's rule reads a headerless token array as uint16 for a vocabulary of up to 65,536: uint32 ids
    read so leave every other token 0, and the start and fms-inspect-data refuse the file in one line
    naming it and the --token_dtype to set. uint16 data with a separator in every other token or so
    is read; and a Megatron .idx whose dtype does not match its offsets is refused."""
    rng = np.random.default_rng(0)
    docs = [[int(t) for t in rng.integers(4, 30000, int(rng.integers(1, 40)))] for _ in range(200)]
    write_olmo(tmp_path / "wide", docs, np.uint32)
    message = error(tmp_path, datasets=["wide"], vocab_size=32000)
    assert (
        "wide/part-0-00000.npy: every other token is 0 read as uint16 by OLMo's rule for --vocab_size=32000" in message
    )
    assert message.endswith("set --token_dtype=uint32"), message
    with pytest.raises(DataError, match="every other token is 0 read as uint16.*set --token_dtype=uint32"):
        inspect_data(str(tmp_path), ["wide"], 32000, EOS, None, "tokens")
    message = error(tmp_path, datasets=["wide"], vocab_size=32000, token_dtype="uint16")
    assert "every other token is 0 read as uint16 by --token_dtype" in message
    short = [[int(t) for t in rng.integers(4, 30000, int(rng.integers(1, 4)))] for _ in range(300)]
    write_olmo(tmp_path / "narrow", short, np.uint16, files=1)  # ~40% of the tokens are separators
    tokens = np.fromfile(tmp_path / "narrow" / "part-0-00000.npy", np.uint16)
    assert (tokens == EOS).mean() > 0.3
    loader = data_loader(cfg(tmp_path, datasets=["narrow"], vocab_size=32000), 0, 1)
    assert next(iter(loader))[0].numel() > 0  # read, not refused
    write_megatron(tmp_path / "megatron")
    idx = tmp_path / "megatron" / "corpus_text_document.idx"
    good = idx.read_bytes()
    assert good[17] == 8  # uint16
    idx.write_bytes(good[:17] + bytes([4]) + good[18:])  # says int32
    message = error(tmp_path, datasets=["megatron"])
    assert (
        "corpus_text_document.idx: its dtype is int32 (code 4), but its documents' byte offsets step by 2 bytes"
        in message
    )


MEGATRON_WRITER = """
import sys, numpy as np, torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
root, docs, fixture = sys.argv[1], eval(open(sys.argv[2]).read()), eval(open(sys.argv[3]).read())
builder = IndexedDatasetBuilder(f"{root}/fixture/corpus_text_document.bin", dtype=np.uint16)
for d in fixture:  # tests/data/megatron, as preprocess_data.py writes a small vocabulary's
    builder.add_document(torch.tensor(d), [len(d)])
builder.finalize(f"{root}/fixture/corpus_text_document.idx")
names = ["uint8", "int8", "int16", "int32", "int64", "float64", "float32", "uint16"]
for name in names:
    builder = IndexedDatasetBuilder(f"{root}/{name}/part.bin", dtype=getattr(np, name))
    for d in docs:
        builder.add_document(torch.tensor(d), [len(d)])
    builder.finalize(f"{root}/{name}/part.idx")
for f in range(2):  # documents of several sequences (preprocess_data.py --split-sentences)
    builder = IndexedDatasetBuilder(f"{root}/sentences/part{f}.bin", dtype=np.int32)
    for d in docs[f::2]:
        for k in range(0, len(d), 5):
            builder.add_item(torch.tensor(d[k : k + 5]))
        builder.end_document()
    builder.finalize(f"{root}/sentences/part{f}.idx")
"""


@pytest.mark.slow
def test_megatron_indexed_datasets_as_megatron_core_writes_them(tmp_path):
    """Every dtype code, documents of one and of several sequences: exact tokens, none twice within an
    epoch on 2 ranks, exact resume, 2 -> 3 rescaling, and the bad files; tests/data/megatron is what
    megatron-core writes."""
    docs = make_docs(10, 40, seed=8)  # ids 10..49: every dtype holds them
    (tmp_path / "docs.txt").write_text(repr(docs))
    (tmp_path / "fixture.txt").write_text(repr(MEGATRON_DOCS))
    for name in ("uint8", "int8", "int16", "int32", "int64", "float64", "float32", "uint16", "sentences", "fixture"):
        (tmp_path / name).mkdir()
    texts = [str(tmp_path / "docs.txt"), str(tmp_path / "fixture.txt")]
    subprocess.run([sys.executable, "-c", MEGATRON_WRITER, str(tmp_path), *texts], check=True, timeout=300)
    for text in texts:
        Path(text).unlink()
    for name in ("corpus_text_document.bin", "corpus_text_document.idx"):
        assert (tmp_path / "fixture" / name).read_bytes() == (MEGATRON / name).read_bytes(), name
    shutil.rmtree(tmp_path / "fixture")
    for name in ("uint8", "int8", "int16", "int32", "int64", "float64", "float32", "uint16"):
        assert read_all(data_loader(cfg(tmp_path, datasets=[name]), 0, 1)) == docs, name
    sentences = data_loader(cfg(tmp_path, datasets=["sentences"]), 0, 1)
    assert sorted(map(tuple, read_all(sentences))) == sorted(map(tuple, docs))
    c = cfg(tmp_path, datasets=["sentences"], seq_length=31, logical_shards=6)
    starts = Counter()
    for rank in (0, 1):
        starts.update(doc_starts(lines_of(take(data_loader(c, rank, 2), 4)).reshape(-1)))
    assert max(starts.values()) == 1 and len(starts) > 15
    full = take(data_loader(c, 1, 2), 8)
    first = data_loader(c, 1, 2)
    it = iter(first)
    for _ in range(3):
        next(it)
    again = data_loader(c, 1, 2)
    again.load_state_dict(pickle.loads(pickle.dumps(first.state_dict())))
    assert all(torch.equal(x1, x2) for (x1, _), (x2, _) in zip(full[3:], take(again, 5)))
    seen: Counter = Counter()
    old = []
    for rank in range(2):
        loader = data_loader(c, rank, 2)
        seen.update(lines_of(take(loader, 2)).reshape(-1).tolist())
        old.append(loader.state_dict())
    new = []
    for rank in range(3):
        loader = data_loader(c, rank, 3)
        loader.load_state_dict(pickle.loads(pickle.dumps(old)))
        seen.update(lines_of(take(loader, 2)).reshape(-1).tolist())
        new.append(loader.state_dict())
    del seen[EOS]
    assert seen == consumed_from_states(loader, new)
