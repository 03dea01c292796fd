"""Fault tolerance across replica groups (--fault_tolerance), on torchft: its lighthouse decides each
step's quorum of live groups, its Manager averages gradients across them and carries a healthy group's
state to one that comes back; no quorum or recovery protocol of our own.

Each replica group is an ordinary torchrun job that shards with FSDP2 inside (TP and CP too, untested). FSDP's
all-reduce hook averages every unit's reduce-scattered gradient shard with the same rank of the other
live groups (torchtitan's choice), so a group is HSDP's replicate dimension that may lose and regain
members. A step (`begin`, forward and backward, `commit`):

- `begin` asks for the quorum (synchronously: a group that comes back loads the live state before its
  forward, and nothing else runs while torchft's thread serves the state, which the training thread
  built) and checks that every live group runs the same model, mesh and shared flags (a fingerprint);
- `commit` exchanges every group's data position with the other live groups (their loader states, in
  the same step as the gradients they produced) and asks torchft whether the step commits: it does
  not when a collective failed (a group died) or fewer than --ft_min_replicas groups took part; the
  loop then runs the same batches again with the groups still alive (`Replay`).

A group that comes back catches up from a live one: model and optimizer (this rank's shards), scheduler,
step, tokens and the table of every group's last committed data position, from which it takes its own:
no sample is lost or repeated. A group with no live peer resumes from its own checkpoints
(<ckpt_save_path>/group_<i>). A watchdog ends a group whose step hangs, so that the lighthouse drops it.

The settings, their start-up checks and the fingerprint are in resilience/ft_settings.py.
"""

from __future__ import annotations

import hashlib
import math
import os
import pickle
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Protocol

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fms_fsdp.compat import local_tensor, quiet_http_transport, tree_map_only
from fms_fsdp.errors import ConfigError, TrainingError, first_line
from fms_fsdp.parallel.process_group import agreement_group
from fms_fsdp.resilience.ft_settings import FTSettings
from fms_fsdp.weights.fused import plain_tensor

Batch = tuple[torch.Tensor, torch.Tensor]
QUORUM_RETRIES = 3  # torchft's own retries of a quorum request to the lighthouse (a brief network failure)


class Guard(Protocol):
    """The step guard (train/guard.py): its state travels with a catching-up group's when it skips bad steps."""

    @property
    def skipping(self) -> bool: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Replay:
    """The loader's batches, each step's kept until it commits: a step that did not commit runs again
    on the same batches (`again`), and after a live load the loader is read from its new position
    (`restart`)."""

    def __init__(self, loader: Any):
        self.loader = loader
        self.it: Iterator[Batch] = iter(loader)
        self.kept: list[Batch] = []
        self.next = 0

    def __iter__(self) -> "Replay":
        return self

    def __next__(self) -> Batch:
        if self.next == len(self.kept):
            self.kept.append(next(self.it))
        self.next += 1
        return self.kept[self.next - 1]

    def committed(self) -> None:
        self.kept, self.next = [], 0

    def again(self) -> None:
        self.next = 0

    def restart(self) -> None:
        self.close()
        self.it, self.kept, self.next = iter(self.loader), [], 0

    def close(self) -> None:
        close = getattr(self.it, "close", None)
        if close is not None:
            close()


class Watchdog:
    """Ends the process when a step makes no progress for `seconds`: a hung group still heartbeats to
    the lighthouse from torchft's own thread, so only its exit lets the others drop it."""

    def __init__(self, seconds: float, say: Callable[[str], None], end: Callable[[int], None] = os._exit):
        self.seconds, self.say, self.end = seconds, say, end
        self.deadline: Optional[float] = None
        self.step = 0
        self.lock = threading.Lock()
        if seconds > 0:
            threading.Thread(target=self._watch, daemon=True, name="ft-watchdog").start()

    def arm(self, step: int) -> None:
        with self.lock:
            self.step, self.deadline = step, time.monotonic() + self.seconds

    def disarm(self) -> None:
        with self.lock:
            self.deadline = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.seconds / 4))
            with self.lock:
                late = self.deadline is not None and time.monotonic() > self.deadline
            if late:
                self.say(
                    f"error: --fault_tolerance: step {self.step} made no progress in {self.seconds:g} s "
                    "(--ft_step_timeout_seconds); this group exits so that the others drop it"
                )
                self.end(1)  # at once: a hung collective would never return to an exception
                return


