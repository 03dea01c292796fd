"""Training throughput on synthetic data: tokens/s/GPU, achieved TFLOP/s, MFU and peak memory.

One setting (under torchrun, or plain python for one process):

    torchrun --nproc_per_node=1 benchmarks/throughput.py --model_variant=llama3_1.8b_4k \
        --batch_size=2 --seq_length=4096 --use_torch_compile=True --num_steps=30 [--bench_skip=10]

A sweep (plain python: each setting runs in processes of its own, under torchrun when
--nproc_per_node > 1, so an out-of-memory or any other failure is one line and the sweep goes on):

    python benchmarks/throughput.py --sweep="batch_size:1,2,4;selective_checkpointing:0,1/2,1" \
        [--nproc_per_node=1] [--setting_timeout=3600] --model_variant=llama3_1.8b_4k --num_steps=30 ...

A pipeline-parallel sweep first trains the same global batch on one rank and adds each setting's
measured bubble (1 - its tokens/s per GPU over one rank's):

    python benchmarks/throughput.py --nproc_per_node=2 --pipeline_parallel_size=2 --batch_size=8 \
        --sweep="pipeline_schedule:GPipe,1F1B,Interleaved1F1B,ZBVZeroBubble" --model_variant=tiny --device=cpu ...

Takes every training flag (use_dummy_dataset is forced on and checkpoint_interval to 0: a
benchmark writes no checkpoint; report_interval defaults to 5, as a report waits for the device). In a sweep, selective_checkpointing
turns activation checkpointing on, 0 off. Report intervals that start within the first --bench_skip steps
(compilation, allocator warm-up) are left out of the figures; the rest are summarised by their median. Rank 0 prints one
`BENCH key=value ...` line per setting, and a sweep one `BEST ...` line.
"""

from __future__ import annotations

import itertools
import os
import statistics
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from fms_fsdp.cli import USER_ERRORS, fail
from fms_fsdp.config import train_config  # noqa: E402
from fms_fsdp.console import quiet_library_noise
from fms_fsdp.errors import ConfigError  # noqa: E402
from fms_fsdp.flags import parse_args  # noqa: E402
from fms_fsdp.model.variants import flops_per_token  # noqa: E402
from fms_fsdp.startup import facts  # noqa: E402
from fms_fsdp.train.loop import run_training  # noqa: E402

FORCED = ["--use_dummy_dataset=True", "--checkpoint_interval=0"]
DEFAULTS = ["--report_interval=5"]  # a report reads the device: per-step reports would measure syncs


def sweep_settings(spec: str) -> list[list[str]]:
    """'batch_size:1,2;selective_checkpointing:0,1/2' -> the flags of every combination, in order;
    ConfigError naming --sweep for a malformed spec or an unknown flag."""
    known = {f.name for f in fields(train_config)}
    axes = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, sep, values = part.partition(":")
        name = name.strip()
        if not sep or not values.strip():
            raise ConfigError(f"--sweep: {part!r} is not name:value,value,...")
        if name not in known:
            raise ConfigError(f"--sweep: unknown flag {name!r}")
        axes.append([(name, v.strip()) for v in values.split(",")])
    if not axes:
        raise ConfigError("--sweep: no settings; e.g. --sweep='batch_size:1,2,4;selective_checkpointing:0,1/2,1'")
    settings = []
    for combo in itertools.product(*axes):
        flags = []
        for name, value in combo:
            if name == "selective_checkpointing":
                on = value not in ("0", "0.0")
                flags.append(f"--fsdp_activation_checkpointing={on}")
                if not on:
                    continue
            flags.append(f"--{name}={value}")
        settings.append(flags)
    return settings


def run_sweep(spec: str, nproc: int, flags: list[str], timeout: float) -> None:
    """Each setting in processes of its own; one line per setting, then the best. A pipeline-parallel
    sweep first runs the same global batch on one rank (setting=one_rank), and each setting's line
    adds its measured bubble: the share of its ranks' time not spent on one rank's work, 1 - tokens/s
    per GPU over one rank's (idle time and the stages' sends together)."""
    best: Optional[tuple[float, str]] = None
    training = [f for f in flags if not f.startswith("--bench_skip=")]
    pipeline = parse_args([*DEFAULTS, *training, *FORCED]).pipeline_parallel_size > 1 or "pipeline" in spec
    one_rank = None
    if pipeline:  # torchrun gives each rank one thread: so does the one-rank run
        line = run_setting("one_rank", 1, [*flags, "--pipeline_parallel_size=1"], timeout, {"OMP_NUM_THREADS": "1"})
        print(line, flush=True)
        one_rank = _tps(line)
    for setting in sweep_settings(spec):
        label = ",".join(f.lstrip("-") for f in setting)
        line = run_setting(label, nproc, [*flags, *setting], timeout)
        tps = _tps(line)
        if tps is not None and one_rank:
            line += f" bubble={1 - tps / one_rank:.3f}"
        if tps is not None and (best is None or tps > best[0]):
            best = (tps, line)
        print(line, flush=True)
    print("BEST " + (best[1].split(" ", 1)[1] if best else "none: every setting failed"), flush=True)


