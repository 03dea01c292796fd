"""Hugging Face interop: fms LLaMA checkpoints <-> transformers LlamaForCausalLM folders.

`convert` (fms_to_hf.py, `fms-to-hf`) writes a checkpoint folder or model file as a Hugging Face
folder; `read_hf_config`, `check_hf_config` (shapes, rotary settings) and `check_hf_fields` (norm
epsilon, positions, tied embeddings) check a folder's config.json against the run's model for
--ckpt_load_path, and an export keeps that folder's special token ids (`source_tokens`);
`write_peft_adapter` writes a LoRA run's adapters for PEFT (exports).

HF -> fms is hf_read.py's, used by load.py: each rank reads its slices in place, as ibm-fms's own hf
adapter maps names and rotary rows.
fms -> HF is written here: ibm-fms 1.13's `convert_to_hf` swaps gate and up projections, applies the
wrong inverse rotary permutation for head_dim != 4 and misspells max_position_embeddings (checked:
its logits differ by 3e-2), so this module inverts fms's own hf->fms steps instead, and a test checks
the round trip is bit-exact. Tensors are read, converted and written one at a time (hf_write.py), so
a conversion holds a few tensors, never the model.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Optional

import torch
from fms.models.llama import LLaMAConfig
from safetensors.torch import save_file

from fms_fsdp.errors import CheckpointError, HFError
from fms_fsdp.model.lora import LoRASpec
from fms_fsdp.model.moe import MOE_FIELDS, MoEConfig
from fms_fsdp.model.shapes import hidden_dim
from fms_fsdp.model.variants import build_model, context_length, get_model_config
from fms_fsdp.storage import local_copy, location, publish
from fms_fsdp.versions import check_layout
from fms_fsdp.weights.hf_read import FMS_PROJECTIONS, HF_PROJECTIONS, rope_fms_to_hf
from fms_fsdp.weights.hf_write import SHARD_BYTES, Converter, hf_plan, split, stacked_experts, write_index, write_part
from fms_fsdp.weights.reader import Tensors, model_reader

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def hf_config(
    model_config: LLaMAConfig, dtype: torch.dtype, bos_token_id: Optional[int], eos_token_id: Optional[int]
) -> dict:
    """config.json of the LlamaForCausalLM equivalent to an fms LLaMAConfig."""
    scaling = hf_rope_scaling(model_config)
    rope = {"rope_type": "default"} if scaling is None else scaling
    sparse = isinstance(model_config, MoEConfig)
    return {
        "architectures": ["MixtralForCausalLM" if sparse else "LlamaForCausalLM"],
        "model_type": "mixtral" if sparse else "llama",
        **(_mixtral_fields(model_config) if sparse else {}),
        "vocab_size": model_config.src_vocab_size,
        "hidden_size": model_config.emb_dim,
        "intermediate_size": hidden_dim(model_config),
        "num_hidden_layers": model_config.nlayers,
        "num_attention_heads": model_config.nheads,
        "num_key_value_heads": model_config.kvheads or model_config.nheads,
        "head_dim": model_config.emb_dim // model_config.nheads,
        "hidden_act": "silu",
        "max_position_embeddings": context_length(model_config),
        "rms_norm_eps": model_config.norm_eps,
        "rope_theta": float(model_config.rope_theta),
        "rope_scaling": scaling,
        "rope_parameters": {**rope, "rope_theta": float(model_config.rope_theta)},
        "attention_bias": model_config.attn_bias,
        "mlp_bias": model_config.mlp_bias,
        "attention_dropout": 0.0,
        "tie_word_embeddings": model_config.tie_heads,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "dtype": str(dtype).removeprefix("torch."),
    }


def _mixtral_fields(model_config: MoEConfig) -> dict:
    """config.json's fields of MixtralForCausalLM beyond Llama's: the experts, and no sliding window."""
    return {
        "num_local_experts": model_config.moe_experts,
        "num_experts_per_tok": model_config.moe_top_k,
        "output_router_logits": False,
        "sliding_window": None,
    }


def projection_to_hf(model_config: LLaMAConfig, fms_name: str, rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """HF projection name -> its part of a tensor whose rows are fms projection `fms_name`'s outputs (a
    weight, a bias, or LoRA's B): fused ones split, q and k rows put in HF's rotary order."""
    head_dim = model_config.emb_dim // model_config.nheads
    kv = (model_config.kvheads or model_config.nheads) * head_dim
    sizes = {
        "attn.in_proj.qkv_fused": [model_config.emb_dim, kv, kv],
        "ff_sub_layer.wg1_fused": [hidden_dim(model_config)] * 2,
    }
    parts = torch.split(rows, sizes[fms_name], dim=0) if fms_name in sizes else (rows,)
    return {
        name: rope_fms_to_hf(part, head_dim) if name in ("q_proj", "k_proj") else part
        for name, part in zip(FMS_PROJECTIONS[fms_name], parts)
    }


def write_hf_folder(
    model_config: LLaMAConfig,
    tensors: Tensors,
    shapes: dict[str, tuple[int, ...]],
    out: str,
    dtype: torch.dtype,
    bos_token_id: Optional[int],
    eos_token_id: Optional[int],
    max_shard_bytes: int = SHARD_BYTES,
) -> Path:
    """Write config.json, generation_config.json and the safetensors files (of at most max_shard_bytes,
    with an index when more than one) of the fms tensors `shapes` into `out`, tensor by tensor
    (hf_write.py), atomically: a temporary folder renamed at the end."""
    if isinstance(model_config, MoEConfig) and model_config.moe_shared_experts:
        raise HFError(
            "a model with shared experts (--moe_shared_experts) has no Hugging Face export: Mixtral's layout has "
            "none; export it with --export_format=fms"
        )
    target = Path(out).resolve()
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    files = split(hf_plan(model_config, shapes, dtype), 1, max_shard_bytes)
    write_part(tmp, files, Converter(stacked_experts(tensors), model_config))
    write_index(tmp, files)
    write_hf_config(tmp, model_config, dtype, bos_token_id, eos_token_id)
    if target.exists():  # an empty folder (callers refuse anything else)
        target.rmdir()
    os.replace(tmp, target)
    return target


def write_hf_config(
    folder: Path,
    model_config: LLaMAConfig,
    dtype: torch.dtype,
    bos_token_id: Optional[int],
    eos_token_id: Optional[int],
) -> None:
    """config.json and generation_config.json of a Hugging Face folder."""
    (folder / "config.json").write_text(
        json.dumps(hf_config(model_config, dtype, bos_token_id, eos_token_id), indent=2)
    )
    (folder / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos_token_id, "eos_token_id": eos_token_id}, indent=2)
    )


def read_hf_config(folder: str | Path) -> dict:
    """config.json of a Hugging Face folder (a local path, or a Path of object storage)."""
    path = (Path(folder) if isinstance(folder, str) else folder) / "config.json"
    if not path.is_file():
        raise HFError(f"{folder}: no config.json: not a Hugging Face model folder")
    return json.loads(path.read_text())


def hf_rope_scaling(model_config: LLaMAConfig) -> Optional[dict]:
    """config.json's rope_scaling of an fms config: llama3's, or None (no scaling)."""
    scaling = dict(model_config.rope_scaling or {})
    if not scaling or scaling.get("rope_type", "regular") == "regular":
        return None
    if scaling.get("rope_type") != "llama3":
        raise HFError(f"rope_scaling={scaling} has no Hugging Face translation here (only rope_type llama3)")
    return {k: scaling[k] for k in LLAMA3_SCALING}


LLAMA3_SCALING = ("rope_type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _their_scaling(hf: dict) -> Optional[dict]:
    """A config.json's rotary scaling (rope_scaling, or transformers 5's rope_parameters), None for none."""
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    return {k: scaling.get(k) if k == "rope_type" else float(scaling.get(k, 0.0)) for k in LLAMA3_SCALING}


def _rope(model_config: LLaMAConfig) -> tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling) of an fms config, as _their_rope reads a config.json."""
    scaling = hf_rope_scaling(model_config)
    if scaling is not None:
        scaling = {k: v if k == "rope_type" else float(v) for k, v in scaling.items()}
    return float(model_config.rope_theta), scaling


