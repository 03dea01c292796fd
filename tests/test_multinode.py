"""Two "nodes" of two ranks each, in network namespaces of their own joined by a veth pair: torchrun's
c10d rendezvous and gloo go over those addresses, as between machines. HSDP shards inside a node and
replicates across the two; a node that drops off the network ends the other's ranks after
--collective_timeout_minutes, in one line naming the lost ranks and their dumps, a dead launcher makes every rank save and fail, and the same command on
both resumes exactly."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Optional

import pytest

from fms_fsdp.checkpoint.layout import complete_checkpoints

from conftest import ROOT, TINY
from held_at import wait_held
from test_checkpoint import alive, descendants

NODES = {"a": "10.77.0.1", "b": "10.77.0.2"}
PORT = 29477
TIMEOUT_S = 8  # --collective_timeout_minutes of these runs


def sh(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True)


@pytest.fixture
def two_nodes():
    """Namespaces fms-a and fms-b with veths fms-va / fms-vb (10.77.0.1 / .2); skipped where they
    cannot be made (not root, no iproute2, no CAP_NET_ADMIN in a container)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2's ip to make network namespaces (apt-get install iproute2)")
    tag = uuid.uuid4().hex[:4]
    ns = {n: f"fms-{n}{tag}" for n in NODES}
    try:
        for n in NODES:
            made = sh("ip", "netns", "add", ns[n])
            if made.returncode != 0:
                pytest.skip(f"cannot make a network namespace here: {made.stderr.strip()}")
            sh("ip", "-n", ns[n], "link", "set", "lo", "up")
        steps = [("ip", "link", "add", f"fv{tag}a", "type", "veth", "peer", "name", f"fv{tag}b")]
        for n, addr in NODES.items():
            steps += [
                ("ip", "link", "set", f"fv{tag}{n}", "netns", ns[n]),
                ("ip", "-n", ns[n], "addr", "add", f"{addr}/24", "dev", f"fv{tag}{n}"),
                ("ip", "-n", ns[n], "link", "set", f"fv{tag}{n}", "up"),
            ]
        for step in steps:
            done = sh(*step)
            if done.returncode != 0:
                pytest.skip(f"cannot wire the namespaces ({' '.join(step)}): {done.stderr.strip()}")
        yield {n: (ns[n], f"fv{tag}{n}") for n in NODES}
    finally:
        for name in ns.values():
            sh("ip", "netns", "del", name)


def start_node(
    node: str, two_nodes: dict, args: list[str], held: Optional[tuple[Path, str]] = None
) -> subprocess.Popen:
    """torchrun of one node: 2 ranks, rendezvous at node a's address (node a hosts the store: the
    address is not its hostname's, so torchrun would not guess it), gloo on the node's veth; `held`:
    (folder, point), its ranks held there (tests/held_at.py)."""
    ns, device = two_nodes[node]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": device}
    cmd = [
        "ip",
        "netns",
        "exec",
        ns,
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc_per_node=2",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={NODES['a']}:{PORT}",
        "--rdzv_id=job",
        f"--rdzv_conf=is_host={int(node == 'a')}",
        f"--local_addr={NODES[node]}",
        "--monitor_interval=0.2",
        *([str(ROOT / "tests" / "held_at.py"), str(held[0]), held[1]] if held else []),
        str(ROOT / "main_training.py"),
        *args,
    ]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for_step(out: Path, step: int, nodes: dict) -> None:
    deadline = time.time() + 180
    while max((r["step"] for r in records(out)), default=0) < step:
        assert all(p.poll() is None for p in nodes.values()) and time.time() < deadline, "".join(
            p.stdout.read()[-2000:] for p in nodes.values() if p.poll() is not None
        )
        time.sleep(0.1)


def ended_within(nodes: dict, pids: list[int], seconds: float) -> dict[str, str]:
    """Every process in `pids` is gone within `seconds`; the launchers' outputs."""
    deadline = time.time() + seconds
    while any(alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if alive(p)], "processes outlived the failure"
    return {n: p.communicate(timeout=30)[0] for n, p in nodes.items()}


@pytest.mark.slow
def test_hsdp_across_two_nodes_survives_a_lost_node_or_launcher_and_resumes_exactly(two_nodes, tmp_path):
    out = tmp_path / "run"
    args = [
        *TINY,
        f"--ckpt_save_path={out}",
        "--num_steps=300",
        "--checkpoint_interval=3",
        "--batch_size=2",
        "--sharding_strategy=hsdp",
        "--num_workers=1",
        f"--collective_timeout_minutes={TIMEOUT_S / 60}",
    ]
    held = tmp_path / "held"  # every rank waits before step 5 (tests/held_at.py): the network goes then
    nodes = {n: start_node(n, two_nodes, args, (held, "step:5")) for n in NODES}
    wait_held(
        held, 4, nodes.values(), timeout=180
    )  # a checkpoint at step 3, a step trained after it, no save under way
    # node b drops off the network (no connection is closed, as when a machine dies): node a's ranks
    # give up after --collective_timeout_minutes, in one line
    ns_b, device_b = two_nodes["b"]
    sh("ip", "-n", ns_b, "link", "set", device_b, "down")
    node_a = [nodes["a"].pid, *descendants(nodes["a"].pid)]
    for pid in [nodes["b"].pid, *descendants(nodes["b"].pid)]:
        os.kill(pid, signal.SIGSTOP)  # node b is gone: it neither trains nor notices
    started = time.time()
    (held / "release").touch()  # node a's ranks go into step 5's collectives
    outputs = {"a": ended_within({"a": nodes["a"]}, node_a, TIMEOUT_S + 40)["a"]}
    assert time.time() - started >= TIMEOUT_S * 0.8 and nodes["a"].returncode != 0
    assert "mesh (replicate, shard) = (2, 2)" in outputs["a"]
    # node a's ranks each dump what they were doing; one line names node b's ranks (resilience/hangs.py)
    assert "error: a collective did not complete within --collective_timeout_minutes=" in outputs["a"], outputs["a"]
    assert "ranks 2 (host " in outputs["a"] and "did not reach" in outputs["a"]
    assert sorted(p.name for p in next((out / "diagnostics").iterdir()).iterdir()) == ["rank0.txt", "rank1.txt"]
    for pid in [nodes["b"].pid, *descendants(nodes["b"].pid)]:
        os.kill(pid, signal.SIGKILL)
    nodes["b"].wait()
    sh("ip", "-n", ns_b, "link", "set", device_b, "up")
    first = {r["step"]: r["loss"] for r in records(out)}
    saved = complete_checkpoints(out / "checkpoints")[-1][0]
    assert (max(first), saved) == (4, 3)
    # the same command on both nodes resumes; then only node b's launcher dies: every rank saves and fails
    nodes = {n: start_node(n, two_nodes, args) for n in NODES}
    wait_for_step(out, max(first) + 1, nodes)
    os.kill(nodes["b"].pid, signal.SIGKILL)
    outputs = ended_within(nodes, [nodes["a"].pid, *descendants(nodes["a"].pid)], 20)
    assert nodes["a"].returncode != 0
    assert f"at step {saved}" in outputs["a"]
    assert "error: stopped after step" in outputs["a"] and "the launcher (torchrun) of a rank died" in outputs["a"]
    stopped = complete_checkpoints(out / "checkpoints")[-1][0]
    assert stopped > max(first)
    again = {r["step"]: r["loss"] for r in records(out)[len(first) :]}
    repeated = [s for s in again if s in first]
    assert repeated and all(again[s] == first[s] for s in repeated), (first, again)
