"""Reading model weights outside a training run (no process group): a checkpoint folder of this
project or of fms-fsdp, or a single .safetensors / .pth file, a run of rows at a time (`Tensors`),
without ever running code from the file.

DCP reads a folder's .metadata with plain pickle; `safe_reader` reads it through an unpickler that
admits only the plain data types it holds. A folder's rows are read from their byte ranges
(items.py), .safetensors files' from theirs, .pth files with weights_only=True. Folders in object
storage are written through DCP's fsspec writer and read by ranges.
"""

from __future__ import annotations

import pickle
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import StorageMeta

from fms_fsdp.compat import fsspec_storage
from fms_fsdp.errors import CheckpointError, first_line
from fms_fsdp.storage import is_remote, open_random
from fms_fsdp.weights.hf_read import DTYPES, entry_rows, file_entries, unknown_dtype
from fms_fsdp.weights.items import ItemRows


@dataclass(frozen=True)
class Tensors:
    """A model's tensors by name: their shapes, and `rows(name, a, b)`, rows [a, b) of one (its elements,
    for a 1-D tensor), read without the rest of it."""

    shapes: dict[str, torch.Size]
    rows: Callable[[str, int, int], torch.Tensor]

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """The named tensors, whole."""
        return {k: self.rows(k, 0, self.shapes[k][0] if self.shapes[k] else 1) for k in keys}


class RefusedPickle(pickle.UnpicklingError):
    """Checkpoint metadata that asks for code or types it has no business holding."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP .metadata file, refusing every global but the plain data types it holds."""

    _CLASSES = {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):  # some Python versions pickle enum members so
            return _public_attribute
        if module == "torch.distributed.checkpoint.metadata" or (module, name) in self._CLASSES:
            found = super().find_class(module, name)
            if isinstance(found, type) or (module, name) in self._CLASSES:
                return found
        value = getattr(torch, name, None) if module == "torch" else None
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            return value
        raise RefusedPickle(f"refusing {module}.{name} in checkpoint metadata")


def _public_attribute(obj: Any, name: str) -> Any:
    """getattr for the metadata unpickler: public names of the types it admits (enum members), nothing
    that could reach a function's globals."""
    if name.startswith("_") or not isinstance(obj, type) or obj.__module__ != "torch.distributed.checkpoint.metadata":
        raise RefusedPickle(f"refusing getattr({obj!r}, {name!r}) in checkpoint metadata")
    return getattr(obj, name)


