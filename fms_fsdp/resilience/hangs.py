"""A hang explained: what every rank was doing when a collective did not complete within
--collective_timeout_minutes, and one line naming the ranks that did not arrive.

torch's Flight Recorder keeps each process's last collectives (every process group's, gloo's and
NCCL's: group, sequence number, operation, sizes, state); process_group.start_process_group turns it
on. When a training collective times out, every rank still alive writes
<ckpt_save_path>/diagnostics/<time>/rank<N>.txt (<time>: when this launch started, agreed at start-up):
its Python stacks (all threads) and its last collectives, led by a `summary:` line of JSON. It waits a
little for the others' files, then the lowest rank that wrote one names, in the run's one error line,
the ranks (with their hosts) that did not reach the collective the others wait in: those whose record
stops before it, and those that wrote nothing (stopped, stuck outside Python, or gone). Then the run
ends as on any lost peer. docs/troubleshooting.md shows how to read the files. On NCCL, torch's
watchdog ends the process at a timeout itself, after dumping the same record (run.Paths.nccl_traces).

A rank whose peer died outright (a closed connection, not a timeout) ends at once, without dumps.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from fms_fsdp.atomic import write_text_atomic
from fms_fsdp.compat import flight_recorder_dump, group_members
from fms_fsdp.errors import TrainingError, first_line
from fms_fsdp.parallel.process_group import gather_objects, lost_peer
from fms_fsdp.storage import make_folder, storage_error

LISTED = 64  # of them, the newest listed in a dump
GRACE_S = (10.0, 60.0)  # the wait for the other ranks' dumps: the timeout, within these bounds


def timed_out(error: BaseException) -> bool:
    """Whether a collective failed by timing out (gloo's "Timed out waiting", NCCL's watchdog timeout),
    not because a peer closed its connections."""
    text = str(error).lower()
    return lost_peer(error) and ("timed out" in text or "timeout" in text)


@dataclass(frozen=True)
class HangDiagnostics:
    """Where and how this rank writes its dump; `hosts`: every rank's host name."""

    folder: Path
    rank: int
    hosts: list[str]
    timeout_minutes: Optional[float]

    @staticmethod
    def start(*, folder: Path, rank: int, timeout_minutes: Optional[float]) -> "HangDiagnostics":
        """Every rank's host and rank 0's start time, gathered (every rank calls it, at start-up, once
        the run holds its folder): dumps go to <folder>/<rank 0's start time>."""
        mine = (socket.gethostname(), time.strftime("%Y%m%d-%H%M%S", time.gmtime()))
        every = gather_objects(mine)
        hosts = [host for host, _ in every]
        return HangDiagnostics(folder / every[0][1], rank, hosts, timeout_minutes)

    @staticmethod
    def started(device: torch.device, nccl_traces: Optional[str]) -> None:
        """On GPUs, the folder NCCL writes its own dumps to (`nccl_traces`, a file prefix), made once the
        start has succeeded (a failed start leaves no folder behind)."""
        if device.type == "cuda" and nccl_traces is not None:
            make_folder(Path(nccl_traces).parent)

    def diagnose(self, error: BaseException) -> TrainingError:
        """Write this rank's dump, wait for the others', and make the run's error line (said by the
        lowest rank that wrote a dump)."""
        summary, text = describe(self.rank, self.hosts[self.rank], error)
        try:
            make_folder(self.folder)
            write_text_atomic(self.folder / f"rank{self.rank}.txt", text)
        except Exception as e:
            if not storage_error(e):
                raise
            return TrainingError(
                f"{what_timed_out(self.timeout_minutes)}; cannot write {self.folder} ({type(e).__name__}: "
                f"{first_line(e)}); run the same command again to resume from the last checkpoint",
                every_rank=False,
            )
        first = min(self._wait_for_dumps() | {self.rank})
        where = (
            f"each rank's stacks and last collectives: {self.folder}/rank<N>.txt (docs/troubleshooting.md); "
            "run the same command again to resume from the last checkpoint"
        )
        if self.rank != first:  # its line is rank `first`'s to say
            return TrainingError(f"{what_timed_out(self.timeout_minutes)}: rank {first}'s line names who; {where}")
        dumps = read_summaries(self.folder)
        dumps[self.rank] = summary
        return TrainingError(
            f"{what_timed_out(self.timeout_minutes)}: {analyse(dumps, self.hosts)}; {where}", every_rank=False
        )

    def _wait_for_dumps(self) -> set[int]:
        """The ranks that wrote a dump, once every rank did or the grace period is over (names only:
        a thousand ranks poll the folder)."""
        grace = min(max(60 * (self.timeout_minutes or 1.0), GRACE_S[0]), GRACE_S[1])
        deadline = time.monotonic() + grace
        while True:
            dumped = {int(m.group(1)) for p in self.folder.iterdir() if (m := re.fullmatch(r"rank(\d+)\.txt", p.name))}
            if len(dumped) >= len(self.hosts) or time.monotonic() > deadline:
                return dumped
            time.sleep(0.5)


def what_timed_out(timeout_minutes: Optional[float]) -> str:
    limit = "torch's default" if timeout_minutes is None else f"--collective_timeout_minutes={timeout_minutes:g}"
    return f"a collective did not complete within {limit}"


