"""Report what the training loader will read from a data folder, and what looks wrong in it.
Run as scripts/inspect_data.py or, installed, `fms-inspect-data`:

    python scripts/inspect_data.py --data_path=/data
    python scripts/inspect_data.py --data_path=/data --datasets=web,code --vocab_size=128256 --eos_token=128001 \
        [--bos_token=128000] [--col_name=tokens] [--token_dtype=auto]

Reads every token file of each dataset folder (default: all sub-folders but meta) through the loader's
own readers (data/shards.py: Arrow files and streams, Parquet, Megatron .bin/.idx, OLMo/Dolma .npy
token arrays), each recognised as the loader recognises it, so it sees what training will see.

Prints documents, tokens and the largest id per file and per dataset, then flags, with the first few
examples (file and document index):
- doubled separators: documents beginning or ending with --eos_token or --bos_token (the loader adds
  them, so such a document gets two);
- empty documents;
- out-of-vocabulary ids (>= --vocab_size, when given);
- differences from <data_path>/meta/*counts*.csv: wrong counts, listed files that are missing.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

import numpy as np
import pyarrow as pa
from tqdm import tqdm

from fms_fsdp.data.file_reader import TOKEN_DTYPES, Options
from fms_fsdp.data.shards import list_datasets, read_counts, reader_of, shard_paths
from fms_fsdp.data.token_arrays import TokenArray
from fms_fsdp.errors import ConfigError, DataError, first_line

EXAMPLES = 5


def as_id(flag: str, value: Optional[int], low: int = 0) -> Optional[int]:
    """An optional integer flag >= low."""
    if value is not None and value < low:
        raise ConfigError(f"--{flag}={value}: expected an integer >= {low} (or None)")
    return value


@dataclass
class Flag:
    """One kind of problem: how many documents have it, and the first few."""

    title: str
    count: int = 0
    examples: list[str] = field(default_factory=list)

    def add(self, n: int, examples: Iterable[str]) -> None:
        """Count n more documents; keep the first of their (lazily made) examples while there is room."""
        self.count += n
        self.examples += itertools.islice(examples, EXAMPLES - len(self.examples))

    def print(self) -> None:
        print(f"{self.title}: {self.count}")
        for line in self.examples:
            print(f"  {line}")


@dataclass
class FileStats:
    path: str  # relative to data_path, as printed: dataset/sub/f.arrow
    documents: int = 0
    tokens: int = 0
    max_id: int = -1


class Checker:
    """Runs the per-document checks over chunks of documents and keeps the flags."""

    def __init__(self, separators: dict[str, int], vocab_size: Optional[int]):
        self.separators, self.vocab_size = separators, vocab_size
        names = " or ".join(f"{k} {v}" for k, v in separators.items())
        self.doubled = Flag(
            f"doubled separators (documents beginning or ending with {names}; the loader adds one, so they get two)"
        )
        self.empty = Flag("empty documents")
        self.oov = Flag(f"documents with out-of-vocabulary ids (>= {vocab_size})")

    def documents(self, stats: FileStats, values: np.ndarray, lengths: np.ndarray, eos_ends: bool = False) -> None:
        """Check len(lengths) consecutive documents whose tokens are `values`, and count them into stats
        (eos_ends: the layout ends each document at eos, token arrays, so a final eos is no double)."""
        first_doc = stats.documents
        stats.documents += len(lengths)
        stats.tokens += len(values)
        if len(values):
            stats.max_id = max(stats.max_id, int(values.max()))
        ends = np.cumsum(lengths)

        def where(d: int) -> str:
            return f"{stats.path} document {first_doc + d}"

        empty = np.flatnonzero(lengths == 0)
        self.empty.add(len(empty), map(where, empty))
        docs = np.flatnonzero(lengths)
        first, last = values[ends[docs] - lengths[docs]], values[ends[docs] - 1]
        seps = list(self.separators.values())
        closing = [v for k, v in self.separators.items() if not (eos_ends and k == "eos")]
        begins, finishes = np.isin(first, seps), np.isin(last, closing)

        def edges(k: int) -> str:
            how = [f"begins with {first[k]}"] if begins[k] else []
            how += [f"ends with {last[k]}"] if finishes[k] else []
            return f"{where(docs[k])}: {' and '.join(how)}"

        doubled = np.flatnonzero(begins | finishes)
        self.doubled.add(len(doubled), map(edges, doubled))
        if self.vocab_size is not None:
            bad = np.flatnonzero((values >= self.vocab_size) | (values < 0))
            oov_docs, first_bad = np.unique(np.searchsorted(ends, bad, side="right"), return_index=True)
            self.oov.add(len(oov_docs), (f"{where(d)}: id {values[bad[i]]}" for d, i in zip(oov_docs, first_bad)))


def scan_file(path: Path, rel: str, options: Options, checker: Checker) -> FileStats:
    """Counts of one shard file, its documents checked."""
    stats = FileStats(rel)
    shard = reader_of(path, options)(path, options)
    try:
        for values, lengths in shard.chunks():
            checker.documents(stats, values, lengths, isinstance(shard, TokenArray))
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: truncated or corrupt: {first_line(e)}") from None
    finally:
        shard.close()
    return stats


def compare_counts(root: Path, names: list[str], files: list[FileStats]) -> None:
    """Print how the counts CSVs agree with the files."""
    listed = {p.lstrip("/"): e for p, e in read_counts(str(root)).items() if p.split("/")[1] in names}
    if not listed:
        print("counts CSV: none for these datasets (the loader counts the files itself and caches the counts)")
        return
    problems, unlisted = [], 0
    for f in files:
        entry = listed.pop(f.path, None)
        if entry is None:
            unlisted += 1
        elif (entry.documents, entry.tokens) != (f.documents, f.tokens):
            problems.append(
                f"{f.path}: meta/*counts*.csv says {entry.documents} documents, {entry.tokens} tokens; "
                f"the file has {f.documents} documents, {f.tokens} tokens"
            )
    problems += [f"{path}: listed in meta/*counts*.csv but not found" for path in sorted(listed)]
    mismatches = Flag("counts CSV mismatches")
    mismatches.add(len(problems), problems)
    mismatches.print()
    if unlisted:
        print(f"  ({unlisted} files not listed: the loader counts them itself)")


def print_table(rows: list[list[str]]) -> None:
    """Left-aligned text columns, right-aligned numbers."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))


