"""Checkpoint save and load: seconds, bytes, and the training stall of sync vs async saves.

    torchrun --standalone --nproc_per_node=2 benchmarks/checkpoint.py --model_variant=small --device=cpu \
        --mixed_precision=False --use_torch_compile=False [--ckpt_save_path=/tmp/ckpt_bench]

Takes the training flags; builds the model and optimizer as training does, takes one step (so the
optimizer state exists), then saves twice synchronously, three times with --async_checkpoint (the
stall is the time training waits; the total includes waiting for the background write; the first
async save allocates the staging buffers, later ones reuse them: async_first_stall_s and
async_stall_s), exports the model as --export_interval does (fms and hf: the stall is the gather to
rank 0, the total includes rank 0's write), and loads the newest checkpoint back. Rank 0 prints one
line of key=value figures.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist  # noqa: E402

from fms_fsdp.checkpoint.checkpointer import CheckpointRestorer  # noqa: E402
from fms_fsdp.checkpoint.export import PeriodicExporter  # noqa: E402
from fms_fsdp.checkpoint.layout import complete_checkpoints  # noqa: E402
from fms_fsdp.checkpoint.save import CheckpointSaver  # noqa: E402
from fms_fsdp.console import quiet_library_noise
from fms_fsdp.context import Run
from fms_fsdp.data import get_data_loader  # noqa: E402
from fms_fsdp.flags import parse_args  # noqa: E402
from fms_fsdp.startup import facts, optimizer_and_schedule, sharded_model, started
from fms_fsdp.train.guard import StepGuard  # noqa: E402
from fms_fsdp.train.step import train_step  # noqa: E402


def main(argv: list[str]) -> None:
    cfg = parse_args(["--use_dummy_dataset=True", "--ckpt_save_path=/tmp/ckpt_bench", "--checkpoint_keep=5", *argv])
    quiet_library_noise()
    with started(facts(cfg)) as run:
        bench(run)


def bench(run: Run) -> None:
    cfg, info = run.cfg, run.info
    root = Path(cfg.ckpt_save_path)
    if info.is_main:
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    loader = get_data_loader(run.settings.data, info.dp_rank, info.dp_size)
    model = sharded_model(run)
    optimizer, scheduler = optimizer_and_schedule(run, model)
    train_step(
        model=model,
        optimizer=optimizer,
        guard=StepGuard(0, None, optimizer, info.device),
        step=1,
        batches=iter(loader),
        settings=run.settings.step,
        device=info.device,
        global_norm=False,
    )
    figures = {}
    checkpointing = {  # --async_checkpoint off and on
        mode: dataclasses.replace(run.settings.checkpoint, background=mode == "async") for mode in ("sync", "async")
    }
    for mode in ("sync", "async"):
        saver = CheckpointSaver(
            settings=checkpointing[mode],
            root=run.paths.checkpoints,
            info=info,
            config=run.flags,
            log=run.log,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            loader=loader,
        )
        stalls, totals = [], []
        for step in (1, 2) if mode == "sync" else (3, 4, 5):
            start = time.perf_counter()
            stalls.append(saver.save(step, 0))
            saver.commit_pending()
            totals.append(time.perf_counter() - start)
        if mode == "async":
            figures["async_first_stall_s"] = round(stalls.pop(0), 3)
            totals.pop(0)
        figures[f"{mode}_stall_s"] = round(min(stalls), 3)
        figures[f"{mode}_total_s"] = round(min(totals), 3)
        saver.close()
    for fmt in ("fms", "hf"):  # a periodic export: the gather stalls training, rank 0 writes in the background
        exporting = dataclasses.replace(run.settings.export, interval=1, format=fmt)
        exporter = PeriodicExporter(settings=exporting, root=run.paths.exports, info=info, model=model)
        start = time.perf_counter()
        exporter.export(6)
        figures[f"export_{fmt}_stall_s"] = round(time.perf_counter() - start, 3)
        exporter.finish()
        exporter.close()
        figures[f"export_{fmt}_total_s"] = round(time.perf_counter() - start, 3)
    start = time.perf_counter()
    CheckpointRestorer(saver, run.variant).resume()
    figures["load_s"] = round(time.perf_counter() - start, 3)
    step, path = complete_checkpoints(root / "checkpoints")[-1]
    figures["bytes"] = sum(p.stat().st_size for p in path.iterdir())
    run.log(
        f"BENCH variant={cfg.model_variant} world={info.world_size} device={info.device.type} "
        + " ".join(f"{k}={v}" for k, v in figures.items())
    )
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1:])
