"""A Hugging Face Llama folder read into a model in place, each rank reading only the slices of the
tensors it holds, straight from the safetensors files: memory-mapped when local, read by byte ranges
from object storage. No rank holds more than its own shards and one tensor's slice in flight.

The folder is indexed first (model.safetensors.index.json, each file's safetensors header): a shard
the index names that is missing, a truncated or damaged file, a tensor whose shape does not fit the
model or whose dtype is not one of DTYPES (a quantized FP8 folder), each is one HFError naming the file,
before anything is read. Names are mapped to fms's and
the q/k rows put in fms's rotary order slice by slice (whole heads are read around a slice), for any
sharding: FSDP/HSDP, tensor parallel, a pipeline stage's blocks, context parallel, LoRA's base.
"""

from __future__ import annotations

import json
import math
import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from fms.models.llama import LLaMAConfig
from torch.distributed.tensor import DTensor

from fms_fsdp.compat import local_box
from fms_fsdp.errors import HFError
from fms_fsdp.storage import open_random
from fms_fsdp.weights.items import read_rows

INDEX = "model.safetensors.index.json"
# safetensors' dtype names
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
# Hugging Face's projection modules, under model.layers.<i>.
HF_PROJECTIONS = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}


# fms's projections in a block -> Hugging Face's, in the order of their rows in the fms tensor
FMS_PROJECTIONS = {
    "attn.in_proj.qkv_fused": ("q_proj", "k_proj", "v_proj"),
    "attn.dense": ("o_proj",),
    "ff_sub_layer.wg1_fused": ("gate_proj", "up_proj"),
    "ff_sub_layer.w2": ("down_proj",),
}


