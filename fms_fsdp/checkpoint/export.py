"""The whole model outside checkpoints: one safetensors file at the end of a run (--export_model_at_end,
gathered from every rank's shards) or from a checkpoint folder (scripts/export_model.py,
`fms-export-model`); and every --export_interval steps (`PeriodicExporter`, staged and written in
the background like an async checkpoint), as that file or as a Hugging Face folder, under
<ckpt_save_path>/exports/step_<N>. Everything is published whole (storage.publish): on disk written
under a temporary name and renamed; in object storage uploaded, a folder marked COMPLETE last."""

from __future__ import annotations

import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fms_fsdp.checkpoint.fused import plain_tensor
from fms_fsdp.checkpoint.hf import write_hf_folder, write_peft_adapter
from fms_fsdp.checkpoint.policy import KeepPolicy
from fms_fsdp.checkpoint.reader import read_model, storage_writer
from fms_fsdp.checkpoint.settings import ExportSettings
from fms_fsdp.checkpoint.writer import BackgroundWriter
from fms_fsdp.compat import tree_map_only
from fms_fsdp.errors import CheckpointError, first_line
from fms_fsdp.model.lora import merged
from fms_fsdp.model.variants import CausalLM, fuse_full
from fms_fsdp.parallel.process_group import agreement_group, failures, on_rank0
from fms_fsdp.run import Run
from fms_fsdp.storage import COMPLETE, is_remote, location, publish, remove_tree, storage_error
from fms_fsdp.train.periodic import Report

# the files of a Hugging Face tokenizer folder that an --export_format=hf export copies
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)


def write_safetensors(state: dict[str, torch.Tensor], target: Path, metadata: Optional[dict[str, str]] = None) -> Path:
    """One safetensors file, published whole (local or in object storage)."""
    from safetensors.torch import save_file

    with publish(target) as tmp:
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata=metadata)
    return target


def export_trained_model(
    model: CausalLM, target: Path, step: int, settings: ExportSettings, pipelined: bool = False
) -> Path:
    """Gather the sharded model to rank 0's CPU one tensor at a time and write it there (with LoRA: the
    merged model, and the PEFT adapter folder adapter_step_<N> next to it); under pipeline parallelism,
    where a rank holds its stages only, through a DCP folder of every rank's tensors that rank 0 reads
    whole. Every rank calls it and waits for the write: a failed one (a full disk) is one
    CheckpointError on every rank."""
    if pipelined:
        full = _whole_through_folder(model, target.with_name(f".{target.name}.shards"))
    else:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = fuse_full(get_model_state_dict(model, options=options))

    def write() -> None:
        write_safetensors(merged(full, settings.lora) if settings.lora else full, target, metadata={"step": str(step)})
        print(f"checkpoint: exported the model to {target}", flush=True)
        if settings.lora:
            adapter = write_adapter_folder(full, model.config, settings, target.with_name(f"adapter_step_{step}"))
            print(f"checkpoint: exported the LoRA adapter (PEFT) to {adapter}", flush=True)

    on_rank0(
        write,
        lambda e: storage_error(e) or type(e).__module__.startswith("safetensors"),  # its writer's I/O errors
        lambda message: CheckpointError(
            f"export to {target} failed: {message}; the run's checkpoints are kept: export one with fms-export-model"
        ),
    )
    return target


def _whole_through_folder(model: CausalLM, shards: Path) -> dict[str, torch.Tensor]:
    """The whole model on rank 0 ({} elsewhere) from every rank's tensors, written to `shards` as a DCP
    folder (as periodic exports are) and read back whole; the folder is removed."""
    is_main = dist.get_rank() == 0
    if is_main:
        remove_tree(shards)
    dist.barrier(group=agreement_group())
    state = {"model_state": tree_map_only(torch.Tensor, plain_tensor, get_model_state_dict(model))}
    dcp.save(state, storage_writer=storage_writer(shards), process_group=agreement_group())
    full = read_model(shards) if is_main else {}
    if is_main:
        remove_tree(shards)
    return full


def write_adapter_folder(state: dict[str, torch.Tensor], config: Any, settings: ExportSettings, target: Path) -> Path:
    """The PEFT adapter folder of a LoRA model's full state, published whole."""
    assert settings.lora is not None and settings.base is not None
    with publish(target) as tmp:
        write_peft_adapter(state, config, settings.lora, settings.base, tmp)
    return target