# a failed collective's cause, as gloo's and NCCL's own text says it (with source paths and more), in a
# few words: the first pattern found in the text
CAUSES = (
    (("timed out", "timeout"), "a collective timed out"),
    (
        ("connection closed", "connection reset", "broken pipe", "connection refused", "peer"),
        "a group's connection broke",
    ),
    (("abort",), "a collective was aborted"),
)


def short_cause(error: BaseException) -> str:
    """Why a collective failed, in a few words (for the line that says a group was dropped)."""
    text = str(error).lower()
    return next((cause for words, cause in CAUSES if any(w in text for w in words)), "a collective failed")


@dataclass
class CaughtUp:
    """A live state loaded from a healthy group: the step and tokens to go on from, and whether it held
    this group's data position (else the group keeps its own, and the batches it holds)."""

    step: int
    tokens_seen: int
    position: bool


def _local(t: torch.Tensor) -> torch.Tensor:
    """A state tensor as this rank holds it: its plain local shard (what a live transfer carries)."""
    t = plain_tensor(t)
    return local_tensor(t) if isinstance(t, DTensor) else t


def _copy_into(mine: Any, theirs: Any) -> None:
    """Copy every tensor of `theirs` into the same place of `mine` (the same structure)."""
    if isinstance(mine, torch.Tensor):
        mine.copy_(theirs)
    elif isinstance(mine, dict):
        for key, value in mine.items():
            _copy_into(value, theirs[key])
    elif isinstance(mine, (list, tuple)):
        for a, b in zip(mine, theirs):
            _copy_into(a, b)


