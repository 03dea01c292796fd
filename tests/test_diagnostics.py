"""Stragglers and hangs, with real slowdowns from outside: a rank stopped (SIGSTOP) and continued
(SIGCONT) half of the time is named as the straggler, an undisturbed run names no one; a rank stopped
for good leaves every other rank's dump and one line naming it, and nothing running."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fms_fsdp.resilience.hangs import analyse, read_summaries

from conftest import ROOT, TINY, rank_env, records, start_ranks
from test_checkpoint import alive, descendants

STRAGGLER_RUN = ["--num_steps=20", "--report_interval=4", "--checkpoint_interval=0"]


def toggled(pid: int, stop_s: float, run_s: float, done: threading.Event) -> None:
    """Stop and continue process `pid` (stop_s stopped, run_s running) until `done` or its end; left
    running."""
    try:
        while not done.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stop_s)
            os.kill(pid, signal.SIGCONT)
            time.sleep(run_s)
    except ProcessLookupError:
        pass


def straggler_run(out: Path, stopped_half_the_time: bool) -> tuple[str, list[dict]]:
    """A 2-rank run (rank 1 stopped half of the time, or not): rank 0's output and the records."""
    procs = start_ranks("main_training.py", [*TINY, f"--ckpt_save_path={out}", *STRAGGLER_RUN], 2, rank_env())
    done = threading.Event()
    toggler = threading.Thread(target=toggled, args=(procs[1].pid, 0.02, 0.02, done))
    if stopped_half_the_time:  # from its start: every report interval is slowed alike
        toggler.start()
    with ThreadPoolExecutor(2) as pool:  # drain both ranks' pipes while they run
        outputs = [pool.submit(p.communicate, timeout=240) for p in procs]
        try:
            output = outputs[0].result()[0]
        finally:
            done.set()
            if toggler.is_alive():
                toggler.join()
            outputs[1].result()
    assert procs[0].returncode == 0 and procs[1].returncode == 0, output[-3000:]
    return output, records(out)


