"""Where this process sits and how it talks to the others: device, process group, rank-0 work.

torchrun's environment gives the ranks; without it (plain `python main_training.py`) a
single-process group on localhost is started. GPUs use NCCL, CPUs gloo. Failures, small CPU objects
and rank 0's file work travel over gloo groups of their own, one per wait they allow
(`agreement_group`), so a long wait for rank 0 is fine under NCCL's watchdog.
"""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar, Union

import torch
import torch.distributed as dist

from fms_fsdp.errors import ConfigError, first_line

T = TypeVar("T")


def lost_peer(error: BaseException) -> bool:
    """Whether a collective failed because another rank is gone: NCCL's and the store's errors, gloo's
    broken connections (plain RuntimeErrors naming gloo)."""
    return isinstance(error, dist.DistError) or (isinstance(error, RuntimeError) and "gloo" in str(error))


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: global and node-local rank, its device, the tensor-parallel group size
    `tp` (--tensor_parallel_size), the context-parallel one `cp` (--context_parallel_size) and the
    pipeline's `pp` (--pipeline_parallel_size, outermost: world / pp consecutive ranks per stage). The
    tp x cp consecutive ranks of a group, and the same ranks of every other stage, read the same lines
    (the data-parallel rank is the rank within its stage // (tp x cp)); its cp parts each take a part
    of every line. Made once, by startup.py."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    tp: int
    cp: int = 1
    pp: int = 1
    ft_groups: int = 1  # --fault_tolerance: the job's replica groups, each a torchrun world of its own
    ft_group: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def same_data(self) -> int:
        """The ranks that read the same lines: a tensor-parallel group times a context-parallel one,
        in each pipeline stage."""
        return self.tp * self.cp * self.pp

    @property
    def dp_rank(self) -> int:
        return self.rank % (self.world_size // self.pp) // (self.tp * self.cp)

    @property
    def dp_size(self) -> int:
        return self.world_size // self.same_data

    @property
    def data_rank(self) -> int:
        """The training loader's rank: the data-parallel rank, past those of the lower replica groups
        (--fault_tolerance; evaluation and checkpoints stay inside the group)."""
        return self.ft_group * self.dp_size + self.dp_rank

    @property
    def data_size(self) -> int:
        return self.ft_groups * self.dp_size

    @property
    def first_stage(self) -> bool:
        """Whether this rank is one of the first pipeline stage's (every rank without pipeline
        parallelism)."""
        return self.rank < self.world_size // self.pp

    @property
    def writes_data_state(self) -> bool:
        """Whether this rank writes its data-parallel rank's loader state (one rank of those reading
        the same lines)."""
        return self.first_stage and self.rank % (self.tp * self.cp) == 0


_LOWEST = 30_000  # ports below are other tools' defaults: Ray's (10001-19999), train.sh's rendezvous (20000-29999)


def free_port() -> int:
    """A TCP port free on localhost now, chosen from 30000 up to the kernel's ephemeral range: the
    kernel hands ports from that range to outgoing connections (gloo opens many), so one found free
    there can be taken again before its server binds it; below 30000 lie Ray's default ports and
    train.sh's rendezvous ports."""
    low = _ephemeral_low()
    picks = random.SystemRandom()
    for _ in range(100):
        port = picks.randrange(_LOWEST, low) if low > _LOWEST + 1 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError(f"no free TCP port found in [{_LOWEST}, {low})")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


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
    return (
        int(os.environ.get("RANK", "0")),
        world,
        int(os.environ.get("LOCAL_RANK", "0")),
        int(os.environ.get("LOCAL_WORLD_SIZE", str(world))),
    )


def collective_timeout(minutes: Optional[float]) -> Optional[timedelta]:
    """--collective_timeout_minutes as process groups take it (None: the backend's default)."""
    return None if minutes is None else timedelta(minutes=minutes)


FR_ENTRIES = 2000  # collectives torch's Flight Recorder keeps per process (torchtitan keeps 20000)


def record_collectives(nccl_traces: Optional[str]) -> None:
    """Have torch's Flight Recorder keep the last FR_ENTRIES collectives of this process, gloo's and
    NCCL's (read by resilience/hangs.py when a collective times out), and NCCL's watchdog dump them on a
    timeout to `nccl_traces`<rank> (torchtitan's setting); set before the groups are made. What the user
    set is kept (a buffer size of 0: off)."""
    if "TORCH_FR_BUFFER_SIZE" not in os.environ and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:
        os.environ["TORCH_FR_BUFFER_SIZE"] = str(FR_ENTRIES)
    if nccl_traces is not None:
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        if "TORCH_FR_DUMP_TEMP_FILE" not in os.environ and "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in os.environ:
            os.environ["TORCH_FR_DUMP_TEMP_FILE"] = nccl_traces


def start_process_group(
    device: torch.device,
    timeout_minutes: Optional[float] = None,
    nccl_traces: Optional[str] = None,
    host_tensors: bool = False,
) -> None:
    """Start the process group: NCCL on GPUs (and gloo for the tensors kept on the host with
    `host_tensors`, --cpu_offload: the gradient norm), gloo on CPU, its collectives failing after
    `timeout_minutes` (default: torch's, 10 minutes for NCCL, 30 for gloo), recording them
    (`record_collectives`; NCCL's watchdog dumps them to `nccl_traces`<rank> at a timeout). Without
    torchrun's environment, the environment of a single process on localhost is set up first."""
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
        )
    timeout = collective_timeout(timeout_minutes)
    record_collectives(nccl_traces if device.type == "cuda" else None)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend = "cuda:nccl,cpu:gloo" if host_tensors else "nccl"
        dist.init_process_group(backend=backend, device_id=device, timeout=timeout)
    else:
        dist.init_process_group(backend="gloo", timeout=timeout)


# ------------------------------------------------------------------------------------------ agreement
# Ranks agree on failures and share rank 0's file work over gloo groups of their own (under NCCL too):
# one per wait they allow, made at the first agreement of a process group that needs it, which every
# rank reaches together at start-up (config.yaml, the data scan; the first save in a benchmark).

AGREEMENT_TIMEOUT = timedelta(minutes=30)
_AGREEMENT: dict[Any, Any] = {}  # "world": the default group they belong to; timeout -> its group


def agreement_group(timeout: timedelta = AGREEMENT_TIMEOUT) -> Optional[dist.ProcessGroup]:
    """The gloo group of this process group's agreements whose collectives wait up to `timeout` (every
    rank calls it alike); None without a process group."""
    if not dist.is_initialized():
        return None
    if _AGREEMENT.get("world") is not dist.group.WORLD:
        _AGREEMENT.clear()
        _AGREEMENT["world"] = dist.group.WORLD
    if timeout not in _AGREEMENT:
        _AGREEMENT[timeout] = dist.new_group(backend="gloo", timeout=timeout)
    return _AGREEMENT[timeout]


def stop_process_group() -> None:
    """Tear down the process group and the agreement groups made for it, dropped first: a group still
    referenced here would end its gloo threads only at interpreter exit, where that can abort the
    process ("terminate called without an active exception")."""
    _AGREEMENT.clear()
    dist.destroy_process_group()


def failures(
    error: Optional[BaseException], kind: Callable[[BaseException], str] = lambda e: "error"
) -> list[Optional[tuple[str, str]]]:
    """Every rank's failure as (kind(error), its first line), None for a rank without one, on every rank
    (every rank calls it)."""
    mine = None if error is None else (kind(error), first_line(error))
    group = agreement_group()
    if group is None:
        return [mine]
    every: list[Optional[tuple[str, str]]] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine, group=group)
    return every


