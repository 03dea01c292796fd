"""Initialising a model's weights from --ckpt_load_path (not restoring a run: that is checkpointer.py's): a
checkpoint folder (this project's or fms-fsdp's), a Hugging Face Llama folder, or a .pth /
.safetensors file holding the model. Every rank reads only its own shards' rows (but for a .pth file
in object storage, which rank 0 downloads, reads whole and sends). Every rank calls it."""

from __future__ import annotations

import pickle
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed.checkpoint as dcp
from fms.models.llama import LLaMAConfig
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from fms_fsdp.compat import local_box
from fms_fsdp.errors import CheckpointError, ConfigError, HFError, first_line
from fms_fsdp.model.lora import is_adapter
from fms_fsdp.model.variants import fused_parts, split_full
from fms_fsdp.parallel.process_group import agreement_group, failures, on_rank0
from fms_fsdp.storage import is_remote, local_copy, location, storage_error
from fms_fsdp.versions import check_folder_layout
from fms_fsdp.weights.fused import fuse, plain_tensor
from fms_fsdp.weights.hf import check_hf_config, check_hf_fields, read_hf_config
from fms_fsdp.weights.hf_read import check_shapes, index_folder, read_into
from fms_fsdp.weights.reader import damage, model_reader, read_model, root_cause, safe_reader, unreadable

# a whole model from one file: read on rank 0 only, each rank receives its shards
_FROM_RANK0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


MODEL_FILES = (".safetensors", ".pth", ".pt")


def check_load_path(
    path: str, model_config: Optional[LLaMAConfig] = None, variant: str = "", positions: Optional[int] = None
) -> Optional[dict]:
    """--ckpt_load_path names something to load: a checkpoint folder (.metadata), a Hugging Face folder
    (config.json) whose model is `model_config`'s (check_hf_config and, with the run's `positions`,
    check_hf_fields, when given) or a model file; ConfigError otherwise. The Hugging Face folder's
    config.json, else None. A start-up check: a few file-system calls."""
    p = location(path, "ckpt_load_path")
    try:
        if p.is_dir():
            hf = read_hf_config(p) if (p / "config.json").is_file() else None
            if hf is not None and model_config is not None:
                check_hf_config(hf, model_config, path, variant or None)
                if positions is not None:
                    check_hf_fields(hf, model_config, path, variant, positions)
            if (p / ".metadata").is_file():
                check_folder_layout(p)
            if (p / ".metadata").is_file() or hf is not None:
                return hf
            if (p / "checkpoints").is_dir():
                raise ConfigError(
                    f"--ckpt_load_path: {path} is a run folder: give one of its checkpoints, "
                    f"{p / 'checkpoints'}/step_<N>_ckp, or one of its exports"
                )
            raise ConfigError(
                f"--ckpt_load_path: {path} is neither a checkpoint folder (no .metadata) nor a Hugging Face "
                "folder (no config.json)"
            )
        if not p.exists():
            raise ConfigError(f"--ckpt_load_path: {path} does not exist")
        if p.suffix not in MODEL_FILES:
            raise ConfigError(
                f"--ckpt_load_path: {path} is not a model file ({', '.join(MODEL_FILES)}), a checkpoint folder "
                "or a Hugging Face folder"
            )
        if p.stat().st_size == 0:
            raise ConfigError(f"--ckpt_load_path: {path} is empty (0 bytes)")
        return None
    except (ConfigError, CheckpointError):
        raise
    except HFError as e:  # names the folder
        raise ConfigError(f"--ckpt_load_path: {e}") from None
    except Exception as e:  # object storage: no endpoint, no access
        raise ConfigError(f"--ckpt_load_path: cannot read {path} ({type(e).__name__}: {first_line(e)})") from None