def report_row(name: str, label: str, files: list[FileStats]) -> list[str]:
    return [
        name,
        label,
        str(sum(f.documents for f in files)),
        str(sum(f.tokens for f in files)),
        str(max((f.max_id for f in files), default=-1)),
    ]


def inspect(root: Path, names: list[str], options: Options, checker: Checker) -> None:
    """Scan every shard of the datasets and print the table, the flags and the counts comparison."""
    paths = {name: shard_paths(root / name, "auto") for name in names}
    every = [p for ps in paths.values() for p in ps]
    stats = {
        p: scan_file(p, p.relative_to(root).as_posix(), options, checker)
        for p in tqdm(every, desc="reading", unit="file", disable=None, file=sys.stderr)
    }
    rows = [["dataset", "file", "documents", "tokens", "max id"]]
    for name in names:
        files = [stats[p] for p in paths[name]]
        rows += [report_row(name, f.path, [f]) for f in files]
        rows.append(report_row(name, f"total ({len(files)} files)", files))
    rows.append(report_row("all", f"total ({len(names)} datasets)", list(stats.values())))
    print_table(rows)
    print()
    if checker.separators:
        checker.doubled.print()
    else:
        print("doubled separators: not checked (--eos_token=None and no --bos_token)")
    checker.empty.print()
    if checker.vocab_size is None:
        print("out-of-vocabulary ids: not checked (give --vocab_size)")
    else:
        checker.oov.print()
    compare_counts(root, names, list(stats.values()))


def inspect_data(
    data_path: str,
    datasets: Optional[list[str]],
    vocab_size: Optional[int],
    eos_token: Optional[int],
    bos_token: Optional[int],
    col_name: str,
    token_dtype: str = "auto",
) -> None:
    """Report documents and tokens per dataset and file of --data_path, and flag problems (the flags:
    fms_fsdp/cli.py)."""
    if not data_path:
        raise ConfigError("--data_path is required: the folder holding one sub-folder per dataset")
    root = Path(data_path)
    if not root.is_dir():
        raise ConfigError(f"--data_path={data_path}: folder not found")
    separators = {
        k: v
        for k, v in (("eos", as_id("eos_token", eos_token)), ("bos", as_id("bos_token", bos_token)))
        if v is not None
    }
    checker = Checker(separators, as_id("vocab_size", vocab_size, low=1))
    if token_dtype not in TOKEN_DTYPES:
        raise ConfigError(f"--token_dtype={token_dtype}: expected one of {', '.join(TOKEN_DTYPES)}")
    eos = eos_token if eos_token is not None else -1
    options = Options(col_name=col_name, token_dtype=token_dtype, eos=eos, vocab_size=vocab_size)
    inspect(root, list_datasets(str(root), datasets), options, checker)
