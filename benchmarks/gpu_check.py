"""What one GPU can tell, in one command (scripts/gpu_check.sh runs it): the CUDA test tier
(`pytest -m cuda`, tests/test_cuda.py), then a short throughput table through benchmarks/throughput.py
(each setting in a process of its own, so an out-of-memory is one row and the rest go on), each figure
beside its goal, as markdown. Everything it writes goes under one folder:

    python benchmarks/gpu_check.py [--out=output/gpu_check/<date-time>] [--steps=20] [--skip=8] [--tier=False]

Where the repository keeps no CUDA golden curves yet, it records them first (tests/golden.py --device=cuda).
<out>/cuda_tier.log and cuda_tier.xml (the tier), golden.log, bench_<n>.log (each setting's output), table.md.
Without a GPU it says so in one line and exits with status 1. Packages the tier needs and the machine
lacks are installed first, from $WHEELS (default wheels/) when that folder exists, else the index.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.options import parse_options  # noqa: E402

LONG = ["--seq_length=4096", "--use_torch_compile=True"]
OP_AC = ["--fsdp_activation_checkpointing=True", "--ac_mode=op"]


@dataclass(frozen=True)
class Bench:
    """One throughput setting: its name in the table and its flags."""

    name: str
    flags: tuple[str, ...]
    float8: bool = False  # needs compute capability 8.9 or newer


BENCHES = (
    Bench("llama3_1.8b_4k bs 2 compile", ("--model_variant=llama3_1.8b_4k", "--batch_size=2", *LONG)),
    Bench("llama3_1.8b_4k bs 4 compile op AC", ("--model_variant=llama3_1.8b_4k", "--batch_size=4", *LONG, *OP_AC)),
    Bench("llama3_3.2b_4k bs 2 compile op AC", ("--model_variant=llama3_3.2b_4k", "--batch_size=2", *LONG, *OP_AC)),
    Bench(
        "llama3_3.2b_4k bs 2 compile op AC float8",
        ("--model_variant=llama3_3.2b_4k", "--batch_size=2", *LONG, *OP_AC, "--float8=True"),
        float8=True,
    ),
)


@dataclass(frozen=True)
class Goal:
    """A figure and the bar it must reach (issue 31's goals)."""

    figure: str
    bar: float
    at_most: bool = False  # the figure must stay at or below the bar
    note: str = ""

    def met(self, value: float) -> bool:
        return value <= self.bar if self.at_most else value >= self.bar


GOALS = (
    Goal("tokens/s/GPU, llama3_1.8b_4k bs 2 compile", 41_000, note="torchtitan 0.2.2: 38,592; before: 30,553"),
    Goal("best llama3_1.8b_4k MFU", 0.55),
    Goal("float8 / bf16 tokens/s, llama3_3.2b_4k op AC", 1.25),
    Goal("memory plan's error vs torch.cuda.max_memory_allocated, worst of 3", 0.10, at_most=True),
)
OPTIONS = {"out": "", "steps": "20", "skip": "8", "tier": "True"}  # out: output/gpu_check/<date-time>
# what the tier and the benchmarks import beside torch: module -> package
NEEDED = {
    "fms": "ibm-fms",
    "torchao": "torchao",
    "pytest": "pytest",
    "pyarrow": "pyarrow",
    "numpy": "numpy",
    "safetensors": "safetensors",
    "yaml": "pyyaml",
    "tqdm": "tqdm",
}


def install_missing() -> None:
    """pip install the packages of NEEDED that are not importable (none: nothing runs)."""
    missing = [package for module, package in NEEDED.items() if importlib.util.find_spec(module) is None]
    if not missing:
        return
    wheels = Path(os.environ.get("WHEELS", ROOT / "wheels"))
    source = ["--no-index", "--find-links", str(wheels)] if wheels.is_dir() else []
    print(f"gpu_check: installing {', '.join(missing)}" + (f" from {wheels}" if source else ""), flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *source, *missing], check=True)


def parse_bench(output: str) -> dict[str, str]:
    """The figures of the last BENCH line in a setting's output ({} when there is none); a word
    without '=' (a value with spaces) belongs to the figure before it."""
    lines = [line for line in output.splitlines() if line.startswith("BENCH ")]
    return dict(re.findall(r"(\w+)=(.*?)(?= \w+=|$)", lines[-1][len("BENCH ") :])) if lines else {}


def failure(output: str, status: int) -> str:
    """The one line that says why a setting gave no figures."""
    errors = [line for line in output.splitlines() if line.startswith("error")]
    return errors[-1] if errors else f"exit status {status}"


def plan_errors(tier_log: str) -> list[float]:
    """|planned - measured| / measured of each memory-plan line the tier printed."""
    found = re.findall(r"memory plan .*: planned ([\d.]+) GiB, measured ([\d.]+) GiB", tier_log)
    return [abs(float(p) - float(m)) / float(m) for p, m in found]


def figures(results: dict[str, dict[str, str]], plans: list[float]) -> list[Optional[float]]:
    """Each goal's figure (None when its runs gave none), in GOALS' order."""

    def tps(name: str) -> Optional[float]:
        value = results.get(name, {}).get("tokens_per_sec_per_gpu")
        return float(value) if value else None

    mfus = [float(r["mfu"]) for n, r in results.items() if "1.8b" in n and r.get("mfu", "n/a") != "n/a"]
    bf16, float8 = tps(BENCHES[2].name), tps(BENCHES[3].name)
    return [
        tps(BENCHES[0].name),
        max(mfus) if mfus else None,
        float8 / bf16 if bf16 and float8 else None,
        max(plans) if plans else None,
    ]


