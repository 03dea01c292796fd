"""The whole model outside checkpoints: one safetensors file at the end of a run (--export_model_at_end)
or from a checkpoint folder (scripts/export_model.py, `fms-export-model`); and every --export_interval
steps (`PeriodicExporter`, staged and written in the background like an async checkpoint), as a
Hugging Face folder or that file, under <ckpt_save_path>/exports/step_<N>. Every rank writes its
shards to a DCP folder first; the files are then streamed from it a few MB of rows at a time
(hf_write.py) by every rank in parallel (the one file: each rank its run of the tensors, in place), so
no rank ever holds the whole model. Everything is published whole: on disk written under a temporary name and renamed; in object storage uploaded, a
folder marked COMPLETE last."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, ContextManager, Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from fms_fsdp.checkpoint.policy import KeepPolicy
from fms_fsdp.checkpoint.settings import ExportSettings
from fms_fsdp.checkpoint.writer import BackgroundWriter
from fms_fsdp.compat import tree_map_only
from fms_fsdp.errors import CheckpointError, first_line
from fms_fsdp.model.lora import is_adapter
from fms_fsdp.model.variants import CausalLM, build_model
from fms_fsdp.parallel.process_group import DistInfo, agreement_group, failures, on_rank0
from fms_fsdp.periodic import Report
from fms_fsdp.storage import COMPLETE, is_remote, location, publish, remove_tree, storage_error, umask, upload
from fms_fsdp.weights.ema import WeightAverage
from fms_fsdp.weights.fused import fuse, plain_tensor
from fms_fsdp.weights.hf import write_hf_config, write_peft_adapter
from fms_fsdp.weights.hf_write import (
    Converter,
    Planned,
    fms_plan,
    hf_plan,
    merging,
    split,
    stacked_experts,
    write_file,
    write_index,
    write_part,
)
from fms_fsdp.weights.reader import Tensors, model_dtypes, model_reader, root_cause, storage_writer

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


def stream_model_file(
    folder: Path, target: Path, settings: ExportSettings, meta: dict[str, str], state: str = "model_state"
) -> Path:
    """The model of checkpoint folder `folder` (its `state`: the weights, or ema_state) as one safetensors
    file under fms's names (LoRA's adapted weights merged), streamed a few MB of rows at a time
    (hf_write.py) and published whole."""
    plan, read = _model_file(folder, settings, state)
    with publish(target) as tmp:
        write_file(tmp, plan, Converter(read), meta)
    return target


def _model_file(folder: Path, settings: ExportSettings, state: str = "model_state") -> tuple[list[Planned], Tensors]:
    """The plan of the model file of checkpoint folder `folder` (its `state`), and the reader of its tensors."""
    tensors = model_reader(folder, state)
    model = {k: tuple(v) for k, v in tensors.shapes.items() if not is_adapter(k)}
    if settings.lora:
        tensors = merging(tensors, settings.lora)
    return fms_plan(model, model_dtypes(folder, state)), tensors


def exported_weights(settings: ExportSettings, average: Optional[WeightAverage]) -> ContextManager[None]:
    """The model's weights as an export takes them: --export_ema's average put in for a while."""
    return average.swapped() if settings.ema and average is not None else nullcontext()


def export_trained_model(
    model: CausalLM, target: Path, step: int, settings: ExportSettings, average: Optional[WeightAverage] = None
) -> Path:
    """The model at the end of a run as one safetensors file (with LoRA: the merged model, and the PEFT
    adapter folder adapter_step_<N> next to it): every rank writes its shards to a DCP folder, then
    every rank writes its run of the file's tensors from it, in place (in object storage rank 0 writes
    the file alone); no rank holds the whole model. Every rank calls it and waits for the write: a
    failed one (a full disk) is one CheckpointError on every rank."""
    shards = target.with_name(f".{target.name}.shards")
    kept = "the run's checkpoints are kept: export one with fms-export-model"

    def failed(message: str) -> CheckpointError:
        return CheckpointError(f"export to {target} failed: {message}; {kept}")

    on_rank0(lambda: _make_room(shards, target, model), CheckpointError, failed)
    try:
        with exported_weights(settings, average):
            state = fuse({"model_state": tree_map_only(torch.Tensor, plain_tensor, get_model_state_dict(model))})
            dcp.save(state, storage_writer=storage_writer(shards), process_group=agreement_group())
    except dcp.CheckpointException as e:  # raised on every rank: a full disk, object storage refusing
        if dist.get_rank() == 0:
            remove_tree(shards)
        raise failed(first_line(root_cause(e))) from None
    meta = {"step": str(step)}
    try:
        if is_remote(target):
            on_rank0(lambda: stream_model_file(shards, target, settings, meta), _expected, failed)
        else:
            _write_together(shards, target, settings, meta)
        on_rank0(lambda: _finish_export(model, shards, target, step, settings), _expected, failed)
    finally:
        if dist.get_rank() == 0:
            remove_tree(shards)
    return target


def _expected(error: BaseException) -> bool:
    return storage_error(error) or isinstance(error, CheckpointError)


def _write_together(shards: Path, target: Path, settings: ExportSettings, meta: dict[str, str]) -> None:
    """Every rank writes its run of the file's tensors into target's temporary name at once; a failure
    anywhere is one CheckpointError on every rank."""
    tmp = target.with_name(f".{target.name}.tmp")
    error: Optional[Exception] = None
    try:
        plan, read = _model_file(shards, settings)
        write_file(tmp, plan, Converter(read), meta, (dist.get_rank(), dist.get_world_size()))
    except Exception as e:
        error = e
    first = next((f[1] for f in failures(error) if f is not None), None)
    if error is not None and not _expected(error):
        raise error  # a bug: its traceback (the other ranks raise the line below)
    if first is not None:
        if dist.get_rank() == 0:
            remove_tree(tmp)
        raise CheckpointError(f"export to {target} failed: {first}")


def _finish_export(model: CausalLM, shards: Path, target: Path, step: int, settings: ExportSettings) -> None:
    """Rank 0, once the file is written: renamed into place (written whole already in object storage),
    the LoRA adapter folder beside it."""
    tmp = target.with_name(f".{target.name}.tmp")
    if not is_remote(target):
        os.replace(tmp, target)
    print(f"checkpoint: exported the model to {target}", flush=True)
    if settings.lora:
        adapter = write_adapter_folder(shards, model.config, settings, target.with_name(f"adapter_step_{step}"))
        print(f"checkpoint: exported the LoRA adapter (PEFT) to {adapter}", flush=True)


def _make_room(shards: Path, target: Path, model: CausalLM) -> None:
    """Rank 0, before an export at the end: remove what an earlier one left, and CheckpointError when
    the disk has no room for every rank's shards and then the file (object storage: no limit)."""
    remove_tree(shards)
    if is_remote(target):
        return
    remove_tree(target.with_name(f".{target.name}.tmp"))  # an interrupted export's: written in place, never truncated
    meta = build_model(model.config, torch.device("meta"))
    needed = 2 * sum(p.numel() * p.element_size() for p in meta.parameters()) * 1.05
    target.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(target.parent).free
    if free < needed:
        raise CheckpointError(
            f"{free / 2**30:.2f} GiB free at {target.parent}, {needed / 2**30:.2f} GiB needed (every rank's shards, "
            "then the file)"
        )


