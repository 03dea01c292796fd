"""Where `fms-prepare-data`'s pieces run: this machine's process pool, or tasks on a Ray cluster (an
existing one at --ray_address, or a local one started and stopped here). Either way a worker is given
the piece and the tokenizer's text, and returns the piece's marker: it needs no shared filesystem, only
access to the input and output (a local path, or object storage)."""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from fms_fsdp.errors import ConfigError, DataError, first_line
from fms_fsdp.lifetime import pool_worker
from fms_fsdp.storage import storage_settings

ENGINES = ("local", "ray")
POOL_RESTARTS = 3
Result = tuple[Any, dict]  # (the piece, its marker)


def run_local(
    work: Callable[[Any], Result],
    init: Callable[[Optional[str]], None],
    jobs: list,
    tokenizer: Optional[str],
    workers: int,
) -> Iterator[Result]:
    """work(job) for every job in `workers` processes (in this one when 1), in order of completion. A
    worker that dies (killed, out of memory) costs only time: the jobs it left are run again in a new
    pool, up to POOL_RESTARTS times."""
    if workers <= 1:
        init(tokenizer)
        yield from map(work, jobs)
        return
    left = dict(enumerate(jobs))
    for _ in range(POOL_RESTARTS + 1):
        try:
            for index, result in _pooled(work, init, left, tokenizer, workers):
                del left[index]
                yield result
            return
        except (BrokenProcessPool, BrokenPipeError):  # the latter: a worker killed while the pool started it
            print(
                f"warning: a worker of the process pool died; {len(left)} unfinished pieces run again", file=sys.stderr
            )
    raise DataError(
        f"the process pool's workers died {POOL_RESTARTS + 1} times (out of memory? see `dmesg`); finished "
        "pieces are kept: run the same command again, with fewer --workers"
    )


def _pooled(
    work: Callable[[Any], Result],
    init: Callable[[Optional[str]], None],
    jobs: dict[int, Any],
    tokenizer: Optional[str],
    workers: int,
) -> Iterator[tuple[int, Result]]:
    """(index, work(job)) for `jobs` in a pool of processes forked from a server that runs no threads
    (a fork of a process with threads, a tracker's for one, can abort the child)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([m for m in (work.__module__,) if m != "__main__"])  # imported once
    setup = (init, tokenizer, dict(os.environ))  # the fork server's environment is that of its own start
    pool = ProcessPoolExecutor(min(workers, len(jobs)), mp_context=context, initializer=_start_worker, initargs=setup)
    finished = False
    try:
        futures = {pool.submit(work, job): index for index, job in jobs.items()}
        for done in as_completed(futures):
            yield futures[done], done.result()
        finished = True
    except (BrokenProcessPool, BrokenPipeError):  # a worker died: end the others, or the pool waits on them for ever
        for process in list((pool._processes or {}).values()):
            process.kill()
        raise
    finally:  # on an error or a stop, the pieces not started are dropped and the running ones left to end
        pool.shutdown(wait=finished, cancel_futures=True)


def _start_worker(init: Callable[[Optional[str]], None], tokenizer: Optional[str], environ: dict[str, str]) -> None:
    """A worker with its caller's environment (object storage's settings among it) and the tokenizer."""
    os.environ.clear()
    os.environ.update(environ)
    pool_worker()  # ends with its pool or its parent, also inside a training rank
    init(tokenizer)


def run_ray(
    work: Callable[[Any, Optional[str]], Result],
    jobs: list,
    tokenizer: Optional[str],
    address: Optional[str],
    workers: int,
) -> Iterator[Result]:
    """work(job, tokenizer) for every job as a Ray task (retried when its worker dies), in order of
    completion; this package and this process's object-storage settings travel to the workers with the
    tasks."""
    ray = _import_ray()
    package = Path(__file__).resolve().parents[2]  # fms_fsdp/, shipped whole to the workers
    runtime_env = {
        "py_modules": [str(package)],
        "excludes": ["__pycache__"],
        "env_vars": {"TOKENIZERS_PARALLELISM": "false", **storage_settings()},  # a bucket's endpoint, keys
    }
    try:
        if address:
            ray.init(address=address, runtime_env=runtime_env, logging_level=logging.ERROR, log_to_driver=False)
        else:
            ray.init(  # a Ray of its own, even beside a cluster running on this machine
                address="local",
                num_cpus=workers,
                runtime_env=runtime_env,
                include_dashboard=False,
                logging_level=logging.ERROR,
                log_to_driver=False,
            )
    except ConnectionError as e:
        raise ConfigError(
            f"--ray_address={address}: no Ray cluster there ({e}); start one with `ray start --head`"
        ) from None
    try:
        task = ray.remote(num_cpus=1, max_retries=3)(work)
        tokenizer_ref = ray.put(tokenizer)
        pending = [task.remote(job, tokenizer_ref) for job in jobs]
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                yield ray.get(done[0])
            except ray.exceptions.RayTaskError as e:
                if isinstance(e.cause, (DataError, ConfigError)):
                    raise e.cause from None  # the worker's own error, naming the file
                raise DataError(f"--engine=ray: a task failed ({first_line(e.cause or e)})") from None
            except ray.exceptions.RayError as e:  # a worker lost for good (after its retries), a node gone
                raise DataError(
                    f"--engine=ray: {type(e).__name__} ({first_line(e)}); run the same command again: finished "
                    "pieces are kept"
                ) from None
    finally:
        ray.shutdown()


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError("--engine=ray needs Ray: pip install 'fms-fsdp[ray]'") from None
    return ray
