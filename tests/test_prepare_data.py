"""scripts/prepare_data.py and scripts/inspect_data.py: real files, real subprocesses."""

from __future__ import annotations

import csv
import gzip
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from test_data import write_arrow_docs  # fms-fsdp's layout: one record batch per document

ROOT = Path(__file__).resolve().parents[1]


def run(script: str, *args: object, rc: int = 0) -> subprocess.CompletedProcess:
    """Run scripts/<script> with args; assert its exit status."""
    proc = subprocess.run(
        [sys.executable, f"scripts/{script}", *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == rc, proc.stdout + proc.stderr
    return proc


def prepare(src: Path, out: Path, *args: object, rc: int = 0) -> subprocess.CompletedProcess:
    return run("prepare_data.py", f"--input={src}", f"--output={out}", *args, rc=rc)


def write_jsonl(path: Path, records: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def read_shards(folder: Path) -> dict[str, list[list[int]]]:
    """Documents of every shard in a dataset folder, checking the predecessor layout on the way."""
    shards = {}
    for path in sorted(folder.glob("*.arrow")):
        reader = pa.ipc.open_file(pa.memory_map(str(path)))
        assert reader.schema == pa.schema([("tokens", pa.uint32())])
        shards[path.name] = [reader.get_batch(i).column(0).to_pylist() for i in range(reader.num_record_batches)]
    return shards


def documents(folder: Path) -> list[list[int]]:
    return [doc for docs in read_shards(folder).values() for doc in docs]


def counts_rows(data: Path, dataset: str) -> list[list[str]]:
    with open(data / "meta" / f"counts_{dataset}.csv", newline="") as f:
        return list(csv.reader(f))


def snapshot(folder: Path) -> dict[str, tuple[int, bytes]]:
    """(mtime_ns, content) of every file under folder."""
    return {
        str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.rglob("*") if p.is_file()
    }


def utf8(texts: list[str]) -> list[list[int]]:
    return [list(t.encode("utf-8")) for t in texts]


def test_byte_round_trip_of_mixed_inputs(tmp_path):
    raw, data = tmp_path / "raw", tmp_path / "data"
    write_jsonl(raw / "a.jsonl", [{"text": "hello"}, {"text": "naïve café ☕", "id": 2}])
    pq.write_table(
        pa.table({"text": ["pq one", "", "pq three", "pq four"], "n": [1, 2, 3, 4]}),
        raw / "c.parquet",
        row_group_size=2,
    )
    (raw / "d.txt").write_text("plain text\nsecond line\n")
    (raw / "e.md").write_text("# Title\n")
    (raw / "sub").mkdir()
    with gzip.open(raw / "sub" / "b.jsonl.gz", "wt") as f:
        f.write('{"text": "gz one"}\n{"text": "gz two"}\n')
    proc = prepare(raw, data / "ds", "--tokenizer=byte")

    texts = [
        "hello",
        "naïve café ☕",
        "pq one",
        "pq three",
        "pq four",
        "plain text\nsecond line\n",
        "# Title\n",
        "gz one",
        "gz two",
    ]  # sorted inputs: a.jsonl, c.parquet, d.txt, e.md, sub/b.jsonl.gz
    tokens = sum(len(t.encode()) for t in texts)
    shards = read_shards(data / "ds")
    assert documents(data / "ds") == utf8(texts)
    assert counts_rows(data, "ds") == [["dataset/filename", "documents", "tokens"]] + [
        [f"/ds/{name}", str(len(docs)), str(sum(map(len, docs)))] for name, docs in shards.items()
    ]
    assert f"9 documents, {tokens} tokens, 5 shards" in proc.stdout
    assert "empty text 1" in proc.stdout

    report = run("inspect_data.py", f"--data_path={data}", "--vocab_size=256").stdout.splitlines()
    total = next(line for line in report if line.startswith("all "))
    assert total.split()[-3:-1] == ["9", str(tokens)]
    assert {
        "counts CSV mismatches: 0",
        "empty documents: 0",
        "documents with out-of-vocabulary ids (>= 256): 0",
    } <= set(report)


def test_local_tokenizer_without_special_tokens(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    texts = ["the cat sat", "on the mat", "the dog sat on the cat"]
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[UNK]", "[BOS]"]))
    bos = tok.token_to_id("[BOS]")
    tok.post_processor = processors.TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", bos)])
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    assert tok.encode(texts[0]).ids[0] == bos  # the post-processor would add it

    write_jsonl(tmp_path / "raw.jsonl", [{"text": t} for t in texts])
    prepare(tmp_path / "raw.jsonl", tmp_path / "data" / "ds", f"--tokenizer={tmp_path / 'tok'}")
    docs = documents(tmp_path / "data" / "ds")
    assert docs == [tok.encode(t, add_special_tokens=False).ids for t in texts]
    assert all(bos not in doc for doc in docs)


def test_shard_tokens_splits_one_input(tmp_path):
    texts = [f"document {i}" for i in range(10)]  # 10 bytes each
    write_jsonl(tmp_path / "raw.jsonl", [{"text": t} for t in texts])
    prepare(tmp_path / "raw.jsonl", tmp_path / "data" / "ds", "--tokenizer=byte", "--shard_tokens=25")
    shards = read_shards(tmp_path / "data" / "ds")
    assert list(shards) == [f"part-00000-00000-{j:05d}.arrow" for j in range(4)]
    assert [len(docs) for docs in shards.values()] == [3, 3, 3, 1]
    assert documents(tmp_path / "data" / "ds") == utf8(texts)


def test_bad_records_are_reported_and_counted(tmp_path):
    bad = tmp_path / "raw" / "a.jsonl"
    bad.parent.mkdir()
    bad.write_bytes(
        b'{"text": "good one"}\n'
        b'{"text": "no closing quote}\n'
        b'{"title": "no text field"}\n'
        b'{"text": "bad \xff\xfe bytes"}\n'
        b'{"text": ""}\n'
        b'{"text": 5}\n'
        b"\n"
        b'{"text": "good two"}\n'
    )
    write_jsonl(tmp_path / "raw" / "b.jsonl", [{"x": i} for i in range(25)] + [{"text": "good three"}])
    proc = prepare(tmp_path / "raw", tmp_path / "data" / "ds", "--tokenizer=byte")

    warnings = proc.stderr.splitlines()
    for line, reason in [
        (2, "invalid JSON"),
        (3, "missing 'text'"),
        (4, "invalid UTF-8"),
        (5, "empty text"),
        (6, "'text' is not a string"),
    ]:
        assert f"warning: {bad}:{line}: {reason}" in warnings
    assert f"warning: {tmp_path / 'raw' / 'b.jsonl'}:15: missing 'text'" in warnings  # the 20th, the last shown
    assert sum(w.startswith(f"warning: {tmp_path}") for w in warnings) == 20
    assert "warning: 10 more skipped records not shown" in warnings
    assert (
        "skipped 30 records: 'text' is not a string 1, empty text 1, invalid JSON 1, invalid UTF-8 1, missing 'text' 26"
    ) in proc.stdout
    assert documents(tmp_path / "data" / "ds") == utf8(["good one", "good two", "good three"])


def test_rerun_skips_finished_inputs_and_redoes_only_unfinished_ones(tmp_path):
    raw, data = tmp_path / "raw", tmp_path / "data"
    for i in range(3):
        write_jsonl(raw / f"{i}.jsonl", [{"text": f"input {i} doc {j}"} for j in range(5)])
    prepare(raw, data / "ds", "--tokenizer=byte", "--shard_tokens=40")
    before = snapshot(data)

    proc = prepare(raw, data / "ds", "--tokenizer=byte", "--shard_tokens=40")
    assert snapshot(data) == before
    assert "3 input files in 3 pieces (3 done before)" in proc.stdout

    (data / "ds" / ".done" / "00001-00000.json").unlink()  # as if the run had died while writing input 1
    for shard in (data / "ds").glob("part-00001-*.arrow"):
        shard.unlink()
    (data / "ds" / ".part-00001-00000-00000.arrow.0badc0de.tmp").write_bytes(b"half a shard")
    proc = prepare(raw, data / "ds", "--tokenizer=byte", "--shard_tokens=40")
    assert "3 input files in 3 pieces (2 done before)" in proc.stdout
    after = snapshot(data)
    assert after.keys() == before.keys()
    redone = {k for k in before if after[k][0] != before[k][0]}
    assert redone == {k for k in before if "part-00001-" in k or k.endswith("00001-00000.json")}
    assert all(after[k][1] == before[k][1] for k in before)  # same bytes, counts CSV included: no duplicates
    rows = counts_rows(data, "ds")
    assert len(rows) == len({r[0] for r in rows}) == 1 + len(list((data / "ds").glob("*.arrow")))


def test_two_workers_give_the_same_bytes_as_one(tmp_path):
    raw = tmp_path / "raw"
    for i in range(4):
        write_jsonl(raw / f"{i}.jsonl", [{"text": f"input {i} " + "x" * j} for j in range(12)])
    prepare(raw, tmp_path / "one" / "ds", "--tokenizer=byte", "--shard_tokens=50", "--workers=1")
    prepare(raw, tmp_path / "two" / "ds", "--tokenizer=byte", "--shard_tokens=50", "--workers=2")
    one = {k: v[1] for k, v in snapshot(tmp_path / "one").items()}
    assert len(one) > 10
    assert one == {k: v[1] for k, v in snapshot(tmp_path / "two").items()}


def test_inspect_flags_problems_in_the_predecessor_layout(tmp_path):
    write_arrow_docs(tmp_path / "ds" / "a.arrow", [[5, 6, 7], [0, 8], [], [9, 500]])
    write_arrow_docs(tmp_path / "ds" / "sub" / "b.arrow", [[1, 2]])
    (tmp_path / "meta").mkdir()
    (tmp_path / "meta" / "counts.csv").write_text(
        "dataset/filename,documents,tokens\n/ds/a.arrow,4,9\n/ds/sub/b.arrow,1,2\n"
    )
    lines = run("inspect_data.py", f"--data_path={tmp_path}", "--vocab_size=100").stdout.splitlines()
    assert lines[1].split() == ["ds", "ds/a.arrow", "4", "7", "500"]
    assert lines[2].split() == ["ds", "ds/sub/b.arrow", "1", "2", "2"]
    for flag, example in [
        ("doubled separators", "ds/a.arrow document 1: begins with 0"),
        ("empty documents", "ds/a.arrow document 2"),
        ("documents with out-of-vocabulary ids (>= 100)", "ds/a.arrow document 3: id 500"),
        (
            "counts CSV mismatches",
            "ds/a.arrow: meta/*counts*.csv says 4 documents, 9 tokens; the file has 4 documents, 7 tokens",
        ),
    ]:
        i = next(i for i, line in enumerate(lines) if line.startswith(flag))
        assert lines[i].endswith(": 1") and lines[i + 1] == f"  {example}"


def test_inspect_flags_problems_in_rows_layout_parquet(tmp_path):
    rows = pa.array([[1, 2, 3], [], [4, 0], [7, 300], [8]], pa.list_(pa.int32()))
    (tmp_path / "rows").mkdir()
    pq.write_table(pa.table({"ids": rows}), tmp_path / "rows" / "a.parquet", row_group_size=2)
    out = run(
        "inspect_data.py",
        f"--data_path={tmp_path}",
        "--datasets=rows",
        "--col_name=ids",
        "--bos_token=1",
        "--vocab_size=256",
    ).stdout
    assert out.splitlines()[1].split() == ["rows", "rows/a.parquet", "5", "8", "300"]
    assert (
        "doubled separators (documents beginning or ending with eos 0 or bos 1; the loader adds one, so they "
        "get two): 2\n  rows/a.parquet document 0: begins with 1\n  rows/a.parquet document 2: ends with 0\n"
        "empty documents: 1\n  rows/a.parquet document 1\n"
        "documents with out-of-vocabulary ids (>= 256): 1\n  rows/a.parquet document 3: id 300\n"
    ) in out
    assert "counts CSV: none for these datasets" in out


def error_case(tmp_path: Path, case: str) -> tuple[list[str], str]:
    """(script and flags, what the one-line message must name) of a bad invocation, its files written."""
    raw, out, data = tmp_path / "raw.jsonl", f"--output={tmp_path / 'data' / 'ds'}", tmp_path / "data"
    write_jsonl(raw, [{"text": "x"}])
    if case == "no input":
        missing = f"--input={tmp_path}/none*.jsonl"
        return ["prepare_data.py", missing, out, "--tokenizer=byte"], missing
    if case == "no tokenizer":
        missing = f"--tokenizer={tmp_path}/tok"
        return ["prepare_data.py", f"--input={raw}", out, missing], missing
    if case == "bad shard_tokens":
        return ["prepare_data.py", f"--input={raw}", out, "--tokenizer=byte", "--shard_tokens=0"], "--shard_tokens=0"
    if case == "no data_path":
        return ["inspect_data.py", f"--data_path={tmp_path}/nowhere"], f"--data_path={tmp_path}/nowhere"
    shard = data / "ds" / "a.arrow"
    write_arrow_docs(shard, [[1, 2, 3]] * 10)
    if case == "no column":
        return ["inspect_data.py", f"--data_path={data}", "--col_name=ids"], "--col_name"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return ["inspect_data.py", f"--data_path={data}"], str(shard)


@pytest.mark.parametrize(
    "case", ["no input", "no tokenizer", "bad shard_tokens", "no data_path", "no column", "truncated shard"]
)
def test_errors_are_one_line_naming_the_culprit(tmp_path, case):
    args, culprit = error_case(tmp_path, case)
    proc = run(*args, rc=2)
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert culprit in proc.stderr


def test_installed_command_runs_the_same_tool(tmp_path):
    """scripts/setup.sh installs the package editable, so its commands exist next to this interpreter."""
    command = Path(sys.executable).parent / "fms-inspect-data"
    assert command.exists(), "the package's commands are not installed: run bash scripts/setup.sh (pip install -e .)"
    write_arrow_docs(tmp_path / "ds" / "a.arrow", [[5, 6, 7], [8, 9]])
    proc = subprocess.run([str(command), f"--data_path={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[1].split() == ["ds", "ds/a.arrow", "2", "5", "9"]