def figure_text(value: float) -> str:
    """A goal's figure as the table shows it: whole above 100, else to 3 decimals."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3f}"


def table(results: dict[str, dict[str, str]], failed: dict[str, str], plans: list[float], device: str) -> str:
    """The markdown the command prints: every setting's figures, then every goal beside its figure."""
    rows = [
        f"Device: {device}",
        "",
        "| setting | tokens/s/GPU | MFU | step (s) | peak memory (GiB) |",
        "|---|---|---|---|---|",
    ]
    for bench in BENCHES:
        r = results.get(bench.name)
        if r:
            rows.append(
                f"| {bench.name} | {float(r['tokens_per_sec_per_gpu']):,.0f} | {r['mfu']} | {r['step_time_s']} "
                f"| {r['peak_mem_gb']} |"
            )
        else:
            rows.append(f"| {bench.name} | {failed.get(bench.name, 'not run')} | | | |")
    rows += ["", "| goal | figure | bar | met |", "|---|---|---|---|"]
    for goal, value in zip(GOALS, figures(results, plans)):
        shown = "no figure" if value is None else figure_text(value)
        met = "?" if value is None else "yes" if goal.met(value) else "NO"
        bar = ("<= " if goal.at_most else ">= ") + (f"{goal.bar:,.0f}" if goal.bar >= 100 else f"{goal.bar}")
        note = f" ({goal.note})" if goal.note else ""
        rows.append(f"| {goal.figure}{note} | {shown} | {bar} | {met} |")
    return "\n".join(rows) + "\n"


def run_logged(command: list[str], log: Path, timeout: float) -> tuple[int, str]:
    """Run `command` from the repository root, its output to `log` (and returned) with its status."""
    try:
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        status, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:

        def text(out: object) -> str:
            return out.decode(errors="replace") if isinstance(out, bytes) else str(out or "")

        status = 124
        output = f"{text(e.stdout)}{text(e.stderr)}\nerror: no result within {timeout:.0f} s"
    log.write_text(output)
    return status, output


def run_tier(out: Path) -> tuple[str, str]:
    """The CUDA tier; (its summary line, its output)."""
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-s", "-p", "no:cacheprovider"]
    command += [f"--junitxml={out / 'cuda_tier.xml'}", f"--basetemp={out / 'tier_tmp'}", "tests/test_cuda.py"]
    _, output = run_logged(command, out / "cuda_tier.log", 1800)  # pytest-timeout limits each test to 600 s
    suite = ET.parse(out / "cuda_tier.xml").getroot().find("testsuite") if (out / "cuda_tier.xml").exists() else None
    if suite is None:
        return "the tier did not run: see cuda_tier.log", output
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return (
        f"CUDA tier: {counts['tests'] - counts['failures'] - counts['errors'] - counts['skipped']} passed, "
        f"{counts['failures'] + counts['errors']} failed, {counts['skipped']} skipped",
        output,
    )


def record_cuda_curves(out: Path) -> None:
    """Record the golden curves' CUDA files (tests/golden.py --device=cuda) where none are kept yet, so
    that the tier checks this GPU's curves against them from now on."""
    if (ROOT / "tests" / "assets" / "losses" / "cuda").is_dir():
        return
    status, _ = run_logged([sys.executable, "tests/golden.py", "--device=cuda"], out / "golden.log", 600)
    print(
        f"golden curves: CUDA files {'recorded in tests/assets/losses/cuda' if status == 0 else 'failed: see golden.log'}"
    )


def main(argv: list[str]) -> int:
    opts = parse_options(argv, OPTIONS, "gpu_check")
    import torch

    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA GPU is visible to torch {torch.__version__}: nothing to check here", file=sys.stderr)
        return 1
    out = Path(opts.get("out") or f"output/gpu_check/{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    steps, skip = int(opts["steps"]), int(opts["skip"])
    install_missing()
    out.mkdir(parents=True, exist_ok=True)
    device = f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    summary, tier_log = ("CUDA tier: not run (--tier=False)", "")
    if opts.get("tier", "True") != "False":
        record_cuda_curves(out)
        summary, tier_log = run_tier(out)
        print(summary, flush=True)
    results: dict[str, dict[str, str]] = {}
    failed: dict[str, str] = {}
    for n, bench in enumerate(BENCHES):
        if bench.float8 and torch.cuda.get_device_capability() < (8, 9):
            failed[bench.name] = "float8 needs compute capability 8.9 or newer"
            continue
        command = [
            sys.executable,
            "benchmarks/throughput.py",
            *bench.flags,
            f"--num_steps={steps}",
            f"--bench_skip={skip}",
            "--report_interval=4",
            f"--ckpt_save_path={out / f'bench_{n}'}",
        ]
        status, output = run_logged(command, out / f"bench_{n}.log", 600)
        figures_ = parse_bench(output)
        if status == 0 and figures_:
            results[bench.name] = figures_
        else:
            failed[bench.name] = failure(output, status)
        print(f"{bench.name}: {results.get(bench.name) or failed[bench.name]}", flush=True)
    text = f"{summary}\n\n" + table(results, failed, plan_errors(tier_log), device)
    (out / "table.md").write_text(text)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
