"""The whole model outside checkpoints: one safetensors file at the end of a run (--export_model_at_end,
gathered from every rank's shards) or from a checkpoint folder (scripts/export_model.py,
`fms-export-model`); and every --export_interval steps (`PeriodicExporter`, staged and written in
the background like an async checkpoint), as that file or as a Hugging Face folder, under
<ckpt_save_path>/exports/step_<N>. Everything is published whole (storage.publish): on disk written
under a temporary name and renamed; in object storage uploaded, a folder marked COMPLETE last."""

from __future__ import annotations

import shutil
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils._pytree import tree_map_only

from fms_fsdp.checkpoint.fused import FusingStager, fused_groups
from fms_fsdp.checkpoint.io import plain_tensor, staging_buffers
from fms_fsdp.checkpoint.policy import KeepPolicy
from fms_fsdp.checkpoint.reader import read_model, storage_writer
from fms_fsdp.config import train_config
from fms_fsdp.distributed import DistInfo
from fms_fsdp.errors import CheckpointError, DataError, first_line
from fms_fsdp.lora import merged, write_peft_adapter
from fms_fsdp.models import CausalLM, fuse_full
from fms_fsdp.storage import COMPLETE, is_remote, location, publish, remove_tree, storage_error

# the files of a Hugging Face tokenizer folder that an --export_format=hf export copies
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json")


def write_safetensors(state: dict[str, torch.Tensor], target: Path, metadata: Optional[dict[str, str]] = None) -> Path:
    """One safetensors file, published whole (local or in object storage)."""
    from safetensors.torch import save_file

    with publish(target) as tmp:
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata=metadata)
    return target


def export_trained_model(model: torch.nn.Module, target: Path, step: int, is_main: bool, cfg: train_config) -> Path:
    """Gather the sharded model to rank 0's CPU one tensor at a time and write it there (with LoRA: the
    merged model, and the PEFT adapter folder adapter_step_<N> next to it). Every rank calls it; the
    others do not wait for the write."""
    full = fuse_full(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))
    if is_main:
        write_safetensors(merged(full, cfg) if cfg.lora_rank else full, target, metadata={"step": str(step)})
        print(f"checkpoint: exported the model to {target}", flush=True)
        if cfg.lora_rank:
            adapter = write_adapter_folder(full, model.config, cfg, target.with_name(f"adapter_step_{step}"))
            print(f"checkpoint: exported the LoRA adapter (PEFT) to {adapter}", flush=True)
    return target


def write_adapter_folder(state: dict[str, torch.Tensor], config: Any, cfg: train_config, target: Path) -> Path:
    """The PEFT adapter folder of a LoRA model's full state, published whole."""
    with publish(target) as tmp:
        write_peft_adapter(state, config, cfg, tmp)
    return target


