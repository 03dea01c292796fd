"""Where this process sits and how it talks to the others: device, process group, rank-0 work.

torchrun's environment gives the ranks; without it (plain `python main_training.py`) a
single-process group on localhost is started. GPUs use NCCL, CPUs gloo. Small CPU objects and
errors travel over gloo groups of their own, so a long wait for rank 0 is fine under NCCL's watchdog.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional, TypeVar

import torch
import torch.distributed as dist

from fms_fsdp.errors import ConfigError, first_line

T = TypeVar("T")

_PR_SET_PDEATHSIG = 1
LAUNCHER_DIED = signal.SIGUSR2  # the parent-death signal of ranks started by torchrun (train.main)
# what asks a rank to save and stop (triggers.StopRequest); its loader workers leave them to the rank
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, LAUNCHER_DIED)


def exit_with_parent(sig: signal.Signals) -> None:
    """Have Linux send `sig` to this process when its parent dies, so that a SIGKILLed launcher (or
    rank) leaves nothing training on; if the parent is already gone, send it now. A no-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)


def lost_peer(error: BaseException) -> bool:
    """Whether a collective failed because another rank is gone: NCCL's and the store's errors, gloo's
    broken connections (plain RuntimeErrors naming gloo)."""
    return isinstance(error, dist.DistError) or (isinstance(error, RuntimeError) and "gloo" in str(error))


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: global and node-local rank, its device, and the tensor-parallel group
    size `tp` (--tensor_parallel_size; its groups are runs of `tp` consecutive ranks, which read the
    same data: the data-parallel rank is rank // tp)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    tp: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def dp_size(self) -> int:
        return self.world_size // self.tp


def free_port() -> int:
    """A TCP port free on localhost now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_device(flag: str, local_rank: int) -> torch.device:
    """--device auto|cuda|cpu -> the torch device of this rank."""
    if flag == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device=cuda: no CUDA device is visible; use --device=cpu or --device=auto")
    if flag == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise ConfigError(
            f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs are visible: "
            "set torchrun's --nproc_per_node to at most the GPU count"
        )
    return torch.device("cuda", local_rank)


def world_from_env() -> tuple[int, int, int, int]:
    """(rank, world size, local rank, local world size) from torchrun's environment; one process
    without it."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return (int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0")),
            int(os.environ.get("LOCAL_WORLD_SIZE", str(world))))


def collective_timeout(minutes: Optional[float]) -> Optional[timedelta]:
    """--collective_timeout_minutes as process groups take it (None: the backend's default)."""
    return None if minutes is None else timedelta(minutes=minutes)


def init_distributed(device_flag: str, timeout_minutes: Optional[float] = None) -> DistInfo:
    """Start the process group: NCCL on GPUs, gloo on CPU, its collectives failing after
    `timeout_minutes` (default: torch's, 10 minutes for NCCL, 30 for gloo). Without torchrun's
    environment, the environment of a single process on localhost is set up first."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    rank, world, local_rank, local_world = world_from_env()
    device = resolve_device(device_flag, local_rank)
    timeout = collective_timeout(timeout_minutes)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl", device_id=device, timeout=timeout)
    else:
        dist.init_process_group(backend="gloo", timeout=timeout)
    return DistInfo(rank, world, local_rank, local_world, device)


def broadcast_from_rank0(obj: T, timeout: timedelta = timedelta(minutes=30)) -> T:
    """Rank 0's `obj` on every rank (every rank calls it), over a gloo group of its own."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    group = dist.new_group(backend="gloo", timeout=timeout)
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    dist.destroy_process_group(group)
    return box[0]


def on_rank0(work: Callable[[], T], user_error: type[Exception], reraise: Callable[[str], Exception],
             timeout: timedelta = timedelta(minutes=30)) -> T:
    """work() on rank 0 only (every rank calls this); its result on every rank. When it raises, every
    rank raises reraise(first line of the message), so none waits for rank 0; rank 0 keeps its own
    traceback for an error that is not a `user_error` (a bug)."""
    result: Optional[T] = None
    error: Optional[Exception] = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            result = work()
        except Exception as e:
            error = e
    failure, result = broadcast_from_rank0((None if error is None else first_line(error), result), timeout)
    if error is not None and not isinstance(error, user_error):
        raise error
    if failure is not None:
        raise reraise(failure)
    return result
