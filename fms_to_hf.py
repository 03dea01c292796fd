"""Convert a checkpoint to a Hugging Face LlamaForCausalLM folder.

    python fms_to_hf.py --load_path=<ckpt_save_path>/checkpoints/step_N_ckp --save_path=out \
        [--model_variant=llama3_8b] [--tokenizer_name_or_path=local_tokenizer_dir] [--dtype=bf16|fp32]

--load_path: a checkpoint folder (this project's or fms-fsdp's) or a single .safetensors / .pth file.
--model_variant may be left out when the checkpoint holds its run's config (this project's do, with
any --vocab_size it was trained with). Runs on CPU without a process group; tensors are read and
written one layer at a time.
"""

import sys
from pathlib import Path
from typing import Optional

import fire
import torch

from fms_fsdp.checkpoint import CheckpointError, model_file_reader, read_model_keys, read_model_part
from fms_fsdp.config import ConfigError
from fms_fsdp.hf import DTYPES, HFError, write_hf_folder
from fms_fsdp.models import build_model, get_model_config


def _variant(load_path: Path, model_variant: Optional[str], vocab_size: Optional[int]) -> tuple[str, Optional[int], dict]:
    """(variant, vocab size, run config) from the flags, else from the checkpoint's metadata.pth."""
    meta_file = load_path / "metadata.pth" if load_path.is_dir() else None
    run = {}
    if meta_file is not None and meta_file.is_file():
        run = torch.load(meta_file, weights_only=True).get("config", {})
    variant = model_variant or run.get("model_variant")
    if variant is None:
        raise HFError(f"--model_variant is needed: {load_path} does not record the variant it was trained with")
    return variant, vocab_size if vocab_size is not None else run.get("vocab_size"), run


def convert(load_path: str, save_path: str, model_variant: Optional[str] = None, vocab_size: Optional[int] = None,
            tokenizer_name_or_path: Optional[str] = None, dtype: str = "bf16") -> Path:
    """Write the Hugging Face folder; HFError/CheckpointError/ConfigError with one line on bad input."""
    if dtype not in DTYPES:
        raise HFError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    if not save_path:
        raise HFError("--save_path is required: the folder to write")
    src = Path(load_path)
    if not src.exists():
        raise HFError(f"--load_path: {load_path} does not exist")
    if src.is_dir() and not (src / ".metadata").is_file():
        raise HFError(f"--load_path: {load_path} is not a checkpoint folder (no .metadata): give a step_N_ckp "
                      "folder or a .safetensors/.pth file")
    target = Path(save_path)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise HFError(f"--save_path: {save_path} exists and is not empty; choose a new folder (nothing is overwritten)")
    if tokenizer_name_or_path is not None and not Path(tokenizer_name_or_path).is_dir():
        raise HFError(f"--tokenizer_name_or_path: {tokenizer_name_or_path} is not a local folder")
    variant, vocab, run = _variant(src, model_variant, vocab_size)
    cfg = get_model_config(variant, vocab)
    keys, read = (read_model_keys(str(src)), lambda ks: read_model_part(str(src), ks)) if src.is_dir() \
        else model_file_reader(src)
    expected = {k: tuple(v.shape) for k, v in build_model(cfg, torch.device("meta")).state_dict().items()}
    found = {k: tuple(s) for k, s in keys.items()}
    for key, shape in expected.items():
        if found.get(key) != shape:
            raise HFError(f"--model_variant={variant} does not match {load_path}: {key} is "
                          f"{list(found[key]) if key in found else 'missing'} there, {list(shape)} for {variant}")
    bos, eos = run.get("bos_token"), run.get("eos_token")
    tokenizer = None
    if tokenizer_name_or_path is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_name_or_path, local_files_only=True)
        bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else bos
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else eos
    out = write_hf_folder(cfg, read, list(expected), save_path, DTYPES[dtype], bos, eos)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out


def main(load_path: str = "", save_path: str = "", model_variant: Optional[str] = None,
         vocab_size: Optional[int] = None, tokenizer_name_or_path: Optional[str] = None, dtype: str = "bf16") -> None:
    """fms checkpoint -> Hugging Face LlamaForCausalLM folder."""
    try:
        out = convert(str(load_path), str(save_path), model_variant, vocab_size, tokenizer_name_or_path, str(dtype))
    except (HFError, CheckpointError, ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote {out}")


if __name__ == "__main__":
    fire.Fire(main)
