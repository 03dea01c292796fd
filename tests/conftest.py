"""Helpers to run real training processes (torchrun + gloo) from tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]

# a tiny CPU run: fp32 (bf16 is slow on CPU), no compile, short sequences
TINY = [
    "--model_variant=tiny", "--device=cpu", "--use_dummy_dataset=True", "--use_torch_compile=False",
    "--mixed_precision=False", "--seq_length=64", "--vocab_size=256", "--learning_rate=3e-3", "--report_interval=1",
]


def launch(script: str, args: list[str], nproc: Optional[int], extra_env: Optional[dict] = None,
           timeout: int = 300, torchrun_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run `script` with `args`: under torchrun with nproc processes, or plain python when nproc is None."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(extra_env or {})}
    cmd = [sys.executable]
    if nproc is not None:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *torchrun_args]
    cmd += [str(ROOT / script), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def train(tmp: Path, args: list[str], nproc: Optional[int] = 2, **kw: Any) -> list[dict]:
    """Run main_training.py; assert it succeeded; return the metrics.jsonl records."""
    out = tmp / "run"
    proc = launch("main_training.py", [*TINY, f"--ckpt_save_path={out}", *args], nproc, **kw)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def inspect(tmp: Path, args: list[str], nproc: int, cases: Optional[list[list[str]]] = None) -> list[list[dict]]:
    """Run tests/inspect_worker.py once: per case (extra flags; default one case without), one JSON
    record per rank about its shards and initial loss."""
    cases = cases or [[]]
    proc = launch("tests/inspect_worker.py", [*TINY, f"--ckpt_save_path={tmp / 'inspect'}", *args], nproc,
                  extra_env={"INSPECT_CASES": json.dumps(cases)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [[json.loads((tmp / "inspect" / f"rank{r}.{k}.json").read_text()) for r in range(nproc)]
            for k in range(len(cases))]


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    return tmp_path