class FaultTolerance:
    """The group's torchft Manager and what the loop asks of it (see the module's docstring)."""

    def __init__(
        self,
        settings: FTSettings,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        loader: Any,
        guard: Guard,
        fingerprint: str,
        device: torch.device,
        say: Callable[[str], None],
    ):
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        self.settings, self.device, self.say = settings, device, say
        self.model, self.optimizer, self.scheduler, self.loader = model, optimizer, scheduler, loader
        self.guard = guard
        self.fingerprint = int.from_bytes(hashlib.sha256(fingerprint.encode()).digest()[:7], "big") + 1
        self.table: dict[int, bytes] = {}  # group -> its loader state at its last committed step
        self.present: list[int] = []  # the groups of the current step
        self.retries, self.retry_s = 0, 0.0
        self.failing, self.failing_since = 0, 0.0  # steps that did not commit in a row, since (monotonic)
        self.drops, self.joins = 0, 0
        self.cause: Optional[str] = None  # why the last step did not commit, in a few words
        self.out_since: dict[int, int] = {}  # a dropped group -> the step it was dropped at
        self.caught_up: Optional[CaughtUp] = None
        self.step = self.first_step = 0
        self._tensors: Optional[dict[str, Any]] = None
        self._live: dict[str, Any] = {}
        pg = (ProcessGroupNCCL if device.type == "cuda" else ProcessGroupGloo)(timeout=settings.timeout)
        self.manager = Manager(
            pg=pg,
            checkpoint_transport=quiet_http_transport(settings.timeout),
            load_state_dict=self._load_live,
            state_dict=lambda: self._live,  # built on the training thread (see publish)
            min_replica_size=settings.min_replicas,
            use_async_quorum=False,
            timeout=settings.timeout,
            quorum_timeout=settings.timeout,
            connect_timeout=settings.timeout,
            lighthouse_addr=settings.lighthouse,
            replica_id=f"group_{settings.index}",
            init_sync=False,  # every group draws the same weights from --seed (or loads the same file)
            quorum_retries=QUORUM_RETRIES,
        )
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_all_reduce_hook(self._average)
        self.watchdog = Watchdog(settings.step_timeout, say)

    def _average(self, shard: torch.Tensor) -> None:
        """FSDP's hook: average a unit's reduce-scattered gradient shard over the live groups."""
        self.manager.allreduce(shard).wait()

    # ---------------------------------------------------------------- start, state

    def resumed(self, step: int, tokens_seen: int) -> None:
        """The step the group starts from (its checkpoint's, or 0): torchft counts steps from it."""
        self.step = self.first_step = step
        self.manager.load_state_dict({"step": step, "batches_committed": 0})
        self._tensors = None  # built once the optimizer has its state (see publish)
        self.publish(step, tokens_seen)

    def _own_tensors(self) -> dict[str, Any]:
        """References to this rank's shards of the model and the optimizer's state (made, at a step of
        learning rate 0, when the optimizer has none yet: only to be loaded into, as that step counts)."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return tree_map_only(torch.Tensor, _local, {"model": model_sd, "optimizer": optim_sd["state"]})

    def publish(self, step: int, tokens_seen: int) -> None:
        """The state a group that comes back would get, built here on the training thread after a
        committed step: references to this rank's shards (updated in place by the optimizer, read by
        torchft's thread only between quorum and commit, when nothing writes them) and copies of the
        small rest."""
        self.step = step
        if self._tensors is None and self.optimizer.state:
            self._tensors = self._own_tensors()
        self._live = {
            "tensors": self._tensors,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
            "scheduler": self.scheduler.state_dict(),
            "guard": self.guard.state_dict() if self.guard.skipping else None,
            "step": step,
            "tokens_seen": tokens_seen,
            "table": dict(self.table),
            "fingerprint": self.fingerprint,
        }

    def _load_live(self, state: dict[str, Any]) -> None:
        """torchft's load (on the training thread, in `begin`): a healthy group's state."""
        if state["fingerprint"] != self.fingerprint:
            raise ConfigError(self._differs("the group it catches up from"))
        if self._tensors is None:
            self._tensors = self._own_tensors()
        _copy_into(self._tensors, state["tensors"])
        for group, theirs in zip(self.optimizer.param_groups, state["param_groups"]):
            group.update(theirs)
        self.scheduler.load_state_dict(state["scheduler"])
        if state["guard"] is not None:
            self.guard.load_state_dict(state["guard"])
        self.table = dict(state["table"])
        own = self.table.get(self.settings.index)
        if own is not None:
            self.loader.load_state_dict(pickle.loads(own))
        self.caught_up = CaughtUp(int(state["step"]), int(state["tokens_seen"]), own is not None)
        self.publish(self.caught_up.step, self.caught_up.tokens_seen)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: every group's data position (a group resumed from an older checkpoint
        takes its position from a group's table)."""
        return {"table": {g: torch.frombuffer(bytearray(b), dtype=torch.uint8) for g, b in self.table.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.table = {int(g): t.numpy().tobytes() for g, t in state["table"].items()}

    # ---------------------------------------------------------------- step

    def begin(self, step: int) -> Optional[CaughtUp]:
        """Before step `step`'s forward: the quorum (a group behind the others loads the live state
        here: returned; the first quorum of a process alone in it waits about --ft_timeout_seconds
        for another group), then every live group's fingerprint; the watchdog is armed from the second step of
        this process (the first compiles)."""
        if self.step > self.first_step:
            self.watchdog.arm(step)
        self.caught_up = None
        self._quorum()
        if not self.present:  # this process's first quorum: alone in it, it waits for the other groups
            attempts = int(self.settings.timeout.total_seconds() / 0.2)  # a count: every rank asks alike
            while self.manager.num_participants() == 1 < self.settings.groups and attempts > 0:
                time.sleep(0.2)
                self._quorum()
                attempts -= 1
        caught_up = self.caught_up
        if caught_up is not None:
            self.say(
                f"ft: group {self.settings.index} caught up from a live group at step {caught_up.step}: weights, "
                "optimizer and its data position"
            )
            self.step = caught_up.step
        self._check_groups(self.step + 1)
        return caught_up

    def _quorum(self) -> None:
        """torchft's quorum (its requests to the lighthouse retried QUORUM_RETRIES times); TrainingError
        in one line when there is none within --ft_timeout_seconds."""
        try:
            self.manager.start_quorum()
        except (ConfigError, TrainingError):  # the live state's own checks (_load_live)
            raise
        except Exception as e:  # the quorum's RPC raises what its transport raised
            raise TrainingError(
                f"--fault_tolerance: no quorum from the lighthouse {self.settings.lighthouse} within "
                f"{self.settings.timeout.total_seconds():g} s ({first_line(e)}): is it running? Started again, this "
                "group resumes from its checkpoint or catches up from a live group"
            ) from None

    def _check_groups(self, step: int) -> None:
        """Which groups take part in `step`, agreed over the live groups; ConfigError in a group that runs
        another model, mesh or flags than most of them (on a tie, than the lowest-numbered group of a kind)."""
        seen = torch.zeros(self.settings.groups, dtype=torch.int64)
        seen[self.settings.index] = self.fingerprint
        seen = self._sum(seen)
        if self.manager.errored() or seen is None:
            return
        present = [g for g in range(self.settings.groups) if seen[g] != 0]
        prints = [int(seen[g]) for g in present]
        most = max(prints, key=lambda p: (prints.count(p), -prints.index(p)))  # ties: the lowest group's
        if self.fingerprint != most:
            raise ConfigError(self._differs(f"group {present[prints.index(most)]}"))
        if self.present and present != self.present:
            gone = sorted(set(self.present) - set(present))
            came = sorted(set(present) - set(self.present))
            self.drops, self.joins = self.drops + len(gone), self.joins + len(came)
            self.out_since.update({g: step for g in gone})
            why = f" ({self.cause})" if self.cause else ""
            changes = [f"group {g} dropped{why}" for g in gone] + [
                f"group {g} joined"
                + (f" (out for {step - self.out_since.pop(g)} steps)" if g in self.out_since else "")
                for g in came
            ]
            self.say(f"ft: step {step}: {'; '.join(changes)}: {len(present)} of {self.settings.groups} groups train on")
        self.present = present

    def _differs(self, other: str) -> str:
        return (
            f"--fault_tolerance: group {self.settings.index} runs another model, mesh or flags than {other}: every "
            "group must run the same flags (model variant, world size, parallelism, batch, data layout, seed, "
            "optimizer, learning-rate schedule, precision) — compare their config.yaml"
        )

    def _sum(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """`t` summed over the live groups (on the host), or None when a collective failed."""
        out = t.to(self.device)
        self.manager.allreduce(out, reduce_op=dist.ReduceOp.SUM).wait()
        return None if self.manager.errored() else out.cpu()

    def commit(self) -> bool:
        """After backward: exchange the groups' data positions after this step (this rank's loader
        state), then torchft's decision; the table keeps the positions of a committed step."""
        positions = self._exchange(pickle.dumps(self.loader.state_dict()))
        ok = self.manager.should_commit()
        if ok:
            self.failing, self.cause = 0, None
            self.table.update(positions or {})
        self.watchdog.disarm()
        return ok

    def _exchange(self, blob: bytes) -> Optional[dict[int, bytes]]:
        """Every live group's `blob` by group (its size, then its bytes, summed over the groups, each
        group in its own row), or None when a collective failed."""
        sizes = torch.zeros(self.settings.groups, dtype=torch.int64)
        sizes[self.settings.index] = len(blob)
        every = self._sum(sizes)
        if every is None:
            return None
        data = torch.zeros(self.settings.groups, int(every.max()), dtype=torch.uint8)
        data[self.settings.index, : len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        rows = self._sum(data)
        if rows is None:
            return None
        return {g: rows[g, : int(n)].numpy().tobytes() for g, n in enumerate(every.tolist()) if n}

    def failed_attempt(self, seconds: float) -> None:
        """A step that did not commit, and the seconds it cost (reported with the interval); TrainingError
        when fewer than --ft_min_replicas groups have been live for --ft_step_timeout_seconds."""
        self.retries += 1
        self.retry_s += seconds
        self.failing += 1
        if self.failing == 1:
            self.failing_since = time.monotonic() - seconds
        error = self.manager.errored()
        limit = self.settings.step_timeout
        # the group's ranks decide alike: on the longest of their clocks, and on whether any saw an error
        seen = torch.tensor([time.monotonic() - self.failing_since, error is not None], dtype=torch.float64)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=agreement_group())
        failing_s, errored = float(seen[0]), bool(seen[1])
        if not errored and limit and failing_s > limit:
            raise TrainingError(
                f"--fault_tolerance: fewer than --ft_min_replicas={self.settings.min_replicas} groups took part "
                f"({len(self.present)}) for {failing_s:.0f} s (--ft_step_timeout_seconds): no step committed; "
                "start the other groups (scripts/train_ft.sh) or lower --ft_min_replicas"
            )
        self.cause = short_cause(error) if error else f"fewer than --ft_min_replicas={self.settings.min_replicas}"
        # the 1st, 10th, 100th ... in a row; a first that lost a group is said by the quorum that drops it
        if math.log10(self.failing) % 1 == 0 and (self.failing > 1 or not error):
            self.say(
                f"ft: step {self.step + 1} did not commit ({len(self.present)} group(s) took part, {self.cause}); "
                "it runs again with the live groups" + (f" ({self.failing} times in a row)" if self.failing > 1 else "")
            )

    def report(self) -> dict[str, Any]:
        """The interval's figures for the metrics record: the groups of the last step, the groups dropped
        and joined, the steps that did not commit and their seconds."""
        record = {
            "ft_groups": len(self.present),
            "ft_dropped": self.drops,
            "ft_joined": self.joins,
            "ft_retries": self.retries,
            "ft_retry_s": round(self.retry_s, 3),
        }
        self.retries, self.retry_s, self.drops, self.joins = 0, 0.0, 0, 0
        return record

    def close(self) -> None:
        self.watchdog.disarm()
        self.manager.shutdown(wait=False)
