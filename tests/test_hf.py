"""Hugging Face interop: export that transformers loads with equal logits, import, round trip."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from fms.models.llama import LLaMAConfig
from safetensors.torch import load_file

from fms_fsdp.cli import to_hf as to_hf_command
from fms_fsdp.errors import HFError
from fms_fsdp.model.variants import build_model, get_model_config
from fms_fsdp.weights.hf import check_hf_config, read_hf_config
from fms_fsdp.weights.hf import convert as hf_convert
from fms_fsdp.weights.hf_read import DTYPES, check_shapes, index_folder, read_into, sources
from fms_fsdp.weights.reader import model_reader, read_model

from conftest import ROOT, TINY, launch, train_here

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"


def read_hf_model(folder: str, model_config: LLaMAConfig, variant: Optional[str] = None) -> dict[str, torch.Tensor]:
    """The fms state dict of a Hugging Face Llama folder in the folder's dtypes, read tensor by tensor (its
    rotary settings those of `model_config` or of `variant`: check_hf_config), for the tests to compare
    folders and models; training reads its slices in place (fms_fsdp/weights/hf_read.py)."""
    check_hf_config(read_hf_config(folder), model_config, folder, variant)
    entries = index_folder(Path(folder))
    keys = {k: tuple(v.shape) for k, v in build_model(model_config, torch.device("meta")).state_dict().items()}
    check_shapes(keys, entries, model_config, folder)
    dtype = {k: DTYPES[entries[sources(k, entries, model_config)[0].name].dtype] for k in keys}
    state = {k: torch.empty(s, dtype=dtype[k]) for k, s in keys.items()}
    read_into(state, Path(folder), entries, model_config)
    return state


def to_hf(load_path: Path, save_path: Path, **flags: Any) -> Path:
    """fms_to_hf's conversion in this process (its command line is run in test_bad_input_gives_clear_errors)."""
    return hf_convert(str(load_path), str(save_path), **flags)