def gather_objects(mine: T) -> list[T]:
    """Every rank's `mine` (a small picklable object), on every rank (every rank calls it)."""
    group = agreement_group()
    if group is None:
        return [mine]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine, group=group)
    return every


def on_rank0(
    work: Callable[[], T],
    expected: Union[type, Callable[[BaseException], bool]],
    reraise: Callable[[str], Exception],
    timeout: timedelta = AGREEMENT_TIMEOUT,
) -> T:
    """work() on rank 0 only (every rank calls this); its result on every rank, which waits up to
    `timeout` for it. When it raises, every rank raises reraise(first line of the message), so none
    waits for rank 0; rank 0 keeps its own traceback for an error that is not `expected` (an
    exception type, or a test of the exception: anything else is a bug)."""
    result: Optional[T] = None
    error: Optional[Exception] = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            result = work()
        except Exception as e:
            error = e
    failure = None if error is None else first_line(error)
    group = agreement_group(timeout)
    if group is not None:
        box = [(failure, result)]
        dist.broadcast_object_list(box, src=0, group=group)
        failure, result = box[0]
    if error is not None and not (isinstance(error, expected) if isinstance(expected, type) else expected(error)):
        raise error
    if failure is not None:
        raise reraise(failure)
    return result  # type: ignore[return-value]