def describe(rank: int, host: str, error: BaseException) -> tuple[dict[str, Any], str]:
    """(summary, text) of this rank's dump: its Python stacks and its last collectives."""
    record = flight_recorder_dump()
    entries = (record or {}).get("entries", [])
    collectives = [e for e in entries if not e.get("is_p2p")]  # a pipeline's sends are listed, not analysed
    last: dict[str, int] = {}
    for entry in collectives:
        last[entry["process_group"][0]] = max(last.get(entry["process_group"][0], 0), entry["collective_seq_id"])
    waited = max(collectives, key=lambda e: e["time_created_ns"]) if collectives else None
    members = group_members()
    summary = {
        "rank": rank,
        "host": host,
        "waited": None if waited is None else _collective(waited),
        "last_enqueued": last,
        "groups": {group: members[group] for group in last if group in members},
    }
    lines = [
        f"rank {rank} on host {host} (pid {os.getpid()}) at {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        f"error: {first_line(error)}",
        "summary: " + json.dumps(summary),
        "",
        "== Python stacks, every thread (the main thread's down to the collective that failed) ==",
        *_stacks(error),
        "",
        "== last collectives (torch's Flight Recorder, newest last) ==",
    ]
    if record is None:
        lines.append("(none: this torch release keeps no Flight Recorder, or TORCH_FR_BUFFER_SIZE=0)")
    lines.append("group\tdesc\tseq\toperation\tinput sizes\tdtypes\tstate")
    for entry in entries[-LISTED:]:
        group, desc = entry["process_group"]
        state = entry["state"] + (", retired" if entry.get("retired") else "")
        mark = "\t<- the newest: waited in" if entry is waited else ""
        lines.append(
            f"{group}\t{desc}\t{entry['collective_seq_id']}\t{entry['profiling_name']}\t{entry['input_sizes']}\t"
            f"{','.join(entry['input_dtypes'])}\t{state}{mark}"
        )
    return summary, "\n".join(lines) + "\n"


def _collective(entry: dict[str, Any]) -> dict[str, Any]:
    """A Flight Recorder entry as a dump's summary gives it."""
    group, desc = entry["process_group"]
    return {
        "group": group,
        "desc": desc,
        "seq": entry["collective_seq_id"],
        "op": entry["profiling_name"].split(":")[-1],
        "sizes": entry["input_sizes"],
    }


def _stacks(error: BaseException) -> list[str]:
    """Every Python thread's stack: the main thread's from the program's start down to where `error`
    was raised, the others' as they are now."""
    tb = error.__traceback__
    main = (traceback.extract_stack(tb.tb_frame.f_back) if tb else []) + traceback.extract_tb(tb)
    lines = ["Thread MainThread (main):", *traceback.format_list(main)]
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        if ident != threading.main_thread().ident:
            lines += [f"Thread {names.get(ident, ident)}:", *traceback.format_stack(frame)]
    return [line.rstrip("\n") for line in lines]


def read_summaries(folder: Path) -> dict[int, dict[str, Any]]:
    """The `summary:` line of every rank<N>.txt in `folder`, by rank."""
    found = {}
    for path in folder.glob("rank*.txt"):
        try:
            with path.open() as f:
                line = next((line for line in f if line.startswith("summary: ")), None)
        except OSError:
            continue
        if line is not None:
            summary = json.loads(line.removeprefix("summary: "))
            found[summary["rank"]] = summary
    return found


def analyse(dumps: dict[int, dict[str, Any]], hosts: list[str]) -> str:
    """Which ranks did not reach the collectives the dumped ranks wait in: a member of the group whose
    record stops before it, or a rank that wrote no dump."""
    silent = [r for r in range(len(hosts)) if r not in dumps]
    behind, waiting, waits = set(silent), [], Counter[str]()
    for rank, dump in sorted(dumps.items()):
        waited = dump["waited"]
        if waited is None:
            continue
        group, seq = waited["group"], waited["seq"]
        members = dump.get("groups", {}).get(group, range(len(hosts)))
        late = [r for r in members if r not in dumps or dumps[r]["last_enqueued"].get(group, 0) < seq]
        behind.update(late)
        if late:
            waiting.append(rank)
            waits[json.dumps(waited, sort_keys=True)] += 1
    if not waits:
        if not silent:
            return "every rank reached the collectives the others wait in (a hang inside one: see the dumps)"
        return f"{_ranks(silent, hosts)} wrote no dump (stopped, stuck outside Python, or gone)"
    first, _ = waits.most_common(1)[0]
    waited = json.loads(first)
    what = (
        f"{waited['op']} #{waited['seq']} of process group {waited['group']} ({waited['desc'] or 'unnamed'}, "
        f"input sizes {waited['sizes']})" + (f" and {len(waits) - 1} more like it" if len(waits) > 1 else "")
    )
    line = f"{_ranks(sorted(behind), hosts)} did not reach {what}, which {_ranks(waiting, hosts)} waited in"
    if silent:
        line += f" ({_ranks(silent, hosts, hosts_too=False)} wrote no dump: stopped, stuck outside Python, or gone)"
    return line


def _ranks(ranks: Any, hosts: list[str], hosts_too: bool = True) -> str:
    ranks = list(ranks)
    if not ranks:
        return ""
    word = "rank" if len(ranks) == 1 else "ranks"
    if not hosts_too:
        return f"{word} {', '.join(map(str, ranks))}"
    return f"{word} " + ", ".join(f"{r} (host {hosts[r]})" for r in ranks)
