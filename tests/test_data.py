"""The Arrow/Parquet loader: coverage, mixing, packing, stripping, exact resume, rescaling, errors; raw
text datasets (JSON lines, Parquet text) pass the same tests, spelled so that they tokenize to the same
documents."""

import gzip
import json
import pickle
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from fms_fsdp.data import DataError
from fms_fsdp.data.consumed import ledger_of
from fms_fsdp.data.sources import expand_braces
from fms_fsdp.data.stream import strip_ends
from fms_fsdp.flags import make_config

from conftest import data_loader

EOS, BOS, BOL, EOL = 0, 1, 2, 3


def write_arrow_docs(path: Path, docs: list[list[int]]) -> None:
    """fms-fsdp's layout: one record batch per document, uint32 column `tokens`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    schema = pa.schema([("tokens", pa.uint32())])
    with pa.ipc.new_file(str(path), schema) as w:
        for d in docs:
            w.write_batch(pa.record_batch([pa.array(d, pa.uint32())], schema=schema))


def write_rows(path: Path, docs: list[list[int]], rows_per_batch: int = 7) -> None:
    """One row per document, list<int32> column `tokens`, in an Arrow IPC file or Parquet."""
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"tokens": pa.array(docs, pa.list_(pa.int32()))})
    if path.suffix == ".parquet":
        pq.write_table(table, path, row_group_size=rows_per_batch)
    else:
        with pa.ipc.new_file(str(path), table.schema) as w:
            for batch in table.to_batches(max_chunksize=rows_per_batch):
                w.write_batch(batch)


TEXT_LAYOUTS = ("jsonl", "jsonl.gz", "text_parquet")


def write_tokenizer(path: Path, vocab: int = 4000, appends: list[int] = ()) -> Path:
    """A word-level tokenizer.json in which word t<i> is token i (raw text spells its token ids); it
    appends the tokens `appends` to a text when asked for its special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel({**{f"t{i}": i for i in range(vocab)}, "[UNK]": vocab}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if appends:
        tail = " ".join(f"t{i}" for i in appends)
        tok.post_processor = processors.TemplateProcessing(
            single=f"$A {tail}", special_tokens=[(f"t{i}", i) for i in appends]
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def spell(doc: list[int]) -> str:
    return " ".join(f"t{t}" for t in doc)


def write_text(path: Path, docs: list[list[int]], rows_per_group: int = 7) -> None:
    """Documents as raw text: JSON lines (gzipped when the name ends in .gz) or a Parquet text column."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        pq.write_table(pa.table({"text": [spell(d) for d in docs]}), path, row_group_size=rows_per_group)
        return
    data = "".join(json.dumps({"id": k, "text": spell(d)}) + "\n" for k, d in enumerate(docs)).encode()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)


def make_docs(first_id: int, n: int, seed: int) -> list[list[int]]:
    """Document k is the token k repeated 1..40 times: every token names its document."""
    rng = np.random.default_rng(seed)
    return [[k] * int(rng.integers(1, 40)) for k in range(first_id, first_id + n)]


def write_dataset(root: Path, name: str, docs: list[list[int]], layout: str = "arrow", files: int = 3) -> None:
    """layout: arrow (fms-fsdp's), rows_arrow or parquet (one row per document), or raw text: jsonl,
    jsonl.gz or text_parquet (with root/tokenizer.json, which cfg() then passes as --tokenizer_path)."""
    if layout in TEXT_LAYOUTS:
        write_tokenizer(root / "tokenizer.json")
    for f, part in enumerate(np.array_split(np.arange(len(docs)), files)):
        chunk = [docs[i] for i in part]
        if layout in TEXT_LAYOUTS:
            write_text(root / name / f"part{f}.{'parquet' if layout == 'text_parquet' else layout}", chunk)
        elif layout == "arrow":
            write_arrow_docs(root / name / f"sub{f % 2}" / f"part{f}.arrow", chunk)
        else:
            write_rows(root / name / f"part{f}.{'parquet' if layout == 'parquet' else 'arrow'}", chunk)


def cfg(root: Path, **kw):
    base = dict(
        data_path=str(root),
        model_variant="tiny",
        seq_length=16,
        batch_size=2,
        logical_shards=8,
        num_workers=0,
        seed=7,
        file_type="auto",
        ckpt_save_path=str(root.with_name(root.name + ".run")),  # the run's data cache: data_cache/ there
    )
    if (root / "tokenizer.json").is_file():
        base["tokenizer_path"] = str(root / "tokenizer.json")
    return make_config(**{**base, **kw})


def lines_of(batches) -> np.ndarray:
    """The full lines (seq_length + 1 tokens) behind (inputs, labels) batches."""
    return np.concatenate([torch.cat([x, y[:, -1:]], dim=1).numpy() for x, y in batches])


def take(loader, n: int) -> list:
    it = iter(loader)
    return [next(it) for _ in range(n)]


def doc_starts(stream: np.ndarray) -> list[int]:
    return [int(t) for i, t in enumerate(stream) if t != EOS and (i == 0 or stream[i - 1] == EOS)]


@pytest.mark.parametrize("layout", ["arrow", "rows_arrow", "parquet", *TEXT_LAYOUTS])
def test_every_document_once_per_epoch_and_epochs_reshuffle(tmp_path, layout):
    docs = make_docs(10, 48, seed=1)  # 48 documents: 8 logical shards of 6
    write_dataset(tmp_path, "web", docs, layout)
    loader = data_loader(cfg(tmp_path, seq_length=31), 0, 1)
    total = sum(len(d) + 1 for d in docs)
    stream = lines_of(take(loader, total // 32 + 2 + total // 32 + 2)).reshape(-1)
    epoch0, epoch1 = stream[:total], stream[total : 2 * total]
    counts = Counter(epoch0.tolist())
    assert counts[EOS] == len(docs)
    assert all(counts[d[0]] == len(d) for d in docs)
    order0, order1 = doc_starts(epoch0), doc_starts(epoch1)
    assert sorted(order0) == sorted(order1) == [d[0] for d in docs]
    assert order0 != order1
    pos = {t: i for i, t in enumerate(order0)}  # consecutive documents of a file land far apart
    assert np.mean([abs(pos[k + 1] - pos[k]) for k in range(10, 10 + len(docs) - 1)]) > len(docs) / 5


def test_weights_are_token_proportions(tmp_path):
    write_dataset(tmp_path, "a", make_docs(10, 30, 1))
    write_dataset(tmp_path, "b", make_docs(100, 300, 2))
    loader = data_loader(cfg(tmp_path, datasets=["a", "b"], weights=[3, 1], batch_size=50), 0, 1)
    lines = lines_of(take(loader, 800))  # 40,000 lines
    from_a = np.isin(lines, np.arange(10, 40)).any(axis=1)
    from_b = np.isin(lines, np.arange(100, 400)).any(axis=1)
    assert not (from_a & from_b).any()  # a line comes from one dataset
    assert from_a.mean() == pytest.approx(0.75, abs=0.01)


def sources(batches) -> list[str]:
    """Which dataset each batch came from: a (tokens 10..69), b (100..139) or both."""
    kinds = []
    for x, _ in batches:
        ids = x[x > EOS]
        kinds.append("a" if (ids < 100).all() else "b" if (ids >= 100).all() else "both")
    return kinds


def test_a_weights_schedule_switches_at_its_step_on_every_rank_and_worker_and_resumes_exactly(tmp_path):
    """--weights_schedule='0:1,0;3:0,1': dataset a alone for three steps of two micro-batches, then b
    alone; two ranks of two workers each switch at that step, a resume before, at or after the switch
    goes on exactly, and a rescale to one rank switches at the same step."""
    write_dataset(tmp_path, "a", make_docs(10, 60, 5))
    write_dataset(tmp_path, "b", make_docs(100, 40, 6))
    c = cfg(tmp_path, num_workers=2, weights_schedule="0:1,0;3:0,1", grad_accum_steps=2)
    full = {rank: take(data_loader(c, rank, 2), 10) for rank in (0, 1)}
    assert all(sources(batches) == ["a"] * 6 + ["b"] * 4 for batches in full.values())
    states = {}
    for n in (4, 6, 8):  # checkpoints at steps 2, 3 and 4
        for rank in (0, 1):
            first = data_loader(c, rank, 2)
            it = iter(first)
            for _ in range(n):
                next(it)
            states[n, rank] = pickle.loads(pickle.dumps(first.state_dict()))
            it.close()
        again = data_loader(c, 0, 2)
        again.load_state_dict(states[n, 0])
        rest = take(again, 10 - n)
        assert all(torch.equal(x1, x2) for (x1, _), (x2, _) in zip(full[0][n:], rest))
    one = data_loader(cfg(tmp_path, num_workers=1, weights_schedule="0:1,0;3:0,1", grad_accum_steps=2), 0, 1)
    one.load_state_dict([states[4, 0], states[4, 1]])  # at step 2: one step of a, then b
    assert sources(take(one, 4)) == ["a", "a", "b", "b"]
    four = data_loader(cfg(tmp_path, weights_schedule="0:1,0;3:0,1", grad_accum_steps=4), 0, 1)
    four.load_state_dict([states[4, 0], states[4, 1]])  # step 2 again, now 4 micro-batches a step
    assert sources(take(four, 8)) == ["a"] * 4 + ["b"] * 4
    # lines per dataset: the job's 2 steps x 2 micro-batches x 2 lines x 2 ranks before, then this rank's
    assert one.lines_by_dataset() == {"a": 16 + 4, "b": 4}


def test_brace_ranges_and_lists_spell_every_path():
    assert expand_braces("s3://b/web-{000..002}.jsonl.gz") == [f"s3://b/web-00{i}.jsonl.gz" for i in range(3)]
    assert expand_braces("{a,b}/x{1..2}") == ["a/x1", "a/x2", "b/x1", "b/x2"]
    assert expand_braces("{9..11}") == ["9", "10", "11"] and expand_braces("{08..10}") == ["08", "09", "10"]
    assert expand_braces("part-*.arrow") == ["part-*.arrow"]  # globs are matched later, by the file system


def test_datasets_given_by_patterns_read_what_their_folders_give(tmp_path, monkeypatch):
    """--datasets name=pattern|pattern (Levanter's data forms: brace ranges, globs, several patterns a
    dataset, files anywhere) gives the batches of the same files as folders under --data_path."""
    write_dataset(tmp_path, "a", make_docs(10, 60, 5))  # a/sub0/part0.arrow, a/sub0/part2.arrow, a/sub1/part1.arrow
    write_dataset(tmp_path, "b", make_docs(100, 40, 6), layout="parquet")  # b/part0..2.parquet
    folders = take(data_loader(cfg(tmp_path, weights=[2, 1]), 0, 1), 12)
    patterns = [f"a={tmp_path}/a/sub{{0..1}}/*.arrow", f"b={tmp_path}/b/part{{0..1}}.parquet|{tmp_path}/b/part2.*"]
    given = take(data_loader(cfg(tmp_path / "elsewhere", datasets=patterns, weights=[2, 1]), 0, 1), 12)
    monkeypatch.chdir(tmp_path / "b")  # a relative pattern is relative to the working folder
    relative = [patterns[0], "b=part{0..1}.parquet|part2.parquet"]
    again = take(data_loader(cfg(tmp_path / "elsewhere", datasets=relative, weights=[2, 1]), 0, 1), 12)
    assert all(torch.equal(x1, x2) for (x1, _), (x2, _) in zip(given, again))
    assert all(torch.equal(x1, x2) for (x1, _), (x2, _) in zip(folders, given))
    for datasets, message in [
        ([f"a={tmp_path}/a/sub{{5..6}}/*.arrow"], r"--datasets: a=.*sub\{5..6\}/\*.arrow matches no file"),
        ([f"a={tmp_path}/b/*"], r"part0.parquet \(a\) is not one of .arrow"),
        (["a="], "--datasets: 'a=' is not name=pattern"),
        ([f"a={tmp_path}/a/*.arrow|s3://b/*.arrow"], "--datasets: a's patterns span file systems or buckets"),
        ([f"a={tmp_path}/a/**/*.arrow", "a"], "--datasets: a given twice"),
    ]:
        with pytest.raises(DataError, match=message):
            data_loader(cfg(tmp_path, datasets=datasets, file_type="arrow"), 0, 1)


def test_packing_format_and_shift(tmp_path):
    docs = make_docs(10, 20, 3)
    write_dataset(tmp_path, "web", docs)
    loader = data_loader(cfg(tmp_path, bos_token=BOS, bol_token=BOL, eol_token=EOL, seq_length=24), 0, 1)
    batches = take(loader, 10)
    x, y = batches[0]
    assert x.shape == y.shape == (2, 24) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    lines = lines_of(batches)
    assert (lines[:, 0] == BOL).all() and (lines[:, -1] == EOL).all()
    inner = lines[:, 1:-1].reshape(-1)
    starts = np.flatnonzero(inner == BOS)
    for s, e in zip(starts, starts[1:]):  # every whole document: [bos] k..k [eos]
        doc = inner[s:e]
        assert doc[-1] == EOS and len(set(doc[1:-1].tolist())) == 1
        assert len(doc) - 2 == len(docs[doc[1] - 10])


@pytest.mark.parametrize("layout", ["arrow", "jsonl"])
def test_separators_already_in_documents_are_stripped(tmp_path, layout):
    docs = [[EOS, EOS, 50, 51, 50, EOS], [BOS, 60, 7, 60, 7, EOS, EOS, EOS], [7, 70, EOS, 70]] * 4
    write_dataset(tmp_path, "web", docs, layout, files=1)
    loader = data_loader(cfg(tmp_path, bos_token=BOS, strip_tokens=[7], logical_shards=1, seq_length=7), 0, 1)
    stream = lines_of(take(loader, 10)).reshape(-1).tolist()
    pairs = set(zip(stream, stream[1:]))
    assert (EOS, EOS) not in pairs and (BOS, BOS) not in pairs and (BOS, EOS) not in pairs
    text = " " + " ".join(map(str, stream)) + " "
    assert " 1 50 51 50 0 " in text and " 1 60 7 60 0 " in text  # ends stripped, inner tokens kept
    assert " 1 70 0 70 0 " in text  # an inner separator stays


def test_empty_documents_are_skipped_and_nothing_else(tmp_path):
    docs = make_docs(10, 24, 4)
    mixed = [d for pair in zip(docs, [[], [EOS], [EOS, EOS]] * 8) for d in pair]
    write_dataset(tmp_path, "web", mixed, files=2)
    loader = data_loader(cfg(tmp_path, logical_shards=1, seq_length=15), 0, 1)
    total = sum(len(d) + 1 for d in docs)
    stream = lines_of(take(loader, total // 16 + 1)).reshape(-1)[:total]
    assert Counter(stream.tolist()) == Counter([t for d in docs for t in d] + [EOS] * len(docs))


@pytest.mark.parametrize("workers, text", [(0, None), (2, None), (2, "jsonl.gz"), (0, "text_parquet")])
def test_exact_resume(tmp_path, workers, text):
    write_dataset(tmp_path, "a", make_docs(10, 60, 5))
    write_dataset(tmp_path, "b", make_docs(100, 40, 6), layout=text or "parquet")
    c = cfg(tmp_path, num_workers=workers, weights=[2, 1])
    for rank in (0, 1):
        full = take(data_loader(c, rank, 2), 13)
        first = data_loader(c, rank, 2)
        it = iter(first)
        for _ in range(5):
            next(it)
        state = pickle.loads(pickle.dumps(first.state_dict()))
        it.close()  # its workers end, as a stopped run's do
        again = data_loader(c, rank, 2)
        again.load_state_dict(state)
        rest = take(again, 8)
        for (x1, y1), (x2, y2) in zip(full[5:], rest):
            assert torch.equal(x1, x2) and torch.equal(y1, y2)


def consumed_from_states(loader, states) -> Counter:
    """The tokens the ledger of the readers' states (data/consumed.py) says were consumed, per document,
    each document named by its token (make_docs), eos tokens left out."""
    found: Counter = Counter()
    ledgers = ledger_of(states, loader.datasets, loader.seed, loader.logical_shards, loader.packing)
    for ds, ledger in zip(loader.datasets, ledgers):
        for doc in np.flatnonzero(ledger.tokens).tolist():
            f = int(np.searchsorted(ds.starts, doc, side="right") - 1)
            name = int(strip_ends(ds.read(f, doc - int(ds.starts[f])), loader.packing.strip)[0])
            found[name] += int(ledger.tokens[doc])
    return found


@pytest.mark.parametrize("before, after", [((2, 0), (3, 0)), ((4, 2), (1, 0)), ((3, 1), (5, 2)), ((1, 0), (2, 1))])
def test_rescale_repeats_and_drops_nothing(tmp_path, before, after):
    write_dataset(tmp_path, "a", make_docs(10, 400, 7))
    write_dataset(tmp_path, "b", make_docs(1000, 300, 8), layout="rows_arrow")
    write_dataset(tmp_path, "c", make_docs(2000, 300, 9), layout="parquet")
    write_dataset(tmp_path, "d", make_docs(3000, 800, 10), layout="jsonl", files=1)  # blocks of 256 lines
    seen: Counter = Counter()
    (w1, n1), (w2, n2) = before, after
    old = []
    for rank in range(w1):
        loader = data_loader(cfg(tmp_path, num_workers=n1, logical_shards=24, batch_size=4, seq_length=32), rank, w1)
        seen.update(lines_of(take(loader, 6)).reshape(-1).tolist())
        old.append(loader.state_dict())
    new = []
    for rank in range(w2):
        loader = data_loader(cfg(tmp_path, num_workers=n2, logical_shards=24, batch_size=4, seq_length=32), rank, w2)
        loader.load_state_dict(pickle.loads(pickle.dumps(old)))
        seen.update(lines_of(take(loader, 5)).reshape(-1).tolist())
        new.append(loader.state_dict())
    del seen[EOS]
    assert seen == consumed_from_states(loader, new)
    assert sum(seen.values()) > 1500
    assert {t // 1000 for t in seen} == {0, 1, 2, 3}  # all four datasets and layouts were read


def test_loader_state_is_small(tmp_path):
    for name, first in (("a", 10), ("b", 2000), ("c", 4000)):
        write_dataset(tmp_path, name, make_docs(first, 1500, first), files=4)
    loader = data_loader(cfg(tmp_path, logical_shards=1024, vocab_size=8192), 0, 1)
    take(loader, 3)
    assert len(pickle.dumps(loader.state_dict())) <= 64 * 1024


def test_a_single_rank_state_is_not_rescaled_silently(tmp_path):
    write_dataset(tmp_path, "a", make_docs(10, 40, 1))
    loader = data_loader(cfg(tmp_path), 0, 2)
    take(loader, 2)
    other = data_loader(cfg(tmp_path), 0, 3)
    with pytest.raises(DataError, match="pass the list of every rank's states"):
        other.load_state_dict(loader.state_dict())
    write_dataset(tmp_path, "a", make_docs(500, 10, 2), files=1)  # more documents now
    changed = data_loader(cfg(tmp_path), 0, 2)
    with pytest.raises(DataError, match="the data changed since this state was saved"):
        changed.load_state_dict(loader.state_dict())


def test_counts_file_is_read_when_present_and_cached_when_absent(tmp_path):
    write_dataset(tmp_path, "a", make_docs(10, 30, 1))
    (tmp_path / "meta").mkdir()
    files = sorted((tmp_path / "a").rglob("*.arrow"))
    rows = [f"/a/{p.relative_to(tmp_path / 'a').as_posix()},10,12345" for p in files]
    (tmp_path / "meta" / "combined_counts.csv").write_text(
        "dataset/filename,documents,tokens\n" + "\n".join(rows) + "\n"
    )
    loader = data_loader(cfg(tmp_path), 0, 1)
    assert loader.datasets[0].tokens == 3 * 12345  # taken from the file, not recomputed
    (tmp_path / "meta" / "combined_counts.csv").unlink()
    loader = data_loader(cfg(tmp_path), 0, 1)
    assert not list((tmp_path / "meta").iterdir())  # the data folder is left alone: the cache is the run's
    cache = next(tmp_path.with_name(tmp_path.name + ".run").rglob("*counts*.csv")).read_text().splitlines()
    assert cache[0] == "dataset/filename,documents,tokens" and len(cache) == 4
    assert loader.datasets[0].tokens == sum(len(d) for d in make_docs(10, 30, 1))


def test_bad_inputs_give_one_line_errors(tmp_path):
    def error(**kw) -> str:
        with pytest.raises(DataError) as e:
            take(data_loader(cfg(tmp_path, **kw), 0, 1), 4)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "--data_path: folder not found" in error(data_path=str(tmp_path / "nowhere"))
    write_dataset(tmp_path, "a", make_docs(10, 30, 1))
    assert "--datasets: no folder 'zz'" in error(datasets=["zz"])
    assert "--weights has 2 values but" in error(weights=[1, 2])
    (tmp_path / "empty").mkdir()
    write_arrow_docs(tmp_path / "empty" / "x.arrow", [])
    assert "empty: the dataset has no documents" in error(datasets=["empty"])
    write_dataset(tmp_path, "big", [[5, 9000, 5]] * 10)
    assert re.search(
        r"big/sub\d/part\d\.arrow: document \d+ has token id 9000 >= vocab_size 4096", error(datasets=["big"])
    )
    write_rows(tmp_path / "strcol" / "x.parquet", [[1, 2]])
    assert "no column 'text'" in error(datasets=["strcol"], col_name="text")
    good = tmp_path / "a" / "sub0" / "part0.arrow"
    (tmp_path / "trunc").mkdir()
    (tmp_path / "trunc" / "t.arrow").write_bytes(good.read_bytes()[:-40])
    message = error(datasets=["trunc"])
    assert "trunc/t.arrow: not a readable arrow shard" in message


def test_deterministic_given_the_seed(tmp_path):
    write_dataset(tmp_path, "a", make_docs(10, 60, 1))
    write_dataset(tmp_path, "b", make_docs(100, 60, 2), layout="parquet")
    runs = [lines_of(take(data_loader(cfg(tmp_path, seed=seed, num_workers=2), 1, 2), 6)) for seed in (3, 3, 4)]
    assert np.array_equal(runs[0], runs[1])
    assert not np.array_equal(runs[0], runs[2])


def test_a_failing_loader_stops_its_workers_even_while_its_error_is_held(tmp_path):
    """A DataError from a worker, its traceback kept alive to the end (as a test runner or a REPL keeps
    it): the workers stop with the loader, so the process exits; it used to wait for them forever."""
    write_dataset(tmp_path, "big", [[5, 9000, 5]] * 10)
    script = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from conftest import data_loader
from test_data import cfg, take
from fms_fsdp.data import DataError
try:
    take(data_loader(cfg(__import__("pathlib").Path({str(tmp_path)!r}), num_workers=2), 0, 1), 4)
except DataError as e:
    held = e
    print("error:", e)
"""
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[1]
    )
    assert proc.returncode == 0 and "has token id 9000 >= vocab_size" in proc.stdout, proc.stderr[-2000:]