class PeriodicExporter:
    """--export_interval: every N steps each rank copies its shards of the model to CPU buffers (the
    only time training waits, as for an async checkpoint) and writes them in the background as a DCP
    folder; rank 0 then reads it whole, writes <ckpt_save_path>/exports/step_<N> as --export_format
    and deletes the DCP folder. The latest --export_keep are kept. A failure is raised on every rank
    at the next export or at `close`."""

    def __init__(self, cfg: train_config, info: DistInfo, model: CausalLM):
        self.cfg, self.info, self.model = cfg, info, model
        self.root = location(cfg.ckpt_save_path, "ckpt_save_path") / "exports"
        self.pending: Optional[Future] = None
        enabled = cfg.export_interval > 0
        # made now: a group made later needs the launcher's store, which is gone if the launcher died;
        # the background writes take their own group, so they never pair with the agreement's collectives
        self.group = dist.new_group(backend="gloo") if enabled else None
        self.write_group = dist.new_group(backend="gloo") if enabled else None
        self.stager = staging_buffers(info.device) if enabled else None
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="export") if enabled and info.is_main else None
        if enabled and info.is_main:
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
        return self.cfg.export_interval > 0 and step % self.cfg.export_interval == 0

    def export(self, step: int) -> None:
        """Stage this rank's shards and start writing the export of `step`. Every rank calls it."""
        self.finish()
        shards = self.root / f".step_{step}.shards"
        if self.info.is_main:
            remove_tree(shards)
        dist.barrier(group=self.group)
        state = {"model_state": tree_map_only(torch.Tensor, plain_tensor, get_model_state_dict(self.model))}  # float8's
        # fms's fused keys under tensor parallel too: the staged copy is fused (checkpoint/fused.py)
        stager = FusingStager(self.stager) if fused_groups(state["model_state"]) else self.stager
        written = dcp.async_save(state, storage_writer=storage_writer(shards), process_group=self.write_group,
                                 async_stager=stager)
        self.pending = written if self.writer is None else self.writer.submit(self._convert, written, shards, step)

    def finish(self) -> None:
        """Wait for the export being written; CheckpointError on every rank if it failed anywhere."""
        if self.group is None:
            return
        failure: Optional[str] = None
        if self.pending is not None:
            pending, self.pending = self.pending, None
            try:
                pending.result()
            except (Exception, dcp.CheckpointException) as e:
                failure = first_line(e)
        failures: list[Optional[str]] = [None] * self.info.world_size
        dist.all_gather_object(failures, failure, group=self.group)
        first = next((f for f in failures if f is not None), None)
        if first is not None:
            raise CheckpointError(f"export to {self.root} failed: {first}")

    def close(self) -> None:
        """Wait for the last export (see finish), stop the writer thread, free the staging buffers."""
        try:
            self.finish()
        finally:
            if self.writer is not None:
                self.writer.shutdown(wait=True)
            if self.stager is not None:
                self.stager.close()

    def _convert(self, written: Future, shards: Path, step: int) -> None:
        """Rank 0, in the background: once every rank's shards are on disk, the export of `step`."""
        written.result()
        self._write(read_model(shards), step)
        remove_tree(shards)

    def _write(self, state: dict[str, torch.Tensor], step: int) -> None:
        target = self.root / f"step_{step}"
        model = merged(state, self.cfg) if self.cfg.lora_rank else state
        with publish(target) as tmp:
            if self.cfg.export_format == "hf":
                self._write_hf(model, tmp)
            else:
                write_safetensors(model, tmp / "model.safetensors", metadata={"step": str(step)})
            if self.cfg.lora_rank:  # and the adapter, for PEFT
                write_peft_adapter(state, self.model.config, self.cfg, tmp / "adapter")
        print(f"checkpoint: exported the model of step {step} to {target}", flush=True)
        steps = [int(p.name.removeprefix("step_")) for p in self.root.iterdir() if p.name.startswith("step_")]
        for old in KeepPolicy(self.cfg.export_keep).to_delete(steps):
            remove_tree(self.root / f"step_{old}")

    def _write_hf(self, state: dict[str, torch.Tensor], tmp: Path) -> None:
        from fms_fsdp.hf import write_hf_folder

        write_hf_folder(self.model.config, lambda keys: {k: state[k] for k in keys}, list(state), str(tmp), torch.bfloat16,
                        self.cfg.bos_token, self.cfg.eos_token)
        tokenizer = Path(self.cfg.tokenizer_path) if self.cfg.tokenizer_path else None
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
    except (CheckpointError, RuntimeError, OSError) as e:
        raise CheckpointError(f"--load_path: cannot read {load_path}: {first_line(e)}") from None
    target = write_safetensors(state, location(save_path, "save_path"))
    return f"wrote {target}: {len(state)} tensors, {sum(v.numel() for v in state.values()) / 1e6:.1f}M parameters"


def main(load_path: str = "", save_path: str = "") -> None:
    """Export the model of checkpoint folder --load_path to the safetensors file --save_path."""
    try:
        print(export_checkpoint(str(load_path), str(save_path)))
    except (CheckpointError, DataError) as e:
        sys.exit(f"error: {e}")
    except Exception as e:  # object storage: no endpoint, refused credentials; a full disk
        if not storage_error(e):
            raise
        sys.exit(f"error: cannot write {save_path}: {type(e).__name__}: {first_line(e)}")


def cli() -> None:
    """`fms-export-model`: main's flags from the command line."""
    import fire

    fire.Fire(main)