def write_adapter_folder(folder: Path, config: Any, settings: ExportSettings, target: Path) -> Path:
    """The PEFT adapter folder of a LoRA checkpoint folder's adapters, published whole."""
    assert settings.lora is not None and settings.base is not None
    tensors = model_reader(folder)
    adapters = tensors.read([k for k in tensors.shapes if is_adapter(k)])
    with publish(target) as tmp:
        write_peft_adapter(adapters, config, settings.lora, settings.base, tmp)
    return target


@contextmanager
def part_folder(target: Path) -> Iterator[Path]:
    """Where a rank writes its files of the export folder `target`, which several ranks write: locally
    the hidden folder that `seal` renames; in object storage a local temporary folder, uploaded."""
    if not is_remote(target):
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        yield tmp
        return
    with tempfile.TemporaryDirectory(prefix="fms-fsdp-") as folder:
        yield Path(folder)
        for f in sorted(Path(folder).rglob("*")):
            if f.is_file():
                upload(f, target / f.relative_to(folder).as_posix())


def seal(target: Path) -> None:
    """The export folder `target` whole, once every rank's files are in: renamed into place; in object
    storage marked COMPLETE."""
    if is_remote(target):
        (target / COMPLETE).write_text("ok\n")
        return
    tmp = target.with_name(f".{target.name}.tmp")
    for path in tmp.rglob("*"):
        if path.is_file():
            os.chmod(path, 0o666 & ~umask())
    if target.is_dir():
        shutil.rmtree(target)
    os.replace(tmp, target)


