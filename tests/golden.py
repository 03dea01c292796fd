"""Golden loss curves: the default recipe's numerics, recorded. The quick start's shape (`tiny`, lines
of 256 tokens, 8 a step, its learning rate) in fp32 on the CPU, on one rank, --deterministic, for
steps(recipe) steps with AdamW (the default), with Muon and with z-loss; each run's losses are kept in
tests/assets/losses/<recipe>.json and tests/test_golden.py checks a run against them within RTOL.
The same runs on a GPU (`--device=cuda`, fp32) are kept in tests/assets/losses/cuda/ and checked by the
CUDA tier (tests/test_cuda.py) within CUDA_RTOL.

An intended change of the numerics (the initialisation, the schedule, the loss, an optimizer) records
them again, so that the diff shows the change:

    python tests/golden.py                  # the CPU files
    python tests/golden.py --device=cuda    # the GPU files, on a machine with one
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
# Muon's Newton-Schulz iterations run in bf16, which a CPU without bf16 matmuls (AVX2) emulates: 7 s a step
# of `tiny` against AdamW's 0.6 s, so its CPU curve is 10 steps; its CUDA curve is STEPS
CPU_MUON_STEPS = 10
# CPUs of two vendors (AMD EPYC, Intel Xeon) and three torch releases run the same fp32 kernels to
# within their last bits (about 1e-6 of AdamW's losses); checked here on torch 2.11, 2.13 and 2.14
# (docs/performance.md). Muon's 20-step curve falls to 0.005, and its Newton-Schulz steps grew those bits
# to 2.5e-5 of loss there (Intel Xeon against the recorded AMD EPYC): ATOL, in units of loss, covers them 4
# times over, where a 10% change of Muon's weight decay moves its 10-step curve by 3.3e-4 and a 1% change
# of AdamW's learning rate its curve by 2.7e-2
RTOL, ATOL = 1e-4, 1e-4
# one GPU model against another (H100, H200) and a CUDA release against another: cuBLAS picks its
# kernels by device and release, so the bits may differ; 1e-3 is still far below a real change's effect
CUDA_RTOL = 1e-3
SHAPE = [
    "--model_variant=tiny",
    "--use_dummy_dataset=True",
    "--use_torch_compile=False",
    "--mixed_precision=False",
    "--sharding_strategy=fsdp",
    "--seq_length=256",
    "--batch_size=8",
    "--learning_rate=3e-3",
    "--report_interval=1",
    "--checkpoint_interval=0",
    "--deterministic=True",
]
RECIPES = {"adamw": [], "muon": ["--optimizer=muon"], "z_loss": ["--z_loss_weight=1e-4"]}


def steps(recipe: str, device: str = "cpu") -> int:
    """The number of steps of `recipe`'s curve on `device`."""
    return CPU_MUON_STEPS if (recipe, device) == ("muon", "cpu") else STEPS


def flags(recipe: str, device: str = "cpu") -> list[str]:
    return [*SHAPE, f"--num_steps={steps(recipe, device)}", f"--device={device}", *RECIPES[recipe]]


def losses(recipe: str, device: str = "cpu", changes: tuple[str, ...] = ()) -> list[float]:
    """The losses of a run of `recipe` on `device`, with flags `changes` on top, one per step (in this
    process)."""
    from conftest import records, run_here

    with TemporaryDirectory() as tmp:
        run_here([*flags(recipe, device), *changes, f"--ckpt_save_path={tmp}/run"])
        return [r["loss"] for r in records(Path(tmp) / "run") if "loss" in r]


def curve_file(recipe: str, device: str = "cpu") -> Path:
    return (ASSETS if device == "cpu" else ASSETS / device) / f"{recipe}.json"


def golden(recipe: str, device: str = "cpu") -> list[float]:
    return json.loads(curve_file(recipe, device).read_text())["losses"]


def record(device: str = "cpu") -> None:
    """Run every recipe on `device` and write its file."""
    import torch

    for recipe in RECIPES:
        found = {
            "flags": flags(recipe, device),
            "torch": torch.__version__.split("+")[0],
            "losses": losses(recipe, device),
        }
        if device == "cuda":
            found["device"] = torch.cuda.get_device_name()
        path = curve_file(recipe, device)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(found, indent=1) + "\n")
        print(f"{recipe} ({device}): {len(found['losses'])} losses, the last {found['losses'][-1]:.6f}")


if __name__ == "__main__":
    record(*(arg.removeprefix("--device=") for arg in sys.argv[1:2]))