class PeriodicExporter:
    """--export_interval: every N steps each rank copies its shards of the model to CPU buffers (the
    only time training waits, as for an async checkpoint) and writes them in the background as a DCP
    folder (writer.py); rank 0 then reads it whole, writes <ckpt_save_path>/exports/step_<N> as
    --export_format and deletes the DCP folder. The latest --export_keep are kept. A failure is raised
    on every rank at the next export or at `finish`. Periodic work of the loop (periodic.Periodic)."""

    reads_model = True

    def __init__(self, run: Run, model: CausalLM):
        self.settings, self.info, self.model = run.settings.export, run.info, model
        self.root = run.paths.exports
        self.pending: Optional[Future] = None
        enabled = self.settings.interval > 0
        self.writer = BackgroundWriter(run.device) if enabled else None
        self.converter = ThreadPoolExecutor(1, thread_name_prefix="export") if enabled and run.info.is_main else None
        if enabled and run.info.is_main:
            self._remove_stale()

    def _remove_stale(self) -> None:
        """What an interrupted export left: hidden folders, unmarked exports in object storage. Only
        tidying: a failure warns."""
        try:
            for stale in self.root.iterdir() if self.root.is_dir() else []:
                if stale.name.startswith(".step_") or (is_remote(stale) and not (stale / COMPLETE).is_file()):
                    remove_tree(stale)
        except Exception as e:
            if not storage_error(e):
                raise
            print(f"warning: cannot tidy {self.root} ({type(e).__name__}: {first_line(e)})", flush=True)

    def due(self, step: int) -> bool:
        return self.settings.interval > 0 and step % self.settings.interval == 0

    def run(self, step: int, model: torch.nn.Module) -> Report:
        """The export of `step` started (of the model given at construction): training's wait for it,
        reported with the interval as export_s."""
        seconds = self.export(step)
        return Report(seconds, interval={"export_s": seconds})

    def export(self, step: int) -> float:
        """Stage this rank's shards and start writing the export of `step`; returns the seconds training
        waited for it. Every rank calls it."""
        assert self.writer is not None, "exports are off (--export_interval=0)"
        start = time.monotonic()
        self.finish()
        shards = self.root / f".step_{step}.shards"
        if self.info.is_main:
            remove_tree(shards)
        dist.barrier(group=agreement_group())
        state = {"model_state": tree_map_only(torch.Tensor, plain_tensor, get_model_state_dict(self.model))}  # float8's
        written = self.writer.write(state, shards)
        self.pending = (
            written if self.converter is None else self.converter.submit(self._convert, written, shards, step)
        )
        return time.monotonic() - start

    def finish(self) -> None:
        """Wait for the export being written; CheckpointError on every rank if it failed anywhere."""
        if self.writer is None:
            return
        error: Optional[BaseException] = None
        if self.pending is not None:
            pending, self.pending = self.pending, None
            try:
                pending.result()
            except (Exception, dcp.CheckpointException) as e:
                error = e
        first = next((f[1] for f in failures(error) if f is not None), None)
        if first is not None:
            raise CheckpointError(f"export to {self.root} failed: {first}")

    def close(self) -> None:
        """Stop the converter thread (after the export it is writing) and free the staging buffers; no
        collective (also on the way out of a failed run)."""
        if self.converter is not None:
            self.converter.shutdown(wait=True)
        if self.writer is not None:
            self.writer.close()

    def _convert(self, written: Future, shards: Path, step: int) -> None:
        """Rank 0, in the background: once every rank's shards are on disk, the export of `step`."""
        written.result()
        self._write(read_model(shards), step)
        remove_tree(shards)

    def _write(self, state: dict[str, torch.Tensor], step: int) -> None:
        target = self.root / f"step_{step}"
        lora = self.settings.lora
        model = merged(state, lora) if lora else state
        with publish(target) as tmp:
            if self.settings.format == "hf":
                self._write_hf(model, tmp)
            else:
                write_safetensors(model, tmp / "model.safetensors", metadata={"step": str(step)})
            if lora:  # and the adapter, for PEFT
                assert self.settings.base is not None
                write_peft_adapter(state, self.model.config, lora, self.settings.base, tmp / "adapter")
        print(f"checkpoint: exported the model of step {step} to {target}", flush=True)
        steps = [int(p.name.removeprefix("step_")) for p in self.root.iterdir() if p.name.startswith("step_")]
        for old in KeepPolicy(self.settings.keep).to_delete(steps):
            remove_tree(self.root / f"step_{old}")

    def _write_hf(self, state: dict[str, torch.Tensor], tmp: Path) -> None:
        write_hf_folder(
            self.model.config,
            lambda keys: {k: state[k] for k in keys},
            list(state),
            str(tmp),
            torch.bfloat16,
            self.settings.bos,
            self.settings.eos,
        )
        tokenizer = Path(self.settings.tokenizer_path) if self.settings.tokenizer_path else None
        if tokenizer is not None and tokenizer.is_file():
            shutil.copy2(tokenizer, tmp / "tokenizer.json")
        elif tokenizer is not None:
            for name in TOKENIZER_FILES:
                if (tokenizer / name).is_file():
                    shutil.copy2(tokenizer / name, tmp / name)


def export_checkpoint(load_path: str, save_path: str) -> str:
    """The model of a checkpoint folder (this project's or fms-fsdp's) as one safetensors file; no GPU,
    no process group, the model held in memory once. Returns a summary line."""
    if not load_path or not location(load_path, "load_path").is_dir():
        raise CheckpointError(f"--load_path: {load_path or '(missing)'} is not a checkpoint folder")
    if not save_path.endswith(".safetensors"):
        raise CheckpointError(f"--save_path: {save_path or '(missing)'} must end in .safetensors")
    try:
        state = read_model(location(load_path, "load_path"))
    except CheckpointError as e:  # names the folder and what is wrong with it
        raise CheckpointError(f"--load_path: {e}") from None
    except (RuntimeError, OSError, dcp.CheckpointException) as e:
        raise CheckpointError(f"--load_path: cannot read {load_path}: {first_line(e)}") from None
    try:
        target = write_safetensors(state, location(save_path, "save_path"))
    except Exception as e:  # a full disk; object storage: no endpoint, refused credentials
        if not storage_error(e):
            raise
        raise CheckpointError(f"--save_path: cannot write {save_path} ({type(e).__name__}: {first_line(e)})") from None
    return f"wrote {target}: {len(state)} tensors, {sum(v.numel() for v in state.values()) / 1e6:.1f}M parameters"