class PeriodicExporter:
    """--export_interval: every N steps each rank copies its shards of the model to CPU buffers (the
    only time training waits, as for an async checkpoint) and writes them in the background as a DCP
    folder (writer.py). Then, still in the background, every rank writes its own files of
    <ckpt_save_path>/exports/step_<N> from that folder, rows by rows (hf_write.py: a Hugging Face
    folder, or with --export_format=fms one model.safetensors that the ranks write at once), and rank 0 adds the
    index, config and tokenizer, seals the folder and deletes the DCP folder; no rank holds the whole
    model. The latest --export_keep are kept. A failure is raised on every rank at the next export or
    at `finish`. Periodic work of the loop (periodic.Periodic)."""

    reads_model = True

    def __init__(
        self,
        *,
        settings: ExportSettings,
        root: Path,
        info: DistInfo,
        model: CausalLM,
        average: Optional[WeightAverage] = None,
    ):
        """Exports of `model` (with --export_ema, of `average`) under `root` (<ckpt_save_path>/exports), as
        `settings` say."""
        self.settings, self.info, self.model, self.root, self.average = settings, info, model, root, average
        self.pending: Optional[Future] = None
        enabled = self.settings.interval > 0
        self.writer = BackgroundWriter(info.device) if enabled else None
        self.converter = ThreadPoolExecutor(1, thread_name_prefix="export") if enabled else None
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
        return self.settings.interval > 0 and step % self.settings.interval == 0

    def run(self, step: int, model: torch.nn.Module) -> Report:
        """The export of `step` started (of the model given at construction): training's wait for it,
        reported with the interval as export_s."""
        seconds = self.export(step)
        return Report(seconds, interval={"export_s": seconds})

    def export(self, step: int) -> float:
        """Stage this rank's shards and start writing the export of `step`; returns the seconds training
        waited for it. Every rank calls it."""
        assert self.writer is not None and self.converter is not None, "exports are off (--export_interval=0)"
        start = time.monotonic()
        self.finish()
        shards, target = self.root / f".step_{step}.shards", self.root / f"step_{step}"
        if self.info.is_main:
            for old in (shards, target.with_name(f".{target.name}.tmp"), *([target] if is_remote(target) else [])):
                remove_tree(old)
        dist.barrier(group=agreement_group())
        with exported_weights(self.settings, self.average):  # staged (copied) before the weights come back
            state = {"model_state": tree_map_only(torch.Tensor, plain_tensor, get_model_state_dict(self.model))}
            written = self.writer.write(state, shards)
        self.pending = self.converter.submit(self._convert, written, shards, step)
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
        """Every rank, in the background (over the writer's group): once every rank's shards are in the
        DCP folder, this rank's files of the export of `step`; then rank 0 completes it."""
        assert self.writer is not None
        written.result()
        group = self.writer.group
        dist.barrier(group=group)  # rank 0 has written the folder's .metadata
        target, hf = self.root / f"step_{step}", self.settings.format == "hf"
        error = None
        try:
            files = self._files(shards, dist.get_world_size(group))
            with part_folder(target) as tmp:
                part = (dist.get_rank(group), dist.get_world_size(group))
                write_part(tmp, files, self._converter(shards), part, shared=not is_remote(target))
        except Exception as e:
            error = f"{type(e).__name__}: {first_line(e)}"
        every: list[Optional[str]] = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, error, group=group)
        failed = next((e for e in every if e is not None), None)
        if failed is not None:
            raise CheckpointError(failed)
        if not self.info.is_main:
            return
        with part_folder(target) as tmp:
            if hf:
                write_index(tmp, files)
                write_hf_config(tmp, self.model.config, torch.bfloat16, self.settings.bos, self.settings.eos)
                self._copy_tokenizer(tmp)
            if self.settings.lora:  # and the adapter, for PEFT
                write_adapter_folder(shards, self.model.config, self.settings, tmp / "adapter")
        seal(target)
        remove_tree(shards)
        print(f"checkpoint: exported the model of step {step} to {target}", flush=True)
        steps = [int(p.name.removeprefix("step_")) for p in self.root.iterdir() if p.name.startswith("step_")]
        for old in KeepPolicy(self.settings.keep).to_delete(steps):
            remove_tree(self.root / f"step_{old}")

    def _files(self, shards: Path, writers: int) -> list[list[Planned]]:
        """The export's files: a Hugging Face folder's, at least one per rank; fms's one model.safetensors."""
        shapes = {k: tuple(v) for k, v in model_reader(shards).shapes.items() if not is_adapter(k)}
        if self.settings.format == "hf":
            return split(hf_plan(self.model.config, shapes, torch.bfloat16), writers)
        return [fms_plan(shapes, model_dtypes(shards))]

    def _converter(self, shards: Path) -> Converter:
        tensors = model_reader(shards)
        if self.settings.lora:
            tensors = merging(tensors, self.settings.lora)
        if self.settings.format == "hf":  # a sparse model's experts as Mixtral's tensors
            tensors = stacked_experts(tensors)
        return Converter(tensors, self.model.config)

    def _copy_tokenizer(self, tmp: Path) -> None:
        tokenizer = Path(self.settings.tokenizer_path) if self.settings.tokenizer_path else None
        if tokenizer is not None and tokenizer.is_file():
            shutil.copy2(tokenizer, tmp / "tokenizer.json")
        elif tokenizer is not None:
            for name in TOKENIZER_FILES:
                if (tokenizer / name).is_file():
                    shutil.copy2(tokenizer / name, tmp / name)


