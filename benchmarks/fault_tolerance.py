"""Cluster time lost per failure: fault tolerance (--fault_tolerance, replica groups on torchft) against a
restart from the last checkpoint, at the same settings, measured on this machine, then modelled for a
cluster.

    python benchmarks/fault_tolerance.py [--kill_after=20] [--checkpoint_interval=20]
        [--heartbeat_timeout_ms=1000] [--gpus=1024] [--group_gpus=8] [--hours_between_failures=3]
        [--restart_minutes=10] [--checkpoint_minutes=60] [training flags ...]

Fault tolerance: a lighthouse and 2 replica groups of --nproc ranks (torchrun each); group 1 is
SIGKILLed after step --kill_after and started again with the same command. Measured: the healthy
group's stall (its steps around the drop, less the median step) and the killed group's time from its
restart to training again (caught up live). Plain: the same job as one torchrun of 2 x --nproc ranks
(HSDP), killed after the same step and started again: the time from the restart to its first step,
plus the steps since its last checkpoint, trained again. Training flags default to `tiny` on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fms_fsdp.parallel.process_group import free_port  # noqa: E402

TRAIN = [
    "--model_variant=tiny",
    "--device=cpu",
    "--use_dummy_dataset=True",
    "--use_torch_compile=False",
    "--mixed_precision=False",
    "--batch_size=2",
    "--seq_length=256",
    "--report_interval=1",
    "--num_steps=100000",
    "--sharding_strategy=fsdp",
]


def torchrun(nproc: int, args: list[str], log: Path) -> subprocess.Popen:
    """A torchrun job in a session of its own (killed whole with killpg)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port"]
    cmd += [str(free_port()), str(ROOT / "main_training.py"), *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def records(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def until(condition, what: str, timeout: float = 300) -> float:
    """Seconds until `condition()` holds."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise SystemExit(f"error: timed out waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - start


def stop(*jobs: subprocess.Popen) -> None:
    for job in jobs:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGTERM)
    for job in jobs:
        job.wait(120)


def fault_tolerant(tmp: Path, args: argparse.Namespace, flags: list[str]) -> dict[str, float]:
    port = free_port()
    lighthouse = subprocess.Popen(
        [str(Path(sys.executable).parent / "torchft_lighthouse"), "--min_replicas=1", f"--bind=[::]:{port}"]
        + [f"--heartbeat_timeout_ms={args.heartbeat_timeout_ms}", "--join_timeout_ms=1000"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    run = [*flags, "--fault_tolerance=True", "--ft_replica_groups=2", f"--ft_lighthouse=127.0.0.1:{port}"]
    run += [f"--ckpt_save_path={tmp / 'ft'}"]
    try:
        first = torchrun(args.nproc, [*run, "--ft_group_index=0"], tmp / "ft0.log")
        second = torchrun(args.nproc, [*run, "--ft_group_index=1"], tmp / "ft1.log")
        until(lambda: len(records(tmp / "ft" / "group_1")) >= args.kill_after, "the kill step")
        os.killpg(second.pid, signal.SIGKILL)
        killed = time.monotonic()
        second.wait()
        again = torchrun(args.nproc, [*run, "--ft_group_index=1"], tmp / "ft1b.log")
        back = time.monotonic() - killed
        back += until(lambda: "caught up from a live group" in (tmp / "ft1b.log").read_text(), "the catch-up")
        until(lambda: len(records(tmp / "ft" / "group_0")) > args.kill_after + 10, "steps after the kill")
        stop(first, again)
    finally:
        lighthouse.kill()
    history = records(tmp / "ft" / "group_0")
    typical = statistics.median(r["step_time"] for r in history[2:])
    around = history[args.kill_after - 1 : args.kill_after + 4]
    stall = sum(max(0.0, r["step_time"] - typical) for r in around)
    return {"step_s": typical, "stall_s": stall, "rejoin_s": back}


def plain(tmp: Path, args: argparse.Namespace, flags: list[str]) -> dict[str, float]:
    run = [*flags, f"--ckpt_save_path={tmp / 'plain'}"]
    job = torchrun(2 * args.nproc, run, tmp / "plain.log")
    until(lambda: len(records(tmp / "plain")) >= args.kill_after, "the kill step")
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    done = len(records(tmp / "plain"))
    again = torchrun(2 * args.nproc, run, tmp / "plain_again.log")
    restart = until(lambda: "resumed from" in (tmp / "plain_again.log").read_text(), "the resume")
    first_step = until(lambda: len(records(tmp / "plain")) > done, "the first step after the resume")
    stop(again)
    redone = done - done // args.checkpoint_interval * args.checkpoint_interval
    typical = statistics.median(r["step_time"] for r in records(tmp / "plain")[2:])
    return {"step_s": typical, "restart_s": restart + first_step, "redone_steps": redone}


def model(args: argparse.Namespace) -> tuple[float, float]:
    """GPU-hours lost per failure at --gpus: (restart from the last checkpoint, fault tolerance)."""
    restart_h, half_interval_h = args.restart_minutes / 60, args.checkpoint_minutes / 120
    plain_h = args.gpus * (restart_h + half_interval_h)
    ft_h = args.group_gpus * restart_h + (args.gpus - args.group_gpus) * args.heartbeat_timeout_ms / 3.6e6
    return plain_h, ft_h


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks per replica group")
    parser.add_argument("--kill_after", type=int, default=20)
    parser.add_argument("--checkpoint_interval", type=int, default=20)
    parser.add_argument("--heartbeat_timeout_ms", type=int, default=1000)
    parser.add_argument("--gpus", type=int, default=1024)
    parser.add_argument("--group_gpus", type=int, default=8)
    parser.add_argument("--hours_between_failures", type=float, default=3.0)
    parser.add_argument("--restart_minutes", type=float, default=10.0)
    parser.add_argument("--checkpoint_minutes", type=float, default=60.0)
    args, training = parser.parse_known_args(argv)
    flags = [*TRAIN, f"--checkpoint_interval={args.checkpoint_interval}", *training]
    with tempfile.TemporaryDirectory() as tmp:
        ft = fault_tolerant(Path(tmp), args, flags)
        base = plain(Path(tmp), args, flags)
    ranks = 2 * args.nproc
    ft_lost = (
        ft["stall_s"] * args.nproc + ft["rejoin_s"] * args.nproc
    )  # the healthy group's stall, the dead one's return
    plain_lost = (base["restart_s"] + base["redone_steps"] * base["step_s"]) * ranks
    print(
        f"BENCH ft step_s={ft['step_s']:.3f} stall_s={ft['stall_s']:.2f} rejoin_s={ft['rejoin_s']:.1f} "
        f"lost_rank_s={ft_lost:.1f}"
    )
    print(
        f"BENCH plain step_s={base['step_s']:.3f} restart_s={base['restart_s']:.1f} redone_steps={base['redone_steps']} "
        f"lost_rank_s={plain_lost:.1f}"
    )
    plain_h, ft_h = model(args)
    per_day = 24 / args.hours_between_failures
    print(
        f"MODEL {args.gpus} GPUs, groups of {args.group_gpus}, a failure every {args.hours_between_failures:g} h, "
        f"restart {args.restart_minutes:g} min, checkpoint every {args.checkpoint_minutes:g} min: "
        f"lost per failure {plain_h:.1f} GPU-h (restart) vs {ft_h:.2f} GPU-h (fault tolerance); per day "
        f"{plain_h * per_day / (args.gpus * 24):.1%} vs {ft_h * per_day / (args.gpus * 24):.2%} of the cluster"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