def _their_rope(hf: dict) -> tuple[float, Optional[dict]]:
    theta = hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    return float(theta), _their_scaling(hf)


def check_hf_config(hf: dict, model_config: LLaMAConfig, folder: str, variant: Optional[str] = None) -> None:
    """HFError naming the first dimension where the folder's model and the fms config differ. Its rotary
    settings must be the run's or, when the run changes them (--rope_theta, --rope_scaling_factor),
    those of `variant` (a model whose context is being extended)."""
    pairs = {
        "num_local_experts": (hf.get("num_local_experts") or 0, getattr(model_config, "moe_experts", 0)),
        "vocab_size": (hf.get("vocab_size"), model_config.src_vocab_size),
        "hidden_size": (hf.get("hidden_size"), model_config.emb_dim),
        "intermediate_size": (hf.get("intermediate_size"), hidden_dim(model_config)),
        "num_hidden_layers": (hf.get("num_hidden_layers"), model_config.nlayers),
        "num_attention_heads": (hf.get("num_attention_heads"), model_config.nheads),
        "num_key_value_heads": (
            hf.get("num_key_value_heads", hf.get("num_attention_heads")),
            model_config.kvheads or model_config.nheads,
        ),
    }
    if isinstance(model_config, MoEConfig):
        pairs["num_experts_per_tok"] = (hf.get("num_experts_per_tok"), model_config.moe_top_k)
    for name, (theirs, ours) in pairs.items():
        if theirs != ours:
            raise HFError(
                f"{folder}: {name} is {theirs} but the model variant has {ours}; "
                "choose the matching --model_variant (and --vocab_size)"
            )
    theirs_rope, ours_rope = _their_rope(hf), _rope(model_config)
    accepted = [ours_rope] + ([_rope(get_model_config(variant))] if variant is not None else [])
    if theirs_rope not in accepted:
        (theta, scaling), (our_theta, our_scaling) = theirs_rope, ours_rope
        raise HFError(
            f"{folder}: rope_theta {theta} and rope_scaling {scaling}, but the run has rope_theta {our_theta} and "
            f"rope_scaling {our_scaling}; choose the matching --model_variant (or --rope_theta, --rope_scaling_factor)"
        )


