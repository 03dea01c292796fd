"""fms-prepare-data's pieces: large inputs cut by their bytes alone, so one machine and a job array of
any size write the same shards and counts, byte for byte; killed with -9 and run again, it finishes
with the same files and redoes only what was unfinished. Real files, real subprocesses."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[1]
PIECE = 4000  # --piece_bytes of these tests: the big inputs are cut into several pieces
BAD = {7: "invalid JSON", 150: "missing 'text'", 283: "empty text"}  # big.jsonl's records n, in three pieces
BAD_RECORD = {"invalid JSON": '{"text": "cut', "missing 'text'": '{"title": "x"}', "empty text": '{"text": ""}'}


def write_corpus(raw: Path, lines: int = 300, words: int = 8) -> None:
    """A big .jsonl (bad records and blank lines in several pieces), a Parquet file of many row groups,
    a gzipped .jsonl and a text file."""
    raw.mkdir(parents=True)
    text = lambda i: " ".join(f"w{(i * 7 + k) % 50}" for k in range(words))  # noqa: E731
    with open(raw / "big.jsonl", "w") as f:
        for n in range(1, lines + 1):
            if n in BAD:
                f.write(BAD_RECORD[BAD[n]] + "\n")
            else:
                f.write(json.dumps({"text": f"line {n} " + text(n)}) + ("\n\n" if n % 50 == 0 else "\n"))
    rows = pa.table({"text": [f"row {i} " + text(i) for i in range(200)]})
    pq.write_table(rows, raw / "table.parquet", row_group_size=20, compression="none", use_dictionary=False)
    with gzip.open(raw / "small.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": "gz " + text(i)}) + "\n" for i in range(30))
    (raw / "note.txt").write_text("one whole document " + text(1))


def word_tokenizer(folder: Path) -> Path:
    """A word-level tokenizer.json of the corpus's words."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    words = (
        [f"w{k}" for k in range(50)] + ["line", "row", "gz", "one", "whole", "document"] + [str(n) for n in range(400)]
    )
    tok.train_from_iterator([" ".join(words)], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def prepare(raw: Path, out: Path, *args: object, env: dict | None = None, rc: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "scripts/prepare_data.py", f"--input={raw}", f"--output={out}", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == rc, proc.stdout + proc.stderr
    return proc


def dataset_bytes(data: Path) -> dict[str, bytes]:
    """The shards and the counts of a prepared <data>/ds, by name (the markers are the runs' own)."""
    files = {p.name: p.read_bytes() for p in (data / "ds").glob("part-*.arrow")}
    files["counts"] = (data / "meta" / "counts_ds.csv").read_bytes()
    return files


def test_a_job_array_of_any_size_writes_what_one_machine_writes(tmp_path):
    raw = tmp_path / "raw"
    write_corpus(raw)
    flags = ["--tokenizer=byte", f"--piece_bytes={PIECE}", "--shard_tokens=3000"]
    one = prepare(raw, tmp_path / "one" / "ds", *flags, "--workers=2")
    reference = dataset_bytes(tmp_path / "one")
    pieces = {name.rsplit("-", 1)[0] for name in reference if name != "counts"}
    assert len({p for p in pieces if p.startswith("part-00000-")}) >= 3  # big.jsonl was cut
    assert len({p for p in pieces if p.startswith("part-00003-")}) >= 2  # table.parquet: runs of row groups
    assert "4 input files in" in one.stdout and "skipped 3 records" in one.stdout
    lines = (raw / "big.jsonl").read_text().splitlines()
    for reason in BAD.values():  # numbered as in the file (blank lines too), whichever piece holds them
        line = lines.index(BAD_RECORD[reason]) + 1
        assert f"warning: {raw / 'big.jsonl'}:{line}: {reason}" in one.stderr.splitlines()

    for tasks in (3, 5):
        out = tmp_path / f"array{tasks}" / "ds"
        for task in range(tasks):  # as Slurm starts them, one after another here
            proc = prepare(
                raw,
                out,
                *flags,
                "--workers=1",
                env={"SLURM_ARRAY_TASK_COUNT": str(tasks), "SLURM_ARRAY_TASK_ID": str(task)},
            )
            last = task == tasks - 1
            assert (out.parent / "meta" / "counts_ds.csv").exists() == last, proc.stdout
        assert "skipped 3 records" in proc.stdout
        assert dataset_bytes(out.parent) == reference


def test_finalize_writes_the_counts_once_every_piece_is_done_or_says_what_is_left(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "data" / "ds"
    write_corpus(raw)
    flags = ["--tokenizer=byte", f"--piece_bytes={PIECE}", "--num_tasks=2"]
    prepare(raw, out, *flags, "--task_index=0")
    proc = prepare(raw, out, *flags, "--finalize=True", rc=2)
    assert proc.stderr.count("\n") == 1 and "pieces are not finished" in proc.stderr, proc.stderr
    prepare(raw, out, *flags, "--task_index=1")
    counts = out.parent / "meta" / "counts_ds.csv"
    written = counts.read_bytes()
    counts.unlink()
    proc = prepare(raw, out, *flags, "--finalize=True")
    assert counts.read_bytes() == written and "done before" in proc.stdout
    # the tasks said each bad record; finalize counts them per file, with the first few
    lines = (raw / "big.jsonl").read_text().splitlines()  # numbered as in the file, blank lines too
    first = ", ".join(f"line {lines.index(BAD_RECORD[why]) + 1} ({why})" for _, why in sorted(BAD.items()))
    said = f"warning: {raw / 'big.jsonl'}: {len(BAD)} skipped records, the first: {first}"
    assert proc.stderr.splitlines() == [said], proc.stderr


@pytest.mark.parametrize(
    "changed", ["--text_field=body", "--shard_tokens=99", f"--piece_bytes={PIECE * 2}", "--tokenizer=word"]
)
def test_a_changed_setting_is_refused_in_one_line(tmp_path, changed):
    raw, out = tmp_path / "raw", tmp_path / "data" / "ds"
    write_corpus(raw, lines=20)
    prepare(raw, out, "--tokenizer=byte", f"--piece_bytes={PIECE}", "--shard_tokens=3000")
    if changed == "--tokenizer=word":
        changed = f"--tokenizer={word_tokenizer(tmp_path / 'tok')}"
    flags = {"--tokenizer": "byte", "--piece_bytes": str(PIECE), "--shard_tokens": "3000"}
    flags[changed.split("=")[0]] = changed.split("=", 1)[1]
    proc = prepare(raw, out, *(f"{k}={v}" for k, v in flags.items()), rc=2)
    flag = changed.split("=")[0].removeprefix("--")
    assert proc.stderr.startswith(f"error: --output={out} was made with --{flag}=") and proc.stderr.count("\n") == 1


def test_killed_with_minus_9_and_run_again_it_finishes_the_same_and_redoes_only_the_unfinished(tmp_path):
    raw, tok = tmp_path / "raw", word_tokenizer(tmp_path / "tok")
    write_corpus(raw, lines=3000, words=40)
    flags = [f"--tokenizer={tok}", f"--piece_bytes={PIECE * 4}", "--shard_tokens=5000", "--workers=1"]
    prepare(raw, tmp_path / "reference" / "ds", *flags)
    out, held = tmp_path / "data" / "ds", tmp_path / "held"
    # the fourth piece waits once it began its shard (tests/held_at.py): the kill lands mid-build, mid-piece
    hold = [str(ROOT / "tests" / "held_at.py"), str(held), "piece:3"]
    proc = subprocess.Popen(
        [sys.executable, *hold, "scripts/prepare_data.py", f"--input={raw}", f"--output={out}", *flags],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not (held / "held-0").exists():
            assert proc.poll() is None and time.monotonic() < deadline, f"no piece held (status {proc.poll()})"
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    done = {p.name: p.stat().st_mtime_ns for p in (out / ".done").glob("*.json")}
    assert len(done) == 3 and len(list(out.glob(".part-*.tmp"))) == 1  # three pieces, and half of the fourth
    for shard in out.glob("part-*.arrow"):  # whatever has a final name is whole
        pa.ipc.open_file(pa.memory_map(str(shard))).read_all()
    assert not (out.parent / "meta").exists()

    again = prepare(raw, out, *flags)
    total = len(list((out / ".done").glob("*.json")))
    assert len(done) < total
    assert f"({len(done)} done before)" in again.stdout
    assert {p.name: p.stat().st_mtime_ns for p in (out / ".done").glob("*.json") if p.name in done} == done
    assert dataset_bytes(out.parent) == dataset_bytes(tmp_path / "reference")
    assert not list(out.glob(".*.tmp"))


def test_a_terminal_sees_one_progress_line_that_ends_at_the_summarys_counts(tmp_path):
    """On a terminal (a pty here) one line, redrawn in place: input bytes with rate and ETA, documents and
    tokens; it ends at 100% with the summary's counts. Without a terminal there is none."""
    import fcntl
    import pty
    import re
    import struct
    import termios

    raw = tmp_path / "raw"
    write_corpus(raw, lines=120)
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a 120-column terminal
    command = [sys.executable, "scripts/prepare_data.py", f"--input={raw}", f"--output={tmp_path / 'ds'}"]
    proc = subprocess.run(
        [*command, "--tokenizer=byte", f"--piece_bytes={PIECE}", "--workers=2"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=secondary,
        text=True,
        timeout=180,
    )
    os.close(secondary)
    terminal = b""
    while True:
        try:
            chunk = os.read(primary, 65536)
        except OSError:  # EIO: the other side is closed and all was read
            break
        if not chunk:
            break
        terminal += chunk
    os.close(primary)
    assert proc.returncode == 0, proc.stdout + terminal.decode()
    drawn = terminal.decode()
    bars = [d for d in re.split(r"[\r\n]+", drawn) if d.startswith("tokenizing")]
    assert len(bars) >= 2 and "\n" not in drawn[drawn.index("tokenizing") : drawn.rindex("tokenizing")], drawn
    documents, tokens = re.search(r"(\d+) documents, (\d+) tokens, ", proc.stdout).groups()
    last = bars[-1]
    assert "100%" in last and "B/s" in last and re.search(r"<\d\d:\d\d", last), last
    assert f"{documents} documents, {tokens} tokens" in last, (last, proc.stdout)

    quiet = prepare(raw, tmp_path / "again" / "ds", "--tokenizer=byte", f"--piece_bytes={PIECE}")
    assert "tokenizing" not in quiet.stderr
