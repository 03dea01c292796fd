"""Export the model of a checkpoint folder to one safetensors file (no GPU, no process group).

    python scripts/export_model.py --load_path=<ckpt_save_path>/checkpoints/step_N_ckp --save_path=model.safetensors

Reads this project's and fms-fsdp's checkpoint folders; the model is held in memory once.
"""

import os
import sys
from pathlib import Path

import fire

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fms_fsdp.config import first_line  # noqa: E402
from fms_fsdp.checkpoint import CheckpointError, read_model_state  # noqa: E402


def main(load_path: str = "", save_path: str = "") -> None:
    from safetensors.torch import save_file

    if not load_path or not Path(load_path).is_dir():
        sys.exit(f"error: --load_path: {load_path or '(missing)'} is not a checkpoint folder")
    if not save_path.endswith(".safetensors"):
        sys.exit(f"error: --save_path: {save_path or '(missing)'} must end in .safetensors")
    try:
        state = read_model_state(load_path)
    except (CheckpointError, RuntimeError, OSError) as e:
        sys.exit(f"error: --load_path: cannot read {load_path}: {first_line(e)}")
    target = Path(save_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp))
    os.replace(tmp, target)
    print(f"wrote {target}: {len(state)} tensors, {sum(v.numel() for v in state.values()) / 1e6:.1f}M parameters")


if __name__ == "__main__":
    fire.Fire(main)
