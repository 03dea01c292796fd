"""Checkpoints written by earlier versions of the package, kept as test data: tests/test_upgrades.py
resumes each on today's code (and on the oldest and newest supported torch) and checks the next losses
against those the writing code went on to.

tests/assets/checkpoints/
    data/web/     the documents each was trained on (test_data.make_docs(10, 400, 1), Arrow shards)
    <name>/       a run folder: checkpoints/step_4_ckp/, and expected.json: who wrote it (commit,
                  package version, torch, checkpoint layout), its flags, and the losses of steps 5 to 8

A change of what a checkpoint holds raises LAYOUT in fms_fsdp/versions.py and adds one,
written by the new code (2 ranks, 8 steps, about 30 s), with the flags that make the run hold what
changed (layout2: experts, `--moe_experts=4 --moe_top_k=2`; layout3: the weight average, `--ema_decay=0.9`,
whose distance from the weights at the last step is kept too):

    python tests/kept_checkpoints.py layout<N> [--flag=value ...]

`--into DIR` writes it under another tree's tests/assets/checkpoints: how layout1 was written (this
script run by the code of the commit before checkpoints were versioned, 897257d), and layout1_d58e8e3 (by
the code before the package's modules were regrouped, d58e8e3, without --deterministic, which it did not
have yet); each with the micro variant added to that code.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from tempfile import TemporaryDirectory

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

ASSETS = HERE / "assets" / "checkpoints"
KEPT_STEP, STEPS = 4, 8
RTOL = 1e-4  # as the golden curves (tests/golden.py): the same fp32 kernels, across CPUs and torch releases


def run_flags(data: Path, out: Path, steps: int, extra: tuple[str, ...] = ()) -> list[str]:
    """The run every kept checkpoint comes from: `micro` on 2 ranks, FSDP, fp32, deterministic, and the
    `extra` flags of its layout."""
    return [
        "--model_variant=micro",
        "--device=cpu",
        "--use_torch_compile=False",
        "--mixed_precision=False",
        "--sharding_strategy=fsdp",
        "--deterministic=True",
        f"--data_path={data}",
        "--file_type=auto",
        "--vocab_size=1024",
        "--batch_size=4",
        "--seq_length=64",
        "--learning_rate=3e-3",
        "--num_workers=1",
        "--logical_shards=16",
        "--report_interval=1",
        f"--checkpoint_interval={KEPT_STEP}",
        f"--num_steps={steps}",
        f"--ckpt_save_path={out}",
        *extra,
    ]


def kept_flags(name: str, data: Path, out: Path) -> list[str]:
    """The flags kept checkpoint `name` was written with (expected.json), for data `data` and run `out`."""
    return [f.replace("<data>", str(data)).replace("<run>", str(out)) for f in expected(name)["flags"]]


def average_gap(checkpoint: Path) -> float:
    """How far a checkpoint's weight average (--ema_decay) is from its weights: the sum of |average - weights|
    over every tensor, read by DCP's own converter."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with TemporaryDirectory() as tmp:
        dcp_to_torch_save(checkpoint, Path(tmp) / "state.pt")
        state = torch.load(Path(tmp) / "state.pt", weights_only=False)
    return sum((state["ema_state"][k] - w).abs().sum().item() for k, w in state["model_state"].items())


def write_data(assets: Path) -> Path:
    """The documents of every kept checkpoint's run (written once; kept with them, so that a later change
    of the tests' data helpers cannot change them)."""
    from test_data import make_docs, write_dataset

    data = assets / "data"
    if not data.exists():
        write_dataset(data, "web", make_docs(10, 400, 1))
    return data


def expected(name: str) -> dict:
    return json.loads((ASSETS / name / "expected.json").read_text())


def kept() -> list[str]:
    return sorted(p.parent.name for p in ASSETS.glob("*/expected.json"))


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def record(name: str, assets: Path, extra: tuple[str, ...] = ()) -> None:
    """Train STEPS steps (with the `extra` flags), keep the checkpoint of KEPT_STEP under assets/name with
    the losses after it."""
    import torch

    from conftest import launch, records

    data = write_data(assets)
    target = assets / name
    if target.exists():
        raise SystemExit(f"{target} exists: a kept checkpoint is never written again")
    with TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        proc = launch("main_training.py", run_flags(data, out, STEPS, extra), 2)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        meta = torch.load(out / "checkpoints" / f"step_{KEPT_STEP}_ckp" / "metadata.pth", weights_only=True)
        shutil.copytree(out / "checkpoints" / f"step_{KEPT_STEP}_ckp", target / "checkpoints" / f"step_{KEPT_STEP}_ckp")
        losses = {r["step"]: r["loss"] for r in records(out) if "loss" in r and r["step"] > KEPT_STEP}
        last = out / "checkpoints" / f"step_{STEPS}_ckp"
        gap = average_gap(last) if any(f.startswith("--ema_decay=") for f in extra) else None
    found = {
        "written_by": {
            "commit": _commit(),
            "package_version": meta.get("package_version"),
            "layout": meta.get("layout", 1),
            "torch": torch.__version__.split("+")[0],
        },
        "flags": run_flags(Path("<data>"), Path("<run>"), STEPS, extra),
        "losses_after": {str(step): losses[step] for step in sorted(losses)},
        **({"average_gap_after": gap} if gap is not None else {}),
    }
    (target / "expected.json").write_text(json.dumps(found, indent=1) + "\n")
    print(f"{target}: layout {found['written_by']['layout']}, losses of steps {sorted(losses)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name")
    parser.add_argument("--into", type=Path, default=ASSETS, help="the tests/assets/checkpoints folder to write in")
    args, extra = parser.parse_known_args()
    record(args.name, args.into, tuple(extra))