def run_setting(label: str, nproc: int, flags: list[str], timeout: float, env: Optional[dict] = None) -> str:
    """The BENCH line of one setting run in processes of its own (torchrun for more than one)."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
    command = [sys.executable, *launcher, __file__, *flags]
    try:
        proc = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
        )
    except subprocess.TimeoutExpired:
        return f"BENCH setting={label} status=timeout message='no result in {timeout} s'"
    out = proc.stdout + proc.stderr
    bench = [line for line in out.splitlines() if line.startswith("BENCH ")]
    if proc.returncode == 0 and bench:
        return bench[-1].replace("BENCH ", f"BENCH setting={label} ", 1)
    errors = [x for x in out.splitlines() if x.startswith("error")] or out.strip().splitlines()[-1:]
    message = errors[0] if errors else f"exit status {proc.returncode}"
    status = "oom" if "out of memory" in message.lower() else "failed"
    return f"BENCH setting={label} status={status} message={message!r}"


def _tps(line: str) -> Optional[float]:
    """tokens_per_sec_per_gpu of a BENCH line (None for a failed setting)."""
    return float(line.split("tokens_per_sec_per_gpu=")[1].split()[0]) if "tokens_per_sec_per_gpu=" in line else None


def bench_one(flags: list[str], skip: int) -> None:
    """Train the setting on synthetic data and print its BENCH line (rank 0)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", str(os.getpid()))
    cfg = parse_args([f"--ckpt_save_path=output/bench/{run_id}", *DEFAULTS, *flags, *FORCED])
    run = facts(cfg)
    if cfg.num_steps < skip + cfg.report_interval:
        raise ConfigError(
            f"--num_steps={cfg.num_steps} leaves no report interval after --bench_skip={skip}: "
            f"raise it to {skip + cfg.report_interval} or more"
        )
    records = [r for r in run_training(lambda: run) if r["step"] - cfg.report_interval >= skip]
    if os.environ.get("RANK", "0") != "0":
        return
    tps = statistics.median(r["tokens_per_sec_per_gpu"] for r in records)
    fpt = flops_per_token(run.model_config, cfg.seq_length)
    figures = {
        "variant": cfg.model_variant,
        "device": (
            torch.cuda.get_device_name() if torch.cuda.is_available() and cfg.device != "cpu" else "cpu"
        ).replace(" ", "_"),  # one word: BENCH lines split on spaces
        "torch": torch.__version__,
        "world": int(os.environ.get("WORLD_SIZE", "1")),
        "batch": cfg.batch_size,
        "seq": cfg.seq_length,
        "compile": cfg.use_torch_compile,
        "ac": cfg.selective_checkpointing if cfg.fsdp_activation_checkpointing else "off",
        "pp": cfg.pipeline_parallel_size,
        "bf16": cfg.mixed_precision,
        "step_time_s": round(statistics.median(r["step_time"] for r in records), 4),
        "tokens_per_sec_per_gpu": round(tps, 1),
        "achieved_tflops": round(tps * fpt / 1e12, 4),
        "mfu": round(statistics.median(r["mfu"] for r in records), 4) if "mfu" in records[0] else "n/a",
        "peak_mem_gb": round(max(r.get("peak_memory_reserved_gb", r.get("max_rss_gb", 0)) for r in records), 2),
    }
    print("BENCH " + " ".join(f"{k}={v}" for k, v in figures.items()), flush=True)


def main(argv: list[str]) -> None:
    skip, sweep, nproc, timeout, flags = 5, None, 1, 3600.0, []
    for arg in argv:
        name, _, value = arg.partition("=")
        if name == "--bench_skip":
            skip = int(value)
        elif name == "--sweep":
            sweep = value
        elif name == "--nproc_per_node":
            nproc = int(value)
        elif name == "--setting_timeout":
            timeout = float(value)
        else:
            flags.append(arg)
    quiet_library_noise()
    try:
        if sweep is not None:
            for setting in sweep_settings(sweep):  # a typo fails once, before any setting runs
                parse_args([*DEFAULTS, *flags, *FORCED, *setting])
            run_sweep(sweep, nproc, [*flags, f"--bench_skip={skip}"], timeout)
        else:
            bench_one(flags, skip)
    except USER_ERRORS as e:
        fail(e)


if __name__ == "__main__":
    main(sys.argv[1:])
