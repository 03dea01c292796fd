"""Levanter's `cache_dir`: raw-text datasets tokenized once, before the first step, into
<cache_dir>/<dataset> by fms-prepare-data's code (data/prepare/build.py: the same pieces, shards, counts and
markers), then read as prepared Arrow shards. A complete cache (its ledger, .done/complete.json) is
reused as it is, read and never rewritten; an unfinished one is finished (its finished pieces kept); one
made with another tokenizer or text field is refused. Datasets of token files are read where they are.

Who tokenizes: rank 0 (the others wait), with its node's CPUs, or on Ray: a running cluster
(--ray_address), a local one it starts and stops (--ray_auto_start_cluster), or one started over the
job's own nodes for the build and stopped after it (--ray_start_workers: the head beside rank 0, each
other node's first rank a worker).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from fms_fsdp.data.prepare.build import Engine, Recipe, prepare_files, recipe_of
from fms_fsdp.data.prepare.settings import CacheSettings, RaySettings
from fms_fsdp.data.prepare.shard_writer import read_ledger
from fms_fsdp.data.shards import Layout, dataset_files, is_text
from fms_fsdp.data.sources import Source
from fms_fsdp.errors import ConfigError, DataError
from fms_fsdp.lifetime import dying_with_parent
from fms_fsdp.parallel.process_group import agreement_group, free_port, on_rank0
from fms_fsdp.storage import location

BUILD_TIMEOUT = timedelta(days=7)  # the other ranks wait this long for the cache


def cached_sources(sources: list[Source], layout: Layout, settings: CacheSettings) -> list[Source]:
    """The datasets to read: each raw-text one as its folder in the cache, tokenized there first where the
    cache is not complete (every rank calls this; rank 0 tokenizes)."""
    cluster = start_job_cluster() if settings.ray.start_workers else None
    head = cluster.address if cluster is not None else None
    try:
        return on_rank0(
            lambda: [_cached(s, layout, settings, head) for s in sources],
            lambda e: isinstance(e, (DataError, ConfigError)),
            lambda message: DataError(message, every_rank=True),
            timeout=BUILD_TIMEOUT,
        )
    finally:
        if cluster is not None:
            stop_job_cluster(cluster)


def _cached(source: Source, layout: Layout, settings: CacheSettings, head: Optional[str]) -> Source:
    """One dataset: itself when it holds token files, else its folder in the cache (built there now
    unless complete)."""
    files = dataset_files(source, layout)
    text = [f for f in files if is_text(f, layout)]
    if not text:
        return source
    if len(text) != len(files):
        raise DataError(
            f"--cache_dir: dataset {source.name} mixes raw text and token files; give each kind its own dataset"
        )
    output = location(settings.cache_dir, "cache_dir") / source.name
    recipe = recipe_of(settings.tokenizer_path, settings.text_field)
    ledger = read_ledger(output)
    if ledger is None:
        engine = engine_of(settings.ray, head, settings.workers)
        why = (
            ""
            if settings.build == "first"
            else "; before the first step, as a cache in object storage or on the job's own Ray is"
        )
        print(f"note: tokenizing {source.name} into {output} {engine} (once: later runs read it){why}", flush=True)
        prepare_files(text, output, recipe, engine)
    else:
        check_made_with(ledger, output, recipe)
        print(f"note: {source.name}: reading the tokenized cache {output}", flush=True)
    return Source(source.name, settings.cache_dir)


def check_made_with(ledger: dict, output: Path, recipe: Recipe) -> None:
    """Refuse a cache made with another tokenizer or text field, naming both."""
    made = recipe.settings()
    if (ledger.get("tokenizer_sha"), ledger.get("text_field")) == (
        made["tokenizer"],
        made["text_field"],
    ):
        return
    raise DataError(
        f"--cache_dir: {output} was tokenized with {ledger.get('tokenizer')} and --text_field="
        f"{ledger.get('text_field')}, not {recipe.tokenizer} and --text_field={recipe.text_field}; give another "
        "--cache_dir, or the tokenizer and text field it was made with"
    )


def engine_of(ray: RaySettings, head: Optional[str], workers: Optional[int] = None) -> Engine:
    """Where rank 0 tokenizes: on a Ray cluster (the job's own, a running one, a local one) or in its pool
    of `workers` processes (None: one per CPU)."""
    cpus = len(os.sched_getaffinity(0))
    address = head or ray.address
    if address is not None or ray.auto_start_cluster:
        return Engine("ray", cpus, address)
    return Engine("local", cpus if workers is None else workers)


# ---------------------------------------------------------------- a Ray cluster over the job's nodes

READY = "block forever"  # what `ray start --block` prints once its processes are up


@dataclass(frozen=True)
class JobCluster:
    """The job's own Ray cluster: its address, and this rank's `ray start --block` where it started one
    (rank 0 the head, each other node's first rank a worker)."""

    address: str
    node: Optional[subprocess.Popen] = None


def ray_start(*args: str) -> subprocess.Popen:
    """`ray start --block <args>` (the ray beside this Python, else on PATH), once its processes are up;
    ConfigError when it fails. Ending it stops the Ray processes it started, and no other Ray."""
    beside = Path(sys.executable).parent / "ray"
    ray = str(beside) if beside.exists() else shutil.which("ray")
    if ray is None:
        raise ConfigError("--ray_start_workers needs Ray: pip install 'fms-fsdp[ray]'")
    command = [ray, "start", *args, "--block", "--disable-usage-stats", "--log-style=record", "--log-color=false"]
    command.append(f"--dashboard-agent-listen-port={free_port()}")  # not 52365, which another Ray here may hold
    env = {**os.environ, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}  # nothing to drain when it ends
    node = subprocess.Popen(  # a rank killed outright leaves no Ray running
        dying_with_parent(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    assert node.stdout is not None
    last = "no output"
    for line in node.stdout:
        if READY in line:
            threading.Thread(target=deque, args=(node.stdout, 0), daemon=True).start()  # keep its pipe read
            return node
        last = line.strip() or last
    node.wait()
    raise ConfigError(f"--ray_start_workers: `ray start {' '.join(args)}` failed ({last})")


def start_job_cluster() -> JobCluster:
    """Start Ray's head beside rank 0 and a worker on each other node (its first rank)."""
    nodes: list[subprocess.Popen] = []

    def head() -> str:
        port, client = free_port(), f"--ray-client-server-port={free_port()}"  # not 10001: another Ray's, torchrun's
        nodes.append(ray_start("--head", f"--port={port}", client, "--include-dashboard=false"))
        return f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{port}"

    address = on_rank0(head, ConfigError, lambda message: ConfigError(message))
    if dist.is_initialized() and dist.get_rank() != 0 and int(os.environ.get("LOCAL_RANK", 0)) == 0:
        nodes.append(ray_start(f"--address={address}"))
    group = agreement_group()
    if group is not None:
        dist.barrier(group=group)
    return JobCluster(address, nodes[0] if nodes else None)


def stop_job_cluster(cluster: JobCluster) -> None:
    """Stop the job's Ray once the cache is built: each `ray start --block` of it ends with its processes."""
    group = agreement_group()
    if group is not None:
        dist.barrier(group=group)
    if cluster.node is not None:
        cluster.node.terminate()
        try:
            cluster.node.wait(timeout=60)
        except subprocess.TimeoutExpired:
            cluster.node.kill()
            cluster.node.wait()