_LAYER = re.compile(r"^base_model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
# a sparse block's experts, [experts, rows, columns]: read and written as the 2-D tensor of their rows
# stacked (expert_rows), each expert's rows in Mixtral's tensors (w1 = gate, w3 = up; w2 = down)
_EXPERTS = re.compile(r"^base_model\.layers\.(\d+)\.ff_sub_layer\.cond_ffn\.(w13|w2)$")
_MIXTRAL = "model.layers.{}.block_sparse_moe"
# a model built unfused (tensor parallel): its projections' Hugging Face names
_UNFUSED = {
    "attn.in_proj.query": "q_proj",
    "attn.in_proj.key": "k_proj",
    "attn.in_proj.value": "v_proj",
    "ff_sub_layer.wg": "gate_proj",
    "ff_sub_layer.w1": "up_proj",
}
_NORMS = {"ln": "model.layers.{}.input_layernorm", "ff_ln": "model.layers.{}.post_attention_layernorm"}
_TOP = {
    "base_model.embedding.weight": "model.embed_tokens.weight",
    "base_model.dec_norm.weight": "model.norm.weight",
    "head.weight": "lm_head.weight",
}


def rope_fms_to_hf(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Inverse of fms's _hf_to_fms_rope: fms rotates interleaved pairs, HF the two halves."""
    heads = t.size(0) // head_dim
    return t.view(heads, head_dim // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


@dataclass(frozen=True)
class Entry:
    """Where one tensor is: its file (in the folder), dtype, shape and bytes [start, end) in the file."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def index_folder(folder: Path) -> dict[str, Entry]:
    """Every tensor of a Hugging Face folder's safetensors files, from the index and the files' headers
    (a few small reads per file); HFError naming the file when one is missing, truncated or damaged."""
    index = folder / INDEX
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError) as e:
            raise HFError(f"{index} is damaged: no weight_map ({type(e).__name__})") from None
        for name in files:
            if not (folder / name).is_file():
                raise HFError(f"{folder / name} is missing (named in {INDEX})")
    else:
        files = sorted(p.name for p in folder.iterdir() if p.name.endswith(".safetensors"))
    if not files:
        raise HFError(f"{folder}: no .safetensors weights")
    entries: dict[str, Entry] = {}
    for name in files:
        entries.update(file_entries(folder / name, name))
    return entries


def file_entries(path: Path, name: str) -> dict[str, Entry]:
    """The tensors of one safetensors file, from its header (8 bytes of length, then JSON)."""
    size = path.stat().st_size
    with open_random(path) as f:
        length = int.from_bytes(f.read(8), "little") if size >= 8 else 0
        if not 0 < length <= size - 8:
            raise HFError(f"{path} is truncated or not a safetensors file ({size:,} bytes)")
        try:
            header = json.loads(bytes(f.read(length)))
        except ValueError:
            raise HFError(f"{path} is damaged: its safetensors header is not JSON") from None
    header.pop("__metadata__", None)
    base = 8 + length
    entries = {
        key: Entry(
            name, meta["dtype"], tuple(meta["shape"]), base + meta["data_offsets"][0], base + meta["data_offsets"][1]
        )
        for key, meta in header.items()
    }
    needed = max((e.end for e in entries.values()), default=base)
    if size < needed:
        raise HFError(f"{path} is truncated ({size:,} of {needed:,} bytes)")
    return entries


@dataclass(frozen=True)
class Source:
    """One Hugging Face tensor whose rows are a run of an fms tensor's rows (rope: q/k, in HF's order)."""

    name: str
    rope: bool


def expert_rows(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The 2-D shape an fms tensor is read and written as: a sparse block's experts (3-D) with their
    rows stacked, expert after expert; any other tensor its own."""
    return (shape[0] * shape[1], *shape[2:]) if len(shape) == 3 else shape


def sources(key: str, entries: dict[str, Entry], config: LLaMAConfig) -> list[Source]:
    """The Hugging Face tensors an fms state-dict key is made of, in row order (a sparse block's
    experts in Mixtral's layout, their rows stacked as expert_rows has them)."""
    found = _EXPERTS.match(key)
    if found is not None:
        layer, weight = found.groups()
        names = ("w1", "w3") if weight == "w13" else ("w2",)
        block, experts = _MIXTRAL.format(layer), int(getattr(config, "moe_experts", 0))
        return [Source(f"{block}.experts.{e}.{n}.weight", False) for e in range(experts) for n in names]
    if key in _TOP:
        name = _TOP[key]
        if name not in entries and key == "head.weight" and config.tie_heads:
            name = "model.embed_tokens.weight"
        return [Source(name, False)]
    m = _LAYER.match(key)
    if m is None:
        raise HFError(f"{key} has no Hugging Face counterpart")
    if ".shared." in key:
        raise HFError(f"{key}: a shared expert has no place in Mixtral's layout (--moe_shared_experts)")
    layer, path, kind = m.groups()
    if path == "ff_sub_layer.gate":
        return [Source(f"{_MIXTRAL.format(layer)}.gate.{kind}", False)]
    if path in _NORMS:
        return [Source(f"{_NORMS[path].format(layer)}.{kind}", False)]
    parts = FMS_PROJECTIONS.get(path) or (_UNFUSED[path],)
    return [Source(f"model.layers.{layer}.{HF_PROJECTIONS[p]}.{kind}", p in ("q_proj", "k_proj")) for p in parts]


def check_shapes(
    shapes: dict[str, tuple[int, ...]], entries: dict[str, Entry], config: LLaMAConfig, folder: str
) -> None:
    """HFError naming the file of the first Hugging Face tensor that is absent, of a dtype this module does
    not read, or does not fit the fms tensor it is read into (global shapes)."""
    for key, whole in shapes.items():
        shape = expert_rows(whole)
        found = sources(key, entries, config)
        for s in found:
            if s.name not in entries:
                raise HFError(f"{folder}: no tensor {s.name} in its safetensors files")
            entry = entries[s.name]
            if entry.dtype not in DTYPES:
                raise unknown_dtype(f"{folder}/{entry.file}", s.name, entry.dtype)
        rows = sum(entries[s.name].shape[0] for s in found)
        columns = {entries[s.name].shape[1:] for s in found}
        if rows != shape[0] or columns != {tuple(shape[1:])}:
            s = found[0]
            raise HFError(
                f"{folder}/{entries[s.name].file}: {s.name} is {list(entries[s.name].shape)}, which does not fit "
                f"the model's {key} {list(whole)}; choose the matching --model_variant (and --vocab_size)"
            )


def unknown_dtype(file: str, name: str, dtype: str) -> HFError:
    """The error for tensor `name` of safetensors `file`, of a dtype this module does not read."""
    return HFError(
        f"{file}: {name} is {dtype}, a safetensors dtype this reader does not read (it reads {', '.join(DTYPES)}); "
        "convert the weights to BF16, F16 or F32 first"
    )


class SliceReader:
    """Reads boxes of fms tensors from a Hugging Face folder's files, each file opened once."""

    def __init__(self, folder: Path, entries: dict[str, Entry], config: LLaMAConfig, stack: ExitStack):
        self.folder, self.entries, self.config, self.stack = folder, entries, config, stack
        self.head_dim = config.emb_dim // config.nheads
        self.files: dict[str, Any] = {}

    def box(self, key: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """Rows [offset[0], +shape[0]) and, for a matrix, columns [offset[1], +shape[1]) of fms tensor `key`."""
        lo, hi, row, pieces = offset[0], offset[0] + shape[0], 0, []
        for s in sources(key, self.entries, self.config):
            n = self.entries[s.name].shape[0]
            a, b = max(lo, row) - row, min(hi, row + n) - row
            if a < b:
                piece = self._rope_rows(s.name, a, b) if s.rope else self._rows(s.name, a, b)
                pieces.append(piece if len(shape) == 1 else piece[:, offset[1] : offset[1] + shape[1]])
            row += n
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def _rope_rows(self, name: str, a: int, b: int) -> torch.Tensor:
        """Rows [a, b) in fms's rotary order: the whole heads around them read, HF's halves interleaved."""
        d = self.head_dim
        h0, h1 = a // d * d, math.ceil(b / d) * d
        heads = self._rows(name, h0, h1)
        fms = heads.view((h1 - h0) // d, 2, d // 2, *heads.shape[1:]).transpose(1, 2).reshape(heads.shape)
        return fms[a - h0 : b - h0]

    def _rows(self, name: str, a: int, b: int) -> torch.Tensor:
        entry = self.entries[name]
        if entry.file not in self.files:
            self.files[entry.file] = self.stack.enter_context(open_random(self.folder / entry.file))
        return entry_rows(self.files[entry.file], entry, a, b, self.folder / entry.file, name)


def entry_rows(f: Any, entry: Entry, a: int, b: int, path: Path, name: str) -> torch.Tensor:
    """Rows [a, b) of a safetensors tensor (`entry` of the open file `f`, at `path`)."""
    out = read_rows(f, entry.start, entry.shape[1:], DTYPES[entry.dtype], a, b)
    if out is None:
        raise HFError(f"{path} is truncated (reading {name})")
    return out


def read_into(state: dict[str, torch.Tensor], folder: Path, entries: dict[str, Entry], config: LLaMAConfig) -> None:
    """Fill each tensor of a (sharded) model state dict in place with its slice of the folder's tensors."""
    with ExitStack() as stack:
        reader = SliceReader(folder, entries, config, stack)
        for key, value in state.items():
            local = value.to_local() if isinstance(value, DTensor) else value
            offset, shape = local_box(value)
            if not local.numel():
                continue
            if local.dim() == 3:  # a sparse block's experts: each expert's box of its stacked rows
                rows = value.shape[1]
                box = [
                    reader.box(key, (e * rows + offset[1], offset[2]), shape[1:])
                    for e in range(offset[0], offset[0] + shape[0])
                ]
                local.copy_(torch.stack(box))
            else:
                local.copy_(reader.box(key, offset, shape))