def check_hf_fields(hf: dict, model_config: LLaMAConfig, folder: str, variant: str, positions: int) -> None:
    """HFError naming the first config.json field that the run would not carry, with both values and
    the flag that makes them agree: rms_norm_eps (--norm_eps), max_position_embeddings
    (--max_position_embeddings; `positions` is the run's before a longer --seq_length extends it) and
    tie_word_embeddings (the variant's). The shapes and the rotary settings are check_hf_config's."""
    eps = hf.get("rms_norm_eps")
    if eps is not None and float(eps) != model_config.norm_eps:
        raise HFError(f"{folder}: rms_norm_eps is {eps} but the run has {model_config.norm_eps}; set --norm_eps={eps}")
    theirs = hf.get("max_position_embeddings")
    # the run's, or the variant's own where the run extends it (--rope_scaling_factor, a longer --seq_length)
    accepted = (positions, context_length(model_config), context_length(get_model_config(variant)))
    if theirs is not None and theirs not in accepted:
        raise HFError(
            f"{folder}: max_position_embeddings is {theirs} but the run has {positions}; "
            f"set --max_position_embeddings={theirs}"
        )
    tied = bool(hf.get("tie_word_embeddings", False))
    if tied != bool(model_config.tie_heads):
        raise HFError(
            f"{folder}: tie_word_embeddings is {str(tied).lower()} but {variant}'s embeddings are "
            f"{'tied' if model_config.tie_heads else 'untied'}; choose a --model_variant whose embeddings are "
            f"{'tied' if tied else 'untied'} (llama3.2_* tie them)"
        )


def special_tokens(hf: dict) -> tuple[Optional[Any], Optional[Any]]:
    """A config.json's (bos_token_id, eos_token_id), each None where it names none (eos may be a list)."""
    return hf.get("bos_token_id"), hf.get("eos_token_id")


def _variant(
    load_path: Path, model_variant: Optional[str], vocab_size: Optional[int]
) -> tuple[str, Optional[int], dict]:
    """(variant, vocab size, run config) from the flags, else from the checkpoint's metadata.pth."""
    meta_file = load_path / "metadata.pth" if load_path.is_dir() else None
    run = {}
    if meta_file is not None and meta_file.is_file():
        with meta_file.open("rb") as f:
            meta = torch.load(io.BytesIO(f.read()), weights_only=True)
        check_layout(meta, load_path)
        run = meta.get("config", {})
    variant = model_variant or run.get("model_variant")
    if variant is None:
        raise HFError(f"--model_variant is needed: {load_path} does not record the variant it was trained with")
    return variant, vocab_size if vocab_size is not None else run.get("vocab_size"), run