def load_weights(model: torch.nn.Module, path: str, model_variant: str) -> None:
    """Load the model's weights (all but LoRA's adapters, which keep their init) from `path`;
    CheckpointError naming it, on every rank, when it cannot be read or does not fit `model_variant`."""
    p = location(path, "ckpt_load_path")
    try:
        found = p.exists()
    except Exception as e:  # object storage: no endpoint, no access
        raise CheckpointError(f"--ckpt_load_path: cannot read {path} ({type(e).__name__}: {first_line(e)})") from None
    if not found:
        raise CheckpointError(f"--ckpt_load_path: {path} does not exist")
    try:
        if p.is_dir() and (p / "config.json").is_file():
            check_hf_config(read_hf_config(p), model.config, str(p), model_variant)  # every rank: same verdict
            _read_hf(model, p, path)
        elif p.is_dir():
            try:  # a folder without a whole model (a LoRA run's), or a damaged .metadata, is refused in one line
                model_reader(p)
            except CheckpointError as e:
                raise CheckpointError(f"--ckpt_load_path: {e}") from None
            own = {k: v for k, v in get_model_state_dict(model).items() if not is_adapter(k)}
            dcp.load(fuse({"model_state": own}), storage_reader=safe_reader(p), process_group=agreement_group())
            _set(model, own, StateDictOptions())
        elif p.suffix == ".safetensors" or not is_remote(p):
            _read_file(model, p, path, model_variant)
        else:  # a .pth file in object storage: downloaded and read whole on rank 0, which sends the shards
            _set(model, _read_on_main(p, path, read_model), _FROM_RANK0)
    except CheckpointError:  # already one line naming the path (read on rank 0)
        raise
    except HFError as e:  # a Hugging Face folder that does not fit: names the folder
        raise CheckpointError(f"--ckpt_load_path: {e}") from None
    except (pickle.UnpicklingError, ValueError) as e:  # including HFError: a config that does not fit
        raise CheckpointError(f"--ckpt_load_path: {path}: {e}") from None
    except (RuntimeError, KeyError, dcp.CheckpointException) as e:
        if unreadable(e):
            raise CheckpointError(f"--ckpt_load_path: {path}: {damage(e, p if p.is_dir() else None)}") from None
        raise CheckpointError(
            f"--ckpt_load_path: {path} does not fit --model_variant={model_variant}"
            f" (vocab {model.config.src_vocab_size}): {first_line(root_cause(e))}"
        ) from None