def export_checkpoint(load_path: str, save_path: str, ema: bool = False) -> str:
    """The model of a checkpoint folder (this project's or fms-fsdp's, local or in object storage; with
    `ema`, its --ema_decay average) as one safetensors file, streamed a few MB of rows at a time; no GPU,
    no process group. Returns a summary line."""
    state = "ema_state" if ema else "model_state"
    if not load_path or not location(load_path, "load_path").is_dir():
        raise CheckpointError(f"--load_path: {load_path or '(missing)'} is not a checkpoint folder")
    if not save_path.endswith(".safetensors"):
        raise CheckpointError(f"--save_path: {save_path or '(missing)'} must end in .safetensors")
    folder = location(load_path, "load_path")
    try:
        shapes = model_reader(folder, state).shapes
    except CheckpointError as e:  # names the folder and what is wrong with it
        raise CheckpointError(f"--load_path: {e}") from None
    except (RuntimeError, OSError, dcp.CheckpointException) as e:
        raise CheckpointError(f"--load_path: cannot read {load_path}: {first_line(e)}") from None
    settings = ExportSettings(
        interval=0, format="fms", keep=0, tokenizer_path=None, bos=None, eos=None, lora=None, base=None
    )
    try:
        target = stream_model_file(folder, location(save_path, "save_path"), settings, {"format": "pt"}, state)
    except CheckpointError as e:
        raise CheckpointError(f"--load_path: {e}") from None
    except Exception as e:  # a full disk; object storage: no endpoint, refused credentials
        if not storage_error(e):
            raise
        raise CheckpointError(f"--save_path: cannot write {save_path} ({type(e).__name__}: {first_line(e)})") from None
    return f"wrote {target}: {len(shapes)} tensors, {sum(math.prod(v) for v in shapes.values()) / 1e6:.1f}M parameters"
