"""Hugging Face import and export at any size: seconds and peak memory (RSS) per rank.

    python benchmarks/hf_io.py make --model_variant=small --folder=/tmp/hf_small     # a bf16 HF folder
    torchrun --standalone --nproc_per_node=2 benchmarks/hf_io.py run --model_variant=small \
        --folder=/tmp/hf_small --out=/tmp/hf_bench --device=cpu --mixed_precision=False --use_torch_compile=False
    python benchmarks/hf_io.py offline --model_variant=small --out=/tmp/hf_offline  # fms_to_hf's peak

`make` writes a Hugging Face folder of the variant with random weights (bf16, tensor by tensor).
`run` takes the training flags; builds the sharded model as training does, then reads the folder into
it (--ckpt_load_path: every rank its own slices) and exports it as --export_interval does
(--export_format=hf: every rank writes its own files). Each rank's RSS is read before the import and
before the export, and its peak during each (Linux's VmHWM, reset before each: file pages of the
memory-mapped safetensors count too); rank 0 prints one BENCH line with the seconds and every rank's
figures in MiB. `offline` saves a checkpoint of the
variant and runs fms_to_hf and fms-export-model on it, each in a fresh process, and prints their peak
RSS above that of a bare `import torch, fms_fsdp` and the model's fp32 bytes.
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from fms_fsdp.checkpoint.export import PeriodicExporter  # noqa: E402
from fms_fsdp.compat import local_tensor  # noqa: E402
from fms_fsdp.console import quiet_library_noise
from fms_fsdp.flags import parse_args  # noqa: E402
from fms_fsdp.model.variants import build_model, get_model_config  # noqa: E402
from fms_fsdp.startup import facts, sharded_model, started  # noqa: E402
from fms_fsdp.weights.hf import write_hf_folder  # noqa: E402
from fms_fsdp.weights.load import load_weights  # noqa: E402
from fms_fsdp.weights.reader import Tensors  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def flag(argv: list[str], name: str) -> str:
    return next(a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}="))


def status_mib(field: str) -> float:
    """A field of /proc/self/status (VmRSS: now; VmHWM: the peak since the last reset), in MiB."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(f"{field}:"))
    return int(line.split()[1]) / 1024