def _read_on_main(p: Path, path: str, read: Callable[[Path], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """read() of --ckpt_load_path `path` (at `p`) on rank 0 (downloaded first from object storage:
    rank 0 reads it whole anyway), {} elsewhere; a failure is one CheckpointError on every rank,
    none left waiting."""
    box: list[dict[str, torch.Tensor]] = [{}]

    def work() -> None:
        try:
            with local_copy(p) as local:
                box[0] = read(local)
        except Exception as e:
            if unreadable(e):
                raise CheckpointError(damage(e)) from None
            if not (storage_error(e) or isinstance(e, (ValueError, pickle.UnpicklingError, CheckpointError))):
                raise
            raise CheckpointError(first_line(e)) from None

    on_rank0(work, CheckpointError, lambda message: CheckpointError(f"--ckpt_load_path: {path}: {message}"))
    return box[0]


def _read_hf(model: torch.nn.Module, p: Path, path: str) -> None:
    """Each rank reads its slices of the Hugging Face folder `p` into its shards (hf_read.py); the folder
    indexed on rank 0 first. A failure on any rank is one CheckpointError on every rank."""
    entries = on_rank0(
        lambda: index_folder(p),
        lambda e: isinstance(e, HFError) or storage_error(e),
        lambda message: CheckpointError(f"--ckpt_load_path: {message}"),
    )
    own = {k: plain_tensor(v) for k, v in get_model_state_dict(model).items() if not is_adapter(k)}
    error: Optional[Exception] = None
    try:
        check_shapes({k: tuple(v.shape) for k, v in own.items()}, entries, model.config, path)
        read_into(own, p, entries, model.config)
    except Exception as e:
        error = e
    first = next((f[1] for f in failures(error) if f is not None), None)
    if error is not None and not (isinstance(error, HFError) or storage_error(error)):
        raise error
    if first is not None:
        raise CheckpointError(f"--ckpt_load_path: {first}")
    _set(model, own, StateDictOptions())


def _read_file(model: torch.nn.Module, p: Path, path: str, variant: str) -> None:
    """Each rank reads only the rows of its shards from the model file `p` (a .safetensors file by byte
    ranges, local or remote; a local .pth file memory-mapped), a model built unfused (tensor parallel)
    from the rows of the fused tensors. A failure on any rank is one CheckpointError on every rank."""
    own = {k: plain_tensor(v) for k, v in get_model_state_dict(model).items() if not is_adapter(k)}
    shapes = {k: t.shape for k, t in model.named_parameters()}
    origin = {  # a part of a fused tensor: (the fused tensor, its first row there, the fused tensor's rows)
        member: (fused, row, members[-1][1] + shapes[members[-1][0]][0])
        for fused, members in fused_parts(shapes).items()
        for member, row in members
    }
    error: Optional[Exception] = None
    try:
        tensors = model_reader(p)
        for key, value in own.items():
            name, first, rows = origin.get(key, (key, 0, value.shape[0]))
            if name not in tensors.shapes or tuple(tensors.shapes[name]) != (rows, *value.shape[1:]):
                held = list(tensors.shapes[name]) if name in tensors.shapes else "missing"
                raise _Misfit(f"{name} is {held} there, the model's {key} {list(value.shape)}")
            local = value.to_local() if isinstance(value, DTensor) else value
            offset, shape = local_box(value)
            if local.numel():
                mine = tensors.rows(name, first + offset[0], first + offset[0] + shape[0])
                local.copy_(mine if len(shape) == 1 else mine[:, offset[1] : offset[1] + shape[1]])
    except Exception as e:
        error = e
    every = failures(error, lambda e: "misfit" if isinstance(e, _Misfit) else "error")
    found = next((f for f in every if f is not None), None)
    if error is not None and not (
        isinstance(error, (HFError, CheckpointError, ValueError, OSError)) or storage_error(error)
    ):
        raise error  # the same on every rank (a damaged .pth): load_weights says so in one line
    if found is not None and found[0] == "misfit":
        raise CheckpointError(
            f"--ckpt_load_path: {path} does not fit --model_variant={variant} (vocab {model.config.src_vocab_size}): "
            f"{found[1]}"
        )
    if found is not None:  # a reader's error names the file
        raise CheckpointError(f"--ckpt_load_path: {found[1]}")
    _set(model, own, StateDictOptions())


class _Misfit(ValueError):
    """A model file's tensor that does not hold the model's."""


def _set(model: torch.nn.Module, state: dict[str, torch.Tensor], options: StateDictOptions) -> None:
    """Load the model's weights (a whole state dict with fused keys is cut to fit a model built
    unfused); only LoRA's adapters may be missing (they start from their init)."""
    result = set_model_state_dict(model, split_full(state, model), options=replace(options, strict=False))
    missing = [k for k in result.missing_keys if not is_adapter(k)]
    unexpected = [k for k in result.unexpected_keys if not _another_stages(model, k)]
    if missing or unexpected:
        raise KeyError(f"missing {missing[:3]}, unexpected {unexpected[:3]}")


def _another_stages(model: torch.nn.Module, key: str) -> bool:
    """Whether `key` names a module that a pipeline rank's model leaves to other stages (pipeline.prune:
    a block, the embedding, the final norm or the head); rank 0's whole state reaches every rank."""
    layers = model.base_model.layers
    if not isinstance(layers, torch.nn.ModuleDict):  # not a pipeline rank's model
        return False
    parts = key.split(".")
    if parts[:2] == ["base_model", "layers"]:
        return parts[2] not in layers
    if parts[0] == "head":
        return model.head is None
    return (
        parts[:2] in (["base_model", "embedding"], ["base_model", "dec_norm"])
        and getattr(model.base_model, parts[1]) is None
    )