def convert(
    load_path: str,
    save_path: str,
    model_variant: Optional[str] = None,
    vocab_size: Optional[int] = None,
    tokenizer_name_or_path: Optional[str] = None,
    dtype: str = "bf16",
) -> Path:
    """Write the Hugging Face folder; HFError/CheckpointError/ConfigError with one line on bad input."""
    if dtype not in DTYPES:
        raise HFError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    if not save_path:
        raise HFError("--save_path is required: the folder to write")
    src = location(load_path, "load_path")
    if not src.exists():
        raise HFError(f"--load_path: {load_path} does not exist")
    if src.is_dir() and not (src / ".metadata").is_file():
        raise HFError(
            f"--load_path: {load_path} is not a checkpoint folder (no .metadata): give a step_N_ckp "
            "folder or a .safetensors/.pth file"
        )
    target = location(save_path, "save_path")
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise HFError(f"--save_path: {save_path} exists and is not empty; choose a new folder (nothing is overwritten)")
    if tokenizer_name_or_path is not None and not Path(tokenizer_name_or_path).is_dir():
        raise HFError(f"--tokenizer_name_or_path: {tokenizer_name_or_path} is not a local folder")
    variant, vocab, run = _variant(src, model_variant, vocab_size)
    model_config = get_model_config(  # the trained length, rotary settings, norm epsilon and positions
        variant,
        vocab,
        run.get("seq_length"),
        1,
        run.get("rope_theta"),
        run.get("rope_scaling_factor"),
        norm_eps=run.get("norm_eps"),
        positions=run.get("max_position_embeddings"),
        moe={k: run[k] for k in MOE_FIELDS if run.get(k) is not None},
    )
    try:
        with local_copy(src) if src.is_file() else nullcontext(src) as readable:  # a remote file: downloaded
            return _convert(readable, target, model_config, variant, run, load_path, tokenizer_name_or_path, dtype)
    except CheckpointError as e:  # the checkpoint's files cannot be read (weights/reader.py)
        raise CheckpointError(f"--load_path: {e}") from None


def source_tokens(run: dict) -> tuple[Optional[Any], Optional[Any]]:
    """The special token ids an export of a run records: those of the Hugging Face folder it started
    from (its --ckpt_load_path, where that still holds a config.json naming them), else its --bos_token
    and --eos_token."""
    bos, eos = run.get("bos_token"), run.get("eos_token")
    source = run.get("ckpt_load_path")
    try:
        hf = read_hf_config(location(source, "ckpt_load_path")) if source else None
    except Exception:  # gone, or not a Hugging Face folder: the flags' ids
        hf = None
    if hf is not None:
        theirs_bos, theirs_eos = special_tokens(hf)
        bos = theirs_bos if theirs_bos is not None else bos
        eos = theirs_eos if theirs_eos is not None else eos
    return bos, eos


def _convert(
    src: Path,
    target: Path,
    model_config: LLaMAConfig,
    variant: str,
    run: dict,
    load_path: str,
    tokenizer_name_or_path: Optional[str],
    dtype: str,
) -> Path:
    tensors = model_reader(src)
    expected = {k: tuple(v.shape) for k, v in build_model(model_config, torch.device("meta")).state_dict().items()}
    found = {k: tuple(s) for k, s in tensors.shapes.items()}
    for key, shape in expected.items():
        if found.get(key) != shape:
            raise HFError(
                f"--model_variant={variant} does not match {load_path}: {key} is "
                f"{list(found[key]) if key in found else 'missing'} there, {list(shape)} for {variant}"
            )
    bos, eos = source_tokens(run)
    tokenizer = None
    if tokenizer_name_or_path is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_name_or_path, local_files_only=True)
        bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else bos
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else eos
    with publish(target) as tmp:  # object storage too: uploaded, COMPLETE last
        write_hf_folder(model_config, tensors, expected, str(tmp), DTYPES[dtype], bos, eos)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    return target


def write_peft_adapter(
    state: dict[str, torch.Tensor], config: LLaMAConfig, spec: LoRASpec, base: str, out: Path
) -> Path:
    """A PEFT LoRA adapter folder for the Hugging Face form of the model (`base`, the --ckpt_load_path it
    adapts), from a full state with adapters."""
    tensors: dict[str, torch.Tensor] = {}
    for key in state:
        if not key.endswith(".lora_A"):
            continue
        layer = key.removesuffix(".lora_A")  # base_model.layers.<i>.<fms projection>
        i, fms_name = int(layer.split(".")[2]), layer.split(".", 3)[3]
        a = state[key]
        for hf_name, part in projection_to_hf(config, fms_name, state[f"{layer}.lora_B"]).items():
            prefix = f"base_model.model.model.layers.{i}.{HF_PROJECTIONS[hf_name]}"
            tensors[f"{prefix}.lora_A.weight"] = a.clone()  # shared by the parts: one copy each
            tensors[f"{prefix}.lora_B.weight"] = part.contiguous()
    targets = sorted(
        {hf for path, names in FMS_PROJECTIONS.items() if path.rsplit(".", 1)[-1] in spec.targets for hf in names}
    )
    adapter_config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "base_model_name_or_path": base,
        "inference_mode": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    return out