@pytest.mark.slow
def test_a_rank_stopped_half_of_the_time_is_named_an_undisturbed_run_names_no_one(tmp_path):
    """Own work is compute (wall time less run-queue waits) and data wait, apart from the waits in
    collectives: the stopped rank's is about twice the other's, on a loaded machine too, while ranks
    that only share the cores with other jobs measure alike."""
    output, slowed = straggler_run(tmp_path / "slowed", True)
    assert [r["slowest_rank"] for r in slowed] == [1] * 5, slowed
    ratios = [r["slowest_rank_ratio"] for r in slowed[1:]]  # one report may fall in a lucky window of the cycle
    assert sum(r > 1.3 for r in ratios) >= 3 and statistics.median(ratios) > 1.5, ratios
    assert all(r["slowest_rank_host"] == os.uname().nodename for r in slowed)
    assert all(0 <= r["slowest_data_wait"] < 1 for r in slowed)
    warnings = [line for line in output.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: rank 1 (host {os.uname().nodename}) is a"), output
    assert "for 3 reports in a row (--straggler_threshold=1.3)" in warnings[0]
    output, calm = straggler_run(tmp_path / "calm", False)
    assert "warning:" not in output, output[-3000:]
    assert len(calm) == 5 and all(r["slowest_rank"] in (0, 1) and r["slowest_rank_ratio"] >= 1 for r in calm)


def summary(rank: int, group: str, seq: int, last: dict[str, int], groups: dict[str, list[int]]) -> dict:
    waited = {"group": group, "desc": "mesh_replicate", "seq": seq, "op": "all_reduce", "sizes": [[8]]}
    return {"rank": rank, "host": f"node{rank // 2}", "waited": waited, "last_enqueued": last, "groups": groups}


def test_the_analysis_names_the_ranks_that_did_not_reach_the_collectives_the_others_wait_in():
    """Two nodes of two ranks, replicate groups {0, 2} ("1") and {1, 3} ("2"): rank 0 waits in group
    1's all-reduce #9, whose rank 2 recorded only #8; rank 1 waits in group 2's #9, and rank 3 wrote
    nothing; rank 2 waits in a later collective of its own shard group {2, 3} ("4")."""
    hosts = ["node0", "node0", "node1", "node1"]
    dumps = {
        0: summary(0, "1", 9, {"1": 9, "3": 9}, {"1": [0, 2], "3": [0, 1]}),
        1: summary(1, "2", 9, {"2": 9, "3": 9}, {"2": [1, 3], "3": [0, 1]}),
        2: summary(2, "4", 9, {"1": 8, "4": 9}, {"1": [0, 2], "4": [2, 3]}),
    }
    line = analyse(dumps, hosts)
    assert line.startswith("ranks 2 (host node1), 3 (host node1) did not reach all_reduce #9 of process group "), line
    assert "and 2 more like it, which ranks 0 (host node0), 1 (host node0), 2 (host node1) waited in" in line
    assert line.endswith("(rank 3 wrote no dump: stopped, stuck outside Python, or gone)")
    assert analyse({r: d for r, d in dumps.items() if r != 2}, hosts).startswith("ranks 2 (host node1), 3 (host")
    everyone = {r: summary(r, "0", 5, {"0": 5}, {"0": [0, 1, 2, 3]}) for r in range(4)}
    assert analyse(everyone, hosts).startswith("every rank reached")


@pytest.mark.slow
def test_a_rank_stopped_for_good_is_named_with_every_other_ranks_dump_and_nothing_is_left(tmp_path):
    """torchrun, 2 ranks, a 6 s collective timeout; rank 1 is stopped for good mid-run: rank 0 dumps
    its stacks and collectives, names rank 1 in one line, and the job ends with no process left,
    within the timeout plus 2 minutes."""
    out, held = tmp_path / "run", tmp_path / "held"
    args = [*TINY, f"--ckpt_save_path={out}", "--num_steps=2000", "--collective_timeout_minutes=0.1"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    # rank 1 waits before step 4 (tests/held_at.py), where it is stopped: rank 0 waits in step 4's first
    # collective every time
    hold = [str(ROOT / "tests" / "held_at.py"), str(held), "step:4@1"]
    proc = subprocess.Popen(
        [*cmd, *hold, "main_training.py", *args],
        cwd=ROOT,
        env=rank_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 180
    while not (held / "held-1").exists():
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.1)
    tree = descendants(proc.pid)
    os.kill(int((held / "held-1").read_text()), signal.SIGSTOP)  # rank 1, for good
    stopped = time.time()
    assert [r["step"] for r in records(out)] == [1, 2, 3]
    output = proc.communicate(timeout=6 + 120)[0]
    assert time.time() - stopped < 6 + 120 and proc.returncode != 0
    assert not [p for p in tree if alive(p)], "processes outlived the hang"
    (line,) = [line for line in output.splitlines() if line.startswith("error: a collective did not complete")]
    host = os.uname().nodename
    assert f"within --collective_timeout_minutes=0.1: rank 1 (host {host}) did not reach " in line, line
    assert f"which rank 0 (host {host}) waited in (rank 1 wrote no dump" in line
    (folder,) = (out / "diagnostics").iterdir()
    assert f"{folder}/rank<N>.txt" in line
    assert [p.name for p in folder.iterdir()] == ["rank0.txt"]
    dump = (folder / "rank0.txt").read_text()
    assert "Timed out waiting" in dump and "Thread MainThread (main):" in dump
    assert "in accumulate" in dump, dump  # step 4's forward: rank 1 never began it
    waited = read_summaries(folder)[0]["waited"]
    assert waited["seq"] > 0 and waited["op"] in line and f"#{waited['seq']} " in line
    table = dump.split("== last collectives")[1].splitlines()
    assert any(row.endswith("<- the newest: waited in") and f"\t{waited['seq']}\t" in row for row in table), table
    assert json.loads(dump.split("summary: ")[1].splitlines()[0])["rank"] == 0


def test_the_trackers_get_the_slowest_ranks_host_as_text_and_its_figures_as_numbers(tmp_path, monkeypatch, capsys):
    """A record's text (the host) goes to TensorBoard and Aim as text; no tracker is switched off by it
    (W&B takes text as it takes numbers: not started here, its offline service costs ~10 s)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fms_fsdp.flags import parse_args
    from fms_fsdp.metrics.trackers import start_trackers
    from fms_fsdp.settings import trackers_of

    cfg = parse_args([*TINY, f"--ckpt_save_path={tmp_path}", "--tracker=tensorboard,aim"])
    trackers = start_trackers(trackers_of(cfg), tmp_path)
    record = {"step": 4, "loss": 1.5, "slowest_rank": 3, "slowest_rank_host": "node7", "slowest_rank_ratio": 2.5}
    trackers.log(record)
    assert set(trackers.trackers) == {"tensorboard", "aim"}, capsys.readouterr().out
    trackers.close()
    assert "warning" not in capsys.readouterr().out
    ids = json.loads((tmp_path / "tracker_runs.json").read_text())
    events = EventAccumulator(str(tmp_path / "tracker" / "tensorboard" / ids["tensorboard"]))
    events.Reload()
    assert {"slowest_rank", "slowest_rank_ratio"} <= set(events.Tags()["scalars"])
    assert any(tag.startswith("slowest_rank_host") for tag in events.Tags()["tensors"])
    import aim
    from aim.storage.context import Context

    run = aim.Run(run_hash=ids["aim"], repo=str(tmp_path / "tracker"), system_tracking_interval=None)
    try:
        names = {sequence.name for sequence in run.metrics()}
        steps, (texts, *_) = run.get_text_sequence("slowest_rank_host", Context({})).data.items_list()
    finally:
        run.close()
    assert {"slowest_rank", "slowest_rank_ratio"} <= names and [t.data for t in texts] == ["node7"] and steps == [4]
