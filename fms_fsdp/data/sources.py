"""Where each dataset's shards are: a sub-folder of --data_path, or, for a --datasets entry written
name=pattern|pattern..., the files its patterns match (Levanter's data forms): brace ranges and lists
(web-{000..127}.jsonl.gz, {web,code}/*.arrow) and globs (*, ?, [...], **), on disk or in object storage
(s3://bucket/web-{000..127}.jsonl.gz). Several patterns make one dataset."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from fms_fsdp.errors import DataError
from fms_fsdp.storage import location

_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"(-?\d+)\.\.(-?\d+)")
_GLOB = re.compile(r"[*?\[]")


@dataclass(frozen=True)
class Source:
    """A dataset: its name, the folder its files' paths are relative to (--data_path for a folder
    dataset), and its patterns (none for a folder dataset, whose folder is root/name)."""

    name: str
    root: str
    patterns: tuple[str, ...] = ()


def expand_braces(pattern: str) -> list[str]:
    """Every path a pattern's braces spell, left to right: {000..002} (zero-padded as written),
    {a,b}; globs are left as they are."""
    m = _BRACE.search(pattern)
    if m is None:
        return [pattern]
    r = _RANGE.fullmatch(m.group(1))
    if r:
        a, b = r.groups()
        width = max(len(a), len(b)) if a.lstrip("-").startswith("0") or b.lstrip("-").startswith("0") else 0
        step = 1 if int(b) >= int(a) else -1
        items = [str(i).zfill(width) for i in range(int(a), int(b) + step, step)]
    else:
        items = m.group(1).split(",")
    return [path for item in items for path in expand_braces(pattern[: m.start()] + item + pattern[m.end() :])]


def _static_folder(pattern: str) -> str:
    """The folder a pattern's literal part ends in (before its first brace or glob)."""
    cut = min((m.start() for m in (_BRACE.search(pattern), _GLOB.search(pattern)) if m), default=len(pattern))
    return pattern[:cut].rsplit("/", 1)[0]


def absolute(pattern: str) -> str:
    """A pattern with a local path made absolute (URLs are left as they are)."""
    return pattern if "://" in pattern else os.path.abspath(pattern)


def common_folder(patterns: list[str], name: str) -> str:
    """The deepest folder holding every pattern's files (absolute ones: `absolute`); DataError when
    they span file systems or buckets (a dataset's files are read relative to one folder)."""
    folders = [_static_folder(p) for p in patterns]
    scheme = {f.split("://", 1)[0] + "://" if "://" in f else "" for f in folders}
    prefix = scheme.pop() if len(scheme) == 1 else None
    common = "" if prefix is None else os.path.commonpath([f.removeprefix(prefix) or "/" for f in folders])
    if prefix is None or (prefix and not common.strip("/")):
        raise DataError(
            f"--datasets: {name}'s patterns span file systems or buckets: give each its own dataset", every_rank=True
        )
    return prefix + common


def matched_files(source: Source, extensions: tuple[str, ...], datasets_flag: str) -> list[Path]:
    """The files a patterned dataset names, in the order of its patterns (each pattern's sorted),
    each once; DataError naming a pattern that matches nothing or a file of another kind."""
    files: dict[str, Path] = {}
    for pattern in source.patterns:
        found: list[Path] = []
        for path in expand_braces(pattern):
            glob = _GLOB.search(path)
            if glob is None:
                file = location(path, datasets_flag)
                found += [file] if file.is_file() else []
                continue
            folder, _, rest = path[: glob.start()].rpartition("/")
            rest += path[glob.start() :]
            found += sorted(p for p in location(folder or "/", datasets_flag).glob(rest) if p.is_file())
        if not found:
            raise DataError(f"--{datasets_flag}: {source.name}={pattern} matches no file", every_rank=True)
        for file in found:
            if not str(file).endswith(extensions):
                raise DataError(
                    f"--{datasets_flag}: {file} ({source.name}) is not one of {' '.join(extensions)}", every_rank=True
                )
            files.setdefault(str(file), file)
    return list(files.values())
