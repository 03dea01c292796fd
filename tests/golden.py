"""Golden loss curves: the default recipe's numerics, recorded. The quick start's shape (`tiny`, lines
of 256 tokens, 8 a step, its learning rate) in fp32 on the CPU, on one rank, --deterministic, for
STEPS steps with AdamW (the default), with Muon and with z-loss; each run's losses are kept in
tests/assets/losses/<recipe>.json and tests/test_golden.py checks a run against them within RTOL.

An intended change of the numerics (the initialisation, the schedule, the loss, an optimizer) records
them again, so that the diff shows the change:

    python tests/golden.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from tempfile import TemporaryDirectory

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

ASSETS = HERE / "assets" / "losses"
STEPS = 20
# CPUs of two vendors (AMD EPYC, Intel Xeon) and three torch releases run the same fp32 kernels to
# within their last bits; checked here on torch 2.11, 2.13 and 2.14 (docs/performance.md)
RTOL = 1e-4
SHAPE = [
    "--model_variant=tiny",
    "--device=cpu",
    "--use_dummy_dataset=True",
    "--use_torch_compile=False",
    "--mixed_precision=False",
    "--sharding_strategy=fsdp",
    "--seq_length=256",
    "--batch_size=8",
    "--learning_rate=3e-3",
    f"--num_steps={STEPS}",
    "--report_interval=1",
    "--checkpoint_interval=0",
    "--deterministic=True",
]
RECIPES = {"adamw": [], "muon": ["--optimizer=muon"], "z_loss": ["--z_loss_weight=1e-4"]}


def losses(recipe: str) -> list[float]:
    """The losses of a run of `recipe`, one per step (in this process)."""
    from conftest import records, run_here

    with TemporaryDirectory() as tmp:
        run_here([*SHAPE, *RECIPES[recipe], f"--ckpt_save_path={tmp}/run"])
        return [r["loss"] for r in records(Path(tmp) / "run") if "loss" in r]


def golden(recipe: str) -> list[float]:
    return json.loads((ASSETS / f"{recipe}.json").read_text())["losses"]


def record() -> None:
    """Run every recipe and write its file."""
    import torch

    ASSETS.mkdir(parents=True, exist_ok=True)
    for recipe, extra in RECIPES.items():
        found = {"flags": [*SHAPE, *extra], "torch": torch.__version__.split("+")[0], "losses": losses(recipe)}
        (ASSETS / f"{recipe}.json").write_text(json.dumps(found, indent=1) + "\n")
        print(f"{recipe}: {len(found['losses'])} losses, the last {found['losses'][-1]:.6f}")


if __name__ == "__main__":
    record()