class _SafeMetadata:
    """A DCP file reader's read_metadata, without running code."""

    fs: Any
    path: Any
    load_id: Any

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp.Metadata:
        with self.fs.create_stream(self.fs.concat_path(self.path, ".metadata"), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeReader(_SafeMetadata, dcp.FileSystemReader):
    """FileSystemReader whose metadata is read without running code."""


def safe_reader(folder: Any) -> dcp.FileSystemReader:
    """The safe reader of a checkpoint folder, on disk or in object storage."""
    if not is_remote(folder):
        return SafeReader(str(folder))
    FsspecReader, _ = fsspec_storage()

    class SafeFsspecReader(_SafeMetadata, FsspecReader):  # type: ignore[valid-type, misc]
        pass

    return SafeFsspecReader(str(folder))


def storage_writer(folder: Any) -> dcp.FileSystemWriter:
    """DCP's writer of a checkpoint folder, on disk or in object storage."""
    if not is_remote(folder):
        return dcp.FileSystemWriter(str(folder))
    _, FsspecWriter = fsspec_storage()
    return FsspecWriter(str(folder), sync_files=False)  # object storage has no fsync (DCP would os.sync())


def _folder_reader(path: Path, state: str = "model_state") -> Tensors:
    folder = str(path)
    try:
        whole = safe_reader(folder).read_metadata()
        metadata = whole.state_dict_metadata
    except RefusedPickle:
        raise
    except (EOFError, pickle.UnpicklingError) as e:
        raise CheckpointError(
            f"{folder}: its .metadata is damaged or truncated ({type(e).__name__}: {first_line(e)})"
        ) from None
    shapes = {
        key.removeprefix(f"{state}."): meta.size
        for key, meta in metadata.items()
        if key.startswith(f"{state}.") and hasattr(meta, "size")
    }
    if not shapes and state == "ema_state":
        raise CheckpointError(f"{folder} holds no weight average: its run trained without --ema_decay")
    if not shapes:
        raise CheckpointError(f"{folder}: no model_state in this checkpoint")
    if all(key.endswith((".lora_A", ".lora_B")) for key in shapes):
        raise CheckpointError(
            f"{folder} is a LoRA checkpoint: it holds the adapters only, not a model; use the "
            "run's exports (model_step_<N>.safetensors, exports/step_<N>)"
        )

    if any(getattr(info, "transform_descriptors", None) for info in whole.storage_data.values()):
        return Tensors(shapes, _dcp_rows(path, metadata, state))  # stored transformed (compressed): DCP reads them
    items = ItemRows(path, whole)

    def rows(key: str, a: int, b: int) -> torch.Tensor:
        try:
            return items.rows(f"{state}.{key}", a, b)
        except (RuntimeError, OSError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile) as e:
            if not unreadable(e):
                raise
            raise CheckpointError(f"{folder}: {damage(e, path)}") from None

    return Tensors(shapes, rows)


def _dcp_rows(path: Path, metadata: dict[str, Any], group: str) -> Callable[[str, int, int], torch.Tensor]:
    """Rows of a checkpoint folder's model tensors through DCP's own read: each tensor read whole (the
    last one kept for its next rows)."""
    last: dict[str, torch.Tensor] = {}

    def rows(key: str, a: int, b: int) -> torch.Tensor:
        if key not in last:
            last.clear()
            meta = metadata[f"{group}.{key}"]
            state = {key: torch.empty(meta.size, dtype=meta.properties.dtype)}
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                try:
                    dcp.load({group: state}, storage_reader=safe_reader(str(path)), no_dist=True)
                except dcp.CheckpointException as e:
                    raise CheckpointError(f"{path}: {damage(e, path)}") from None
            last.update(state)
        return last[key][a:b]

    return rows


def _safetensors_reader(path: Path) -> Tensors:
    """A safetensors file's tensors, each run of rows read from its byte range (memory-mapped when
    local, by ranges from object storage)."""
    entries = file_entries(path, path.name)
    for name, entry in entries.items():
        if entry.dtype not in DTYPES:
            raise unknown_dtype(str(path), name, entry.dtype)

    def rows(key: str, a: int, b: int) -> torch.Tensor:
        if not entries[key].shape:
            a, b = 0, 1
        with open_random(path) as f:
            found = entry_rows(f, entries[key], a, b, path, key)
        return found if entries[key].shape else found.view(())

    return Tensors({k: torch.Size(e.shape) for k, e in entries.items()}, rows)


def root_cause(error: BaseException) -> BaseException:
    """The first rank's exception inside a DCP CheckpointException; else `error`."""
    if isinstance(error, dcp.CheckpointException) and error.failures:
        return next(iter(error.failures.values()))[0]
    return error


def unreadable(error: BaseException) -> bool:
    """Whether a failed read of a checkpoint means damaged or missing files (a truncated or corrupt
    shard, a file that cannot be opened), rather than a checkpoint of another model."""
    cause = root_cause(error)
    return (
        (
            isinstance(cause, (OSError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile))
            and not isinstance(cause, RefusedPickle)
        )
        or (isinstance(cause, RuntimeError) and "PytorchStreamReader" in str(cause))
        or type(cause).__module__.startswith("safetensors")  # a truncated or corrupt header
    )


def damage(error: BaseException, folder: Optional[Path] = None) -> str:
    """What a failed read says, in one line, for an error message: the checkpoint `folder`'s files that
    are shorter than its .metadata says, or missing, when there are; else the reader's error."""
    short = short_files(folder) if folder is not None else []
    if short:
        return short[0] + (f" (and {len(short) - 1} more)" if len(short) > 1 else "") + "; the checkpoint is damaged"
    cause = root_cause(error)
    what = "a file is damaged or truncated" if unreadable(error) else "cannot be read"
    said = first_line(cause).split(". ")[0]  # torch's zip reader goes on for three more sentences
    return f"{what} ({type(cause).__name__}" + ("" if said == type(cause).__name__ else f": {said}") + ")"


def short_files(folder: Path) -> list[str]:
    """'<file> is truncated (n of m bytes)' or '<file> is missing' for each data file of a checkpoint
    folder that is shorter than its .metadata says or absent ([] when .metadata cannot be read)."""
    try:
        storage = safe_reader(folder).read_metadata().storage_data
    except Exception:
        return []
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    found = []
    for name, size in sorted(needed.items()):
        try:
            have = (folder / name).stat().st_size
        except FileNotFoundError:
            found.append(f"{folder / name} is missing")
            continue
        if have < size:
            found.append(f"{folder / name} is truncated ({have:,} of {size:,} bytes)")
    return found


def model_reader(path: Path, state: str = "model_state") -> Tensors:
    """The model tensors of a checkpoint folder (its `state`: the weights, or ema_state, --ema_decay's
    average) or a .safetensors / .pth model file, read when asked for, a run of rows at a time; a .pth
    file is mapped into memory whole (read whole, in torch's legacy format)."""
    if path.is_dir():
        return _folder_reader(path, state)
    if path.suffix == ".safetensors":
        return _safetensors_reader(path)
    try:
        obj = _load_pth(path)
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError) as e:
        if not unreadable(e):
            raise
        raise CheckpointError(f"{path}: {damage(e)}") from None
    held = obj.get("model_state", obj)
    return Tensors({k: v.shape for k, v in held.items()}, lambda key, a, b: held[key][a:b])


def _load_pth(path: Path) -> Any:
    """A .pth file's object, its tensors memory-mapped (read whole in torch's legacy format, which
    cannot be mapped)."""
    try:
        return torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    except RuntimeError as e:
        if "_use_new_zipfile_serialization" not in str(e):
            raise
        return torch.load(path, weights_only=True, map_location="cpu")


def model_dtypes(path: Path, state: str = "model_state") -> dict[str, torch.dtype]:
    """The dtype of each model tensor (of `state`, as model_reader says) of a checkpoint folder, from its .metadata."""
    metadata = safe_reader(str(path)).read_metadata().state_dict_metadata
    return {
        key.removeprefix(f"{state}."): meta.properties.dtype
        for key, meta in metadata.items()
        if key.startswith(f"{state}.") and hasattr(meta, "size")
    }


def read_model(path: Path) -> dict[str, torch.Tensor]:
    """Every model tensor of a checkpoint folder or a model file, whole, on the CPU."""
    tensors = model_reader(Path(path) if isinstance(path, str) else path)
    return tensors.read(list(tensors.shapes))
