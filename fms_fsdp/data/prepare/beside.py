"""A --cache_dir built beside the training (--cache_build=beside, the default; or external: by another
job): the run reads its raw-text datasets in raw text's own order from the first step
(data/text_cache.py takes finished pieces from the cache, and tokenizes the rest as it reads them),
while rank 0 runs fms-prepare-data's code over them, in a process of its own (`python -m
fms_fsdp.data.prepare.beside`, which dies with the rank), with its node's spare CPUs or on Ray. The cache
it leaves is the one `fms-prepare-data` writes, byte for byte. A builder that dies is started again and
skips the finished pieces; a run that stops (SIGTERM, a crash) stops it, and the next run finishes it.
A run that ends normally waits for it, so that the cache is complete for the runs after.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable, Optional, Union

from fms_fsdp.data.prepare.build import Engine, Recipe, plan, prepare_files, recipe_of
from fms_fsdp.data.prepare.cache_dir import check_made_with, engine_of
from fms_fsdp.data.prepare.settings import CacheSettings
from fms_fsdp.data.prepare.shard_writer import marker_path, read_ledger
from fms_fsdp.data.shards import Layout, dataset_files, is_text
from fms_fsdp.data.sources import Source
from fms_fsdp.data.text_cache import BuildingCache
from fms_fsdp.errors import DataError
from fms_fsdp.lifetime import dying_with_parent
from fms_fsdp.storage import location

RESTARTS = 3  # a builder that dies is started again this many times
# the builder's process: this module run as a program (a test runs it under tests/held_pieces.py instead)
BUILDER = ["-m", "fms_fsdp.data.prepare.beside"]


def building_caches(sources: list[Source], layout: Layout, settings: CacheSettings) -> dict[str, BuildingCache]:
    """The cache folder of each raw-text dataset (every rank calls this: it reads, never writes); a
    DataError for a dataset that mixes raw text and token files, or a cache made with another recipe."""
    recipe = recipe_of(settings.tokenizer_path, settings.text_field)
    caches = {}
    for source in sources:
        files = dataset_files(source, layout)
        text = [f for f in files if is_text(f, layout)]
        if not text:
            continue
        if len(text) != len(files):
            raise DataError(
                f"--cache_dir: dataset {source.name} mixes raw text and token files; give each kind its own dataset"
            )
        output = location(settings.cache_dir, "cache_dir") / source.name
        ledger = read_ledger(output)
        check_recipe(ledger or _first_marker(output), output, recipe)
        inputs = {str(p.resolve()): i for i, p in enumerate(text)}
        caches[source.name] = BuildingCache(str(output), inputs, recipe.settings(), ledger is not None)
    return caches


def _first_marker(output: Path) -> Optional[dict]:
    """What the first finished piece of an unfinished cache was made with, as a ledger says it (None: none)."""
    for path in sorted((output / ".done").glob("*-*.json")):
        try:
            made = json.loads(path.read_text())["settings"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        return {**made, "tokenizer_sha": made.get("tokenizer")}
    return None


def check_recipe(made: Optional[dict], output: Path, recipe: Recipe) -> None:
    """Refuse, at the start, a cache (complete, or its first finished piece) made with another tokenizer or
    text field (naming both), or with a --piece_bytes or --shard_tokens other than the run's."""
    if made is None:
        return
    check_made_with(made, output, recipe)
    settings = recipe.settings()
    for flag, value in ((f, settings[f]) for f in ("piece_bytes", "shard_tokens")):
        if made.get(flag) != value:
            raise DataError(
                f"--cache_dir: {output} is built with --{flag}={made.get(flag)}, but a run reads and builds it with "
                f"fms-prepare-data's default --{flag}={value}; build it with the default, or give another --cache_dir"
            )


def start_builder(
    caches: dict[str, BuildingCache], settings: CacheSettings, local_ranks: int, log: Callable[[str], None]
) -> Optional[Union["Builder", "ExternalBuild"]]:
    """Rank 0: start building the unfinished caches (--cache_build=beside), or say that another job
    builds them and watch its progress (external); None when every cache is complete."""
    todo = {name: c for name, c in caches.items() if not c.complete}
    for name, cache in caches.items():
        if cache.complete:
            log(f"note: {name}: reading the tokenized cache {cache.folder}")
    if not todo:
        return None
    names = ", ".join(todo)
    if settings.build == "external":
        log(
            f"note: training while another job tokenizes {names} into {settings.cache_dir}: finished pieces are "
            "read from there, the rest tokenized as read"
        )
        return ExternalBuild(list(todo.values()))
    engine = engine_of(settings.ray, None, settings.workers)
    if engine.name == "local" and settings.workers is None:  # the node's CPUs less its ranks'
        engine = Engine("local", max(1, engine.workers - local_ranks))
    log(
        f"note: training while {names} is tokenized into {settings.cache_dir} {engine} (once: later runs read "
        "it); finished pieces are read from there, the rest tokenized as read"
    )
    return Builder(list(todo.values()), settings, engine, log)


