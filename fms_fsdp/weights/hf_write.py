"""Writing safetensors files tensor by tensor: a model's export (Hugging Face names, or fms's own) is
planned from its tensors' shapes alone, cut into files, and each file streamed: its header first, then
each tensor read from a checkpoint folder a few MB of rows at a time (`Tensors.rows`), converted and
appended. No process holds more than those rows, whatever the model's size; with several ranks each
writes its own files (`part`), several ranks one file at once when there are fewer files than ranks
(an fms export's one file), and rank 0 the index and the configuration.
The files are those of transformers' `save_pretrained`: `model.safetensors` alone, or
`model-0000k-of-0000n.safetensors` with `model.safetensors.index.json`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import torch
from fms.models.llama import LLaMAConfig

from fms_fsdp.model.lora import LoRASpec
from fms_fsdp.model.shapes import hidden_dim
from fms_fsdp.weights.hf_read import DTYPES, FMS_PROJECTIONS, INDEX, expert_rows, rope_fms_to_hf, sources
from fms_fsdp.weights.reader import Tensors

SHARD_BYTES = 5 * 2**30  # like transformers' default max_shard_size
_CHUNK = 16 * 2**20  # bytes of source rows read, cast and written at a time
_SOURCE_BYTES = 4  # a source row's bytes per element, at most (fp32)
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class Planned:
    """One tensor of the export: its name, the fms tensor and rows it comes from, its shape and dtype,
    whether its rows are rotary rows to put in Hugging Face's order (q, k)."""

    name: str
    key: str
    start: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    rope: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def hf_plan(config: LLaMAConfig, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> list[Planned]:
    """The Hugging Face tensors of an fms model (fused names and whole shapes), in transformers' order:
    embedding, final norm, head, then each block."""
    top = ["base_model.embedding.weight", "base_model.dec_norm.weight"] + ([] if config.tie_heads else ["head.weight"])
    keys = [k for k in top if k in shapes] + [k for k in shapes if k.startswith("base_model.layers.")]
    keys.sort(key=lambda k: int(k.split(".")[2]) if k.startswith("base_model.layers.") else -1)
    plan: list[Planned] = []
    for key in keys:
        row, shape = 0, expert_rows(shapes[key])
        found = sources(key, {}, config)
        for source, rows in zip(found, _rows(config, key, shape[0], len(found))):
            plan.append(Planned(source.name, key, row, (rows, *shape[1:]), dtype, source.rope))
            row += rows
    return plan


def _rows(config: LLaMAConfig, key: str, rows: int, parts: int) -> list[int]:
    """The rows of each of the `parts` of fms tensor `key` (q, k, v; gate, up; a sparse block's experts'
    equal parts), its rows when it has one part."""
    kv = (config.kvheads or config.nheads) * (config.emb_dim // config.nheads)
    path = key.rsplit(".", 1)[0].split(".", 3)[-1]
    if path == "attn.in_proj.qkv_fused":
        return [config.emb_dim, kv, kv]
    if path == "ff_sub_layer.wg1_fused":
        return [hidden_dim(config)] * 2
    assert path not in FMS_PROJECTIONS or len(FMS_PROJECTIONS[path]) == 1, key
    return [rows // parts] * parts


def stacked_experts(tensors: Tensors) -> Tensors:
    """`tensors` with each 3-D one (a sparse block's experts) read as its rows stacked (expert_rows),
    one expert at a time, the last one kept for its next rows."""
    last: dict[tuple[str, int], torch.Tensor] = {}

    def rows(key: str, a: int, b: int) -> torch.Tensor:
        shape = tensors.shapes[key]
        if len(shape) != 3:
            return tensors.rows(key, a, b)
        per, parts = shape[1], []
        for e in range(a // per, (b - 1) // per + 1):
            if (key, e) not in last:
                last.clear()
                last[(key, e)] = tensors.rows(key, e, e + 1)[0]
            parts.append(last[(key, e)][max(a - e * per, 0) : min(b - e * per, per)])
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    return Tensors({k: torch.Size(expert_rows(tuple(s))) for k, s in tensors.shapes.items()}, rows)


def fms_plan(shapes: dict[str, tuple[int, ...]], dtypes: dict[str, torch.dtype]) -> list[Planned]:
    """An fms export's tensors: each under its own name, whole, in its own dtype."""
    return [Planned(k, k, 0, tuple(s), dtypes[k]) for k, s in shapes.items()]


def _runs(plan: list[Planned], n: int) -> list[int]:
    """For each tensor of the plan, which of `n` consecutive runs of about equal bytes it falls in."""
    total = max(1, sum(p.nbytes for p in plan))
    runs, done = [], 0
    for p in plan:
        runs.append(min(n - 1, done * n // total))
        done += p.nbytes
    return runs


def split(plan: list[Planned], files: int, max_bytes: int = SHARD_BYTES) -> list[list[Planned]]:
    """The plan cut into consecutive files of about equal bytes: at least `files` (one per writing rank)
    and as many as keep each under max_bytes (a tensor larger than that is a file of its own)."""
    n = max(1, min(len(plan), max(files, math.ceil(sum(p.nbytes for p in plan) / max_bytes))))
    out: list[list[Planned]] = [[] for _ in range(n)]
    for p, run in zip(plan, _runs(plan, n)):
        out[run].append(p)
    return [f for f in out if f]


def file_names(files: int) -> list[str]:
    return (
        ["model.safetensors"] if files == 1 else [f"model-{i + 1:05d}-of-{files:05d}.safetensors" for i in range(files)]
    )


class Converter:
    """The tensors of a plan, each a few MB of rows at a time, cut out of the fms tensor they come from
    (`Tensors.rows`) and their rotary rows put in Hugging Face's order (q, k: whole heads at a time),
    in the reader's dtype (write_file casts each run); nothing is held beyond one run of rows."""

    def __init__(self, tensors: Tensors, config: Optional[LLaMAConfig] = None):
        self.tensors, self.config = tensors, config

    def __call__(self, p: Planned) -> Iterator[torch.Tensor]:
        rows = p.shape[0] if p.shape else 1
        step = max(1, _CHUNK // max(1, math.prod(p.shape[1:]) * _SOURCE_BYTES))
        head = 1
        if p.rope:
            assert self.config is not None
            head = self.config.emb_dim // self.config.nheads
            step = max(head, step // head * head)
        for lo in range(0, rows, step):
            t = self.tensors.rows(p.key, p.start + lo, p.start + min(rows, lo + step))
            yield rope_fms_to_hf(t, head) if p.rope else t


def write_file(
    path: Path,
    plan: list[Planned],
    convert: Callable[[Planned], Iterable[torch.Tensor]],
    meta: dict,
    share: tuple[int, int] = (0, 1),
) -> None:
    """One safetensors file, streamed: the header from the plan, then each tensor as it is converted.
    share=(k, m): m writers (ranks on one file system) write the file at once, each in place: writer k
    its k-th consecutive run of the tensors by bytes, writer 0 the header too; the file must not exist
    before (nothing truncates it)."""
    header: dict = {"__metadata__": meta} if meta else {}
    offsets = []
    offset = 0
    for p in plan:
        header[p.name] = {"dtype": _NAMES[p.dtype], "shape": list(p.shape), "data_offsets": [offset, offset + p.nbytes]}
        offsets.append(offset)
        offset += p.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    k, m = share
    mine = [(p, at) for p, at, run in zip(plan, offsets, _runs(plan, m)) if run == k]
    f = open(path, "wb") if m == 1 else os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT, 0o666), "wb")
    with f:
        if k == 0:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
        for p, at in mine:
            f.seek(8 + len(raw) + at)
            written = 0
            for rows in convert(p):  # a few MB at a time, cast as written
                f.write(memoryview(rows.to(p.dtype).contiguous().reshape(-1).view(torch.uint8).numpy()))
                written += rows.numel() * p.dtype.itemsize
            assert written == p.nbytes, (p.name, written, p.nbytes)


def write_part(
    folder: Path,
    files: list[list[Planned]],
    convert: Callable[[Planned], Iterable[torch.Tensor]],
    part: tuple[int, int] = (0, 1),
    meta: Optional[dict] = None,
    shared: bool = False,
) -> list[str]:
    """Rank part[0] of part[1]'s files of the export into `folder` (which exists): every part[1]-th file.
    `shared`: every rank writes into this one folder (a local or shared file system), so when there
    are fewer files than ranks (an fms export's one file), each file is written by several ranks at
    once (write_file's `share`)."""
    names = file_names(len(files))
    rank, ranks = part
    if shared and len(files) < ranks:
        i = rank % len(files)
        writers = len(range(i, ranks, len(files)))
        write_file(folder / names[i], files[i], convert, meta or {"format": "pt"}, (rank // len(files), writers))
        return [names[i]]
    mine = list(range(rank, len(files), ranks))
    for i in mine:
        write_file(folder / names[i], files[i], convert, meta or {"format": "pt"})
    return [names[i] for i in mine]


def write_index(folder: Path, files: list[list[Planned]]) -> None:
    """model.safetensors.index.json, when there is more than one file."""
    if len(files) == 1:
        return
    names = file_names(len(files))
    total = sum(p.nbytes for f in files for p in f)
    weight_map = {p.name: names[i] for i, f in enumerate(files) for p in f}
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def merging(tensors: Tensors, spec: LoRASpec) -> Tensors:
    """A LoRA model's tensors with each adapted weight's rows merged, W + (alpha / r) B A."""
    adapted = {k.removesuffix(".lora_A") for k in tensors.shapes if k.endswith(".lora_A")}

    def rows(key: str, a: int, b: int) -> torch.Tensor:
        out = tensors.rows(key, a, b)
        layer = key.removesuffix(".weight")
        if layer not in adapted:
            return out
        lora_a = tensors.read([f"{layer}.lora_A"])[f"{layer}.lora_A"]
        lora_b = tensors.rows(f"{layer}.lora_B", a, b)
        return (out.float() + (spec.alpha / spec.rank) * lora_b.float() @ lora_a.float()).to(out.dtype)

    return Tensors(tensors.shapes, rows)