def reset_peak() -> float:
    """Linux's peak RSS (VmHWM) set back to the RSS now (clear_refs 5); returns that RSS in MiB."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    return status_mib("VmRSS")


def make(argv: list[str]) -> None:
    """A bf16 Hugging Face folder of the variant with random weights."""
    variant, folder = flag(argv, "model_variant"), Path(flag(argv, "folder"))
    config = get_model_config(variant)
    model = build_model(config, torch.device("cpu"))
    state = {k: v.detach() for k, v in model.state_dict().items()}
    shutil.rmtree(folder, ignore_errors=True)
    tensors = Tensors({k: v.shape for k, v in state.items()}, lambda key, a, b: state[key][a:b])
    write_hf_folder(
        config, tensors, {k: tuple(v.shape) for k, v in state.items()}, str(folder), torch.bfloat16, None, None
    )
    print(f"wrote {folder}: {sum(p.stat().st_size for p in folder.iterdir()) / 2**30:.2f} GiB")


def run(argv: list[str]) -> None:
    """Import and export on every rank; rank 0 prints the figures."""
    folder, out = flag(argv, "folder"), Path(flag(argv, "out"))
    rest = [a for a in argv if not a.startswith(("--folder=", "--out="))]
    cfg = parse_args(
        ["--use_dummy_dataset=True", f"--ckpt_save_path={out}", "--export_interval=1", "--export_format=hf", *rest]
    )
    quiet_library_noise()
    with started(facts(cfg)) as r:
        if r.info.is_main:
            shutil.rmtree(out, ignore_errors=True)
        dist.barrier()
        model = sharded_model(r)
        dist.barrier()
        before = reset_peak()
        start = time.perf_counter()
        load_weights(model, folder, cfg.model_variant)
        dist.barrier()
        import_s, imported = time.perf_counter() - start, status_mib("VmHWM")
        exporter = PeriodicExporter(settings=r.settings.export, root=r.paths.exports, info=r.info, model=model)
        staged = reset_peak()
        start = time.perf_counter()
        stall = exporter.export(1)
        exporter.finish()
        dist.barrier()
        export_s, exported = time.perf_counter() - start, status_mib("VmHWM")
        exporter.close()
        mine = (round(before), round(imported - before), round(staged), round(exported - staged))
        every: list = [None] * r.info.world_size
        dist.all_gather_object(every, mine)
        held = sum(local_tensor(p).numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
        r.log(
            f"BENCH variant={cfg.model_variant} world={r.info.world_size} import_s={import_s:.2f} "
            f"export_s={export_s:.2f} export_stall_s={stall:.2f} rank0_shards_mib={held * 4 / 2**20:.0f} "
            "mib_per_rank(rss_before_import,import_peak_above,rss_before_export,export_peak_above)="
            + ";".join(",".join(map(str, e)) for e in every)
        )


def peak_rss(args: list[str], env: Optional[dict] = None, timeout: float = 3600) -> tuple[int, int, str]:
    """Run `args` in a fresh process (from the repository's root, with `env`); its exit status, its own peak
    RSS in bytes (the kernel's maximum resident set size of that one child: wait4) and its output. The
    offline figures here and tests/test_offline_memory.py's bound both measure with it."""
    with tempfile.TemporaryFile() as output:
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT)
        killer = threading.Timer(timeout, proc.kill)
        killer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            killer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
        output.seek(0)
        return proc.returncode, usage.ru_maxrss * 1024, output.read().decode(errors="replace")  # KiB on Linux


def child_peak(args: list[str]) -> float:
    """A command's peak RSS in MiB, run in a fresh process (it must succeed)."""
    status, peak, said = peak_rss(args)
    if status != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({status}): {said[-2000:]}")
    return peak / 2**20


def offline(argv: list[str]) -> None:
    """fms_to_hf and fms-export-model on a checkpoint of the variant: their peaks above the interpreter."""
    import torch.distributed.checkpoint as dcp

    variant, out = flag(argv, "model_variant"), Path(flag(argv, "out"))
    shutil.rmtree(out, ignore_errors=True)
    model = build_model(get_model_config(variant), torch.device("cpu"))
    fp32 = sum(p.numel() for p in model.parameters()) * 4 / 2**20
    dcp.save({"model_state": model.state_dict()}, checkpoint_id=str(out / "ckpt"), no_dist=True)
    del model
    bare = child_peak([sys.executable, "-c", "import torch, fms_fsdp.cli"])
    python = [sys.executable]
    start = time.perf_counter()
    to_hf = child_peak([*python, "fms_to_hf.py", f"--load_path={out / 'ckpt'}", f"--save_path={out / 'hf'}",
                        f"--model_variant={variant}", "--dtype=bf16"])  # fmt: skip
    to_hf_s = time.perf_counter() - start
    start = time.perf_counter()
    exported = child_peak([*python, "scripts/export_model.py", f"--load_path={out / 'ckpt'}",
                           f"--save_path={out / 'model.safetensors'}"])  # fmt: skip
    export_s = time.perf_counter() - start
    print(
        f"BENCH offline variant={variant} fp32_mib={fp32:.0f} bare_mib={bare:.0f} "
        f"fms_to_hf_above_mib={to_hf - bare:.0f} ({(to_hf - bare) / fp32:.0%} of fp32) fms_to_hf_s={to_hf_s:.1f} "
        f"export_model_above_mib={exported - bare:.0f} ({(exported - bare) / fp32:.0%} of fp32) "
        f"export_model_s={export_s:.1f}"
    )


if __name__ == "__main__":
    {"make": make, "run": run, "offline": offline}[sys.argv[1]](sys.argv[2:])