class BuildProgress:
    """How much of the caches' input is tokenized: the share of its bytes whose pieces have their markers."""

    def __init__(self, caches: list[BuildingCache]):
        self.inputs = [sorted(c.inputs, key=c.inputs.__getitem__) for c in caches]
        piece_bytes = caches[0].settings["piece_bytes"]
        self.pieces = [
            (Path(c.folder), p)
            for files, c in zip(self.inputs, caches)
            for p in plan([Path(f) for f in files], piece_bytes)
        ]
        self.total = sum(p.size for _, p in self.pieces) or 1
        self._done: set[int] = set()

    def progress(self) -> float:
        """The share of the input bytes whose pieces are finished (one listing of each cache's markers)."""
        markers: dict[Path, set[str]] = {}
        for k, (output, piece) in enumerate(self.pieces):
            if k in self._done:
                continue
            if output not in markers:
                folder = marker_path(output, piece).parent
                markers[output] = {p.name for p in folder.iterdir()} if folder.is_dir() else set()
            if marker_path(output, piece).name in markers[output]:
                self._done.add(k)
        return sum(self.pieces[k][1].size for k in self._done) / self.total


class ExternalBuild(BuildProgress):
    """The caches built by another job (--cache_build=external): watched for the progress metric only."""

    def finish(self) -> None:
        """Nothing to wait for: the other job finishes the cache."""

    def close(self) -> None:
        """Nothing to stop."""


class Builder:
    """fms-prepare-data's code over the unfinished caches, in a child process watched by a thread: started
    again when it dies, stopped by `close`, waited for by `finish`."""

    def __init__(
        self, caches: list[BuildingCache], settings: CacheSettings, engine: Engine, log: Callable[[str], None]
    ):
        self.log = log
        self.watched = BuildProgress(caches)
        self.job = {
            "tokenizer": settings.tokenizer_path,
            "text_field": settings.text_field,
            "engine": {"name": engine.name, "workers": engine.workers, "ray_address": engine.ray_address},
            "datasets": [[files, c.folder] for files, c in zip(self.watched.inputs, caches)],
        }
        self.failure: Optional[str] = None
        self._stop = threading.Event()
        self._process: Optional[subprocess.Popen] = None
        self._lines: deque[str] = deque(maxlen=5)
        self._thread = threading.Thread(target=self._watch, name="cache-builder", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        """Run the builder until it succeeds, is stopped, or has died RESTARTS + 1 times. The child is
        started by this thread, which outlives it: it dies with the thread (prctl's parent death)."""
        for attempt in range(RESTARTS + 1):
            command = dying_with_parent([sys.executable, *BUILDER])
            env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
            process = subprocess.Popen(  # a session of its own: the job's signals are the rank's to pass on
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
                start_new_session=True,
            )
            self._process = process
            assert process.stdin is not None and process.stdout is not None
            process.stdin.write(json.dumps(self.job))
            process.stdin.close()
            for line in process.stdout:
                self._lines.append(line.strip())
            if process.wait() == 0 or self._stop.is_set():
                return
            last = next((line for line in reversed(self._lines) if line), f"exit status {process.returncode}")
            if attempt < RESTARTS:
                self.log(f"warning: the cache's builder ended ({last}); started again, finished pieces are kept")
            else:
                self.failure = last

    def progress(self) -> float:
        """The share of the input bytes whose pieces are finished."""
        return self.watched.progress()

    def finish(self) -> None:
        """Wait for the build (a run that ended normally), and say how it ended."""
        if self._thread.is_alive():
            self.log(f"note: waiting for the cache's build to finish ({100 * self.progress():.0f}% of the text done)")
            while self._thread.is_alive():
                time.sleep(0.2)
        if self.failure is not None:
            self.log(
                f"warning: the cache's build failed {RESTARTS + 1} times ({self.failure}); its finished pieces "
                "are kept, and the next run with --cache_dir goes on with it"
            )

    def close(self) -> None:
        """Stop the build (a run that stops before its end): its finished pieces are kept."""
        self._stop.set()
        process = self._process
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        self._thread.join(timeout=30)


def main() -> None:
    """The builder's process: the job (JSON on stdin) through prepare_files, dataset by dataset."""
    job = json.load(sys.stdin)
    recipe = recipe_of(job["tokenizer"], job["text_field"])
    engine = Engine(**job["engine"])
    for files, output in job["datasets"]:
        prepare_files([Path(f) for f in files], Path(output), recipe, engine)


if __name__ == "__main__":
    try:
        main()
    except DataError as e:
        print(f"error: {e}", flush=True)
        sys.exit(1)