def convert(*args: str, rc: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "fms_to_hf.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == rc, proc.stdout + proc.stderr
    return proc


@pytest.fixture(scope="module", params=["tiny", "tiny_llama3"])
def trained(request, tmp_path_factory) -> tuple[str, Path]:
    """A few training steps of a tiny variant with grouped-query attention (and llama3's rope_theta)."""
    out = tmp_path_factory.mktemp(request.param)
    train_here(out, [f"--model_variant={request.param}", "--num_steps=3", "--batch_size=2", "--vocab_size=512"])
    return request.param, out / "run" / "checkpoints" / "step_3_ckp"


def fms_model(variant: str, weights: dict) -> torch.nn.Module:
    model = build_model(get_model_config(variant, 512), torch.device("cpu"))
    model.load_state_dict(weights)
    return model.eval()


def greedy(step, ids: torch.Tensor, n: int = 20) -> torch.Tensor:
    for _ in range(n):
        ids = torch.cat([ids, step(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def test_transformers_loads_the_export_with_the_same_logits(trained, tmp_path):
    from transformers import AutoModelForCausalLM

    variant, ckpt = trained
    to_hf(ckpt, tmp_path / "hf", dtype="fp32")  # the variant from the checkpoint
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    c = get_model_config(variant, 512)
    assert (
        config["vocab_size"],
        config["hidden_size"],
        config["num_key_value_heads"],
        config["rope_theta"],
        config["max_position_embeddings"],
        config["eos_token_id"],
    ) == (512, 256, 2, c.rope_theta, 1024, 0)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True, dtype=torch.float32).eval()
    ours = fms_model(variant, read_model(ckpt))
    tokens = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(tokens).logits - ours(tokens)).abs().max().item() <= 1e-4
        hf.generation_config.eos_token_id = None
        generated = hf.generate(
            tokens[:, :8],
            attention_mask=torch.ones_like(tokens[:, :8]),
            max_new_tokens=20,
            do_sample=False,
            eos_token_id=None,
        )
        assert torch.equal(generated, greedy(ours, tokens[:, :8]))


def test_round_trip_hf_folder_to_training_to_export(trained, tmp_path):
    variant, ckpt = trained
    to_hf(ckpt, tmp_path / "hf", dtype="fp32")
    # start training from the Hugging Face folder (learning rate 0: the weights stay as loaded)
    train_here(
        tmp_path,
        [
            f"--model_variant={variant}",
            "--vocab_size=512",
            f"--ckpt_load_path={tmp_path / 'hf'}",
            "--num_steps=1",
            "--learning_rate=0",
            "--export_model_at_end=True",
            "--batch_size=2",
        ],
    )
    exported = load_file(str(tmp_path / "run" / "model_step_1.safetensors"))
    original = read_model(ckpt)
    assert exported.keys() == original.keys() and all(torch.equal(exported[k], original[k]) for k in original)
    to_hf(
        tmp_path / "run" / "model_step_1.safetensors",
        tmp_path / "hf2",
        model_variant=variant,
        vocab_size=512,
        dtype="fp32",
    )
    a, b = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(str(tmp_path / "hf2" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fms_fsdp_layout_bf16_and_tokenizer(trained, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    variant, ckpt = trained
    old = tmp_path / "step_3_ckp"  # as fms-fsdp wrote it: no completion marker, metadata without the config
    shutil.copytree(ckpt, old)
    (old / "COMPLETE").unlink()
    torch.save({"step": 3, "tokens_seen": 384}, old / "metadata.pth")
    save_tokenizer(tmp_path / "tok")
    with pytest.raises(HFError, match="--model_variant is needed"):
        to_hf(old, tmp_path / "x")
    to_hf(old, tmp_path / "hf", model_variant=variant, vocab_size=512, tokenizer_name_or_path=str(tmp_path / "tok"))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert next(hf.parameters()).dtype == torch.bfloat16
    assert AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)("w5 w7")["input_ids"] == [5, 7]
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == 511


def save_tokenizer(folder: Path) -> None:
    """A word-level tokenizer of 512 tokens: w0..w509, <s>, </s>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(510)} | {"<s>": 510, "</s>": 511}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(folder)


def test_periodic_exports_are_folders_transformers_loads_or_model_files(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    save_tokenizer(tmp_path / "tok")
    train_here(
        tmp_path / "hf",
        [
            "--num_steps=6",
            "--vocab_size=512",
            "--batch_size=2",
            "--export_interval=2",
            "--export_format=hf",
            f"--tokenizer_path={tmp_path / 'tok'}",
            "--eos_token=511",
            "--export_model_at_end=True",
        ],
    )
    exports = tmp_path / "hf" / "run" / "exports"
    assert sorted(p.name for p in exports.iterdir()) == ["step_4", "step_6"]  # --export_keep=2, nothing half-written
    final = load_file(str(tmp_path / "hf" / "run" / "model_step_6.safetensors"))
    exported = read_hf_model(str(exports / "step_6"), get_model_config("tiny", 512))
    assert exported.keys() == final.keys()
    assert all(torch.equal(exported[k], final[k].to(torch.bfloat16)) for k in final)
    hf = AutoModelForCausalLM.from_pretrained(exports / "step_6", local_files_only=True)
    assert next(hf.parameters()).dtype == torch.bfloat16 and hf.config.eos_token_id == 511
    assert AutoTokenizer.from_pretrained(exports / "step_6", local_files_only=True)("w5 w7")["input_ids"] == [5, 7]
    train_here(
        tmp_path / "fms",
        [
            "--num_steps=2",
            "--vocab_size=512",
            "--batch_size=2",
            "--export_interval=1",
            "--export_keep=1",
            "--export_model_at_end=True",
        ],
    )
    exports = tmp_path / "fms" / "run" / "exports"
    assert [p.name for p in exports.iterdir()] == ["step_2"]
    a = load_file(str(exports / "step_2" / "model.safetensors"))
    b = load_file(str(tmp_path / "fms" / "run" / "model_step_2.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def hf_main(load_path: str, save_path: str, **kw: str) -> None:
    """fms_to_hf's entry point in this process, with these flags."""
    to_hf_command([f"--load_path={load_path}", f"--save_path={save_path}", *(f"--{k}={v}" for k, v in kw.items())])


@pytest.mark.parametrize("trained", ["tiny"], indirect=True)
def test_bad_input_gives_clear_errors(trained, tmp_path, capsys):
    variant, ckpt = trained

    def error(load_path: Path, save_path: Path, **kw: str) -> str:
        """fms_to_hf's entry point in this process: status 2 and the one line it printed."""
        with pytest.raises(SystemExit) as e:
            hf_main(str(load_path), str(save_path), **kw)
        assert e.value.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        return lines[0]

    assert "does not exist" in error(tmp_path / "none", tmp_path / "o")
    assert "--dtype: 'fp8'" in error(ckpt, tmp_path / "o", dtype="fp8")
    message = error(ckpt, tmp_path / "o", model_variant="small")
    assert "error: --model_variant=small does not match" in message and "base_model.embedding.weight" in message
    assert "is not a checkpoint folder (no .metadata)" in error(ckpt.parent, tmp_path / "o")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    assert "exists and is not empty; choose a new folder" in error(ckpt, tmp_path / "busy")
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    # the command line gives the same line and status
    assert (
        "error: --dtype: 'fp8'"
        in convert(f"--load_path={ckpt}", f"--save_path={tmp_path / 'o'}", "--dtype=fp8", rc=2).stderr
    )
    hf_main(str(ckpt), str(tmp_path / "hf"))
    proc = launch(
        "main_training.py",
        [
            *TINY,
            f"--model_variant={variant}",
            "--vocab_size=1024",
            f"--ckpt_load_path={tmp_path / 'hf'}",
            f"--ckpt_save_path={tmp_path / 'run'}",
        ],
        None,
    )
    assert proc.returncode != 0
    assert (  # at start-up, the folder named once
        f"error: --ckpt_load_path: {tmp_path / 'hf'}: vocab_size is 512 but the model variant has 1024; choose "
        "the matching --model_variant (and --vocab_size)\n" == proc.stderr
    )


@pytest.mark.parametrize("trained", ["tiny"], indirect=True)
def test_large_models_are_written_in_shards_with_an_index(trained, tmp_path):
    from transformers import AutoModelForCausalLM

    from fms_fsdp.weights.hf import write_hf_folder

    variant, ckpt = trained
    tensors = model_reader(ckpt)
    write_hf_folder(
        get_model_config(variant, 512),
        tensors,
        {k: tuple(s) for k, s in tensors.shapes.items()},
        str(tmp_path / "hf"),
        torch.float32,
        None,
        0,
        max_shard_bytes=2**20,
    )
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True, dtype=torch.float32).eval()
    tokens = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (hf(tokens).logits - fms_model(variant, read_model(ckpt))(tokens)).abs().max() <= 1e-4


def test_llama3_rope_scaling_imports_and_exports_with_transformers_logits_past_10000(tmp_path):
    """Llama 3.1's rotary scaling (--rope_scaling_factor) and a raised --rope_theta: a Hugging Face model
    with them imports with its logits at positions 10,000 and on, and our config.json makes
    transformers build that same model; without the scaling the logits differ (what the test catches)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fms_fsdp.model.shapes import hidden_dim
    from fms_fsdp.weights.hf import hf_config

    config = get_model_config("tiny_llama3", 512, 10_240, rope_theta=1e6, rope_scaling_factor=8).updated(nlayers=1)
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
    theirs = LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=hidden_dim(config), num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=config.norm_eps, max_position_embeddings=131072,
        rope_theta=1e6, rope_scaling={**scaling, "original_max_position_embeddings": 1024}, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = LlamaForCausalLM(theirs).eval()
    hf.save_pretrained(tmp_path / "hf")
    model = build_model(config, torch.device("cpu")).eval()
    model.load_state_dict(read_hf_model(str(tmp_path / "hf"), config))
    x = torch.randint(0, 512, (1, 10_048), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(x).logits[0, 10_000:]
        assert torch.allclose(model(x)[0, 10_000:], expected, atol=2e-4)
        exported = LlamaForCausalLM(LlamaConfig(**hf_config(config, torch.float32, None, None))).eval()
        exported.load_state_dict(hf.state_dict())
        assert torch.allclose(exported(x).logits[0, 10_000:], expected, atol=1e-5)
        plain = build_model(
            get_model_config("tiny_llama3", 512, 10_240, 1, 1e6).updated(nlayers=1), torch.device("cpu")
        )
        plain.load_state_dict(model.state_dict())
        assert not torch.allclose(plain.eval()(x)[0, 10_000:], expected, atol=1e-2)
    unscaled = get_model_config("tiny_llama3", 512, None, 1, 1e6).updated(nlayers=1)
    with pytest.raises(
        HFError, match="rope_scaling .*llama3.*, but the run has rope_theta 1000000.0 and rope_scaling None"
    ):
        read_hf_model(str(tmp_path / "hf"), unscaled)  # --rope_scaling_factor forgotten
    # a model whose context is being extended: the folder has the variant's settings, the run its own
    base = get_model_config("tiny_llama3", 512).updated(nlayers=1)  # theta 500000, no scaling
    LlamaForCausalLM(LlamaConfig(**hf_config(base, torch.float32, None, None))).save_pretrained(tmp_path / "base")
    assert read_hf_model(str(tmp_path / "base"), config, "tiny_llama3").keys() == model.state_dict().keys()


def test_a_hugging_face_source_is_checked_field_by_field_and_carried_into_the_export(tmp_path):
    """A source whose rms_norm_eps, max_position_embeddings or tied embeddings differ from the run's is
    refused at start-up in one line naming the field, both values and the flag; with the flags set, the
    run carries them, and its export says them too, with the source's bos and eos ids."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fms_fsdp.errors import ConfigError
    from fms_fsdp.flags import make_config
    from fms_fsdp.startup import facts
    from fms_fsdp.weights.hf import hf_config

    src = tmp_path / "src"
    theirs = {**hf_config(get_model_config("tiny", 256), torch.float32, 1, 2), "rms_norm_eps": 1e-6}
    theirs["max_position_embeddings"] = 2048
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**theirs)).save_pretrained(src)
    LlamaForCausalLM(LlamaConfig(**{**theirs, "tie_word_embeddings": True})).save_pretrained(tmp_path / "tied")
    base = dict(model_variant="tiny", vocab_size=256, seq_length=64, device="cpu", ckpt_save_path=str(tmp_path / "out"))

    def refused(path: Path, **flags: Any) -> str:
        with pytest.raises(ConfigError) as e:
            facts(make_config(**base, ckpt_load_path=str(path), **flags))
        return str(e.value)

    assert refused(src) == f"--ckpt_load_path: {src}: rms_norm_eps is 1e-06 but the run has 1e-05; set --norm_eps=1e-06"
    assert refused(src, dry_run=True) == refused(src)  # a plan checks the weights it can see
    assert facts(make_config(**base, ckpt_load_path=str(tmp_path / "elsewhere"), dry_run=True))  # and not others
    assert refused(src, norm_eps=1e-6) == (
        f"--ckpt_load_path: {src}: max_position_embeddings is 2048 but the run has 1024; "
        "set --max_position_embeddings=2048"
    )
    carried = dict(norm_eps=1e-6, max_position_embeddings=2048)
    assert refused(tmp_path / "tied", **carried) == (
        f"--ckpt_load_path: {tmp_path / 'tied'}: tie_word_embeddings is true but tiny's embeddings are untied; "
        "choose a --model_variant whose embeddings are tied (llama3.2_* tie them)"
    )
    plain = tmp_path / "plain"  # the variant's own config.json: its context extended by the run is no mismatch
    LlamaForCausalLM(LlamaConfig(**hf_config(get_model_config("tiny", 256), torch.float32, 1, 2))).save_pretrained(
        plain
    )
    assert facts(make_config(**base, ckpt_load_path=str(plain), rope_scaling_factor=4)).model_config.rope_scaling
    run = facts(make_config(**base, ckpt_load_path=str(src), **carried))
    assert (run.model_config.norm_eps, run.model_config.max_expected_seq_len) == (1e-6, 2048)
    assert (run.settings.export.bos, run.settings.export.eos) == (1, 2)
    assert any("ends text with eos_token_id 2, but documents are separated by --eos_token=0" in n for n in run.notes)
    assert any("begins text with bos_token_id 1, but no --bos_token is put before documents" in n for n in run.notes)
    assert refused(src, **carried, bos_token=5) == (
        f"--ckpt_load_path: {src}: bos_token_id is 1 but the run puts --bos_token=5 before each document; "
        "set --bos_token=1"
    )
    run = facts(make_config(**base, ckpt_load_path=str(src), **carried, bos_token=1))
    assert not any("bos_token_id" in n for n in run.notes)

    train_here(
        tmp_path,
        [f"--ckpt_load_path={src}", "--norm_eps=1e-6", "--max_position_embeddings=2048", "--num_steps=1"],
    )
    out = to_hf(tmp_path / "run" / "checkpoints" / "step_1_ckp", tmp_path / "hf", dtype="fp32")
    exported = json.loads((out / "config.json").read_text())
    assert (exported["rms_norm_eps"], exported["max_position_embeddings"]) == (1e-6, 2048)
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (1, 2)


@pytest.mark.parametrize(
    "field",
    [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
    ],
)
def test_each_shape_field_of_a_sources_config_is_checked_against_the_variant(field):
    """tiny's own config.json with one shape field doubled is refused naming that field and both values."""
    from fms_fsdp.weights.hf import hf_config

    config = get_model_config("tiny", 256)
    theirs = hf_config(config, torch.float32, 1, 2)
    check_hf_config(theirs, config, "src")  # as written, it is tiny's
    ours = theirs[field]
    with pytest.raises(HFError) as e:
        check_hf_config({**theirs, field: 2 * ours}, config, "src")
    assert str(e.value) == (
        f"src: {field} is {2 * ours} but the model variant has {ours}; choose the matching --model_variant (and "
        "--vocab_size)"
    )
