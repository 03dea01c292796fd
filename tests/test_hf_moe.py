"""Mixtral interop: a random transformers MixtralForCausalLM, saved by transformers in the Hub's layout,
reads into the package's sparse model with transformers' logits (in one process, and sharded over two
FSDP ranks through a run); a trained sparse checkpoint exports in that layout, and transformers loads the
export with the package's logits."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_moe import mixtral_config
from transformers import AutoModelForCausalLM, MixtralForCausalLM

from fms_fsdp.errors import HFError
from fms_fsdp.model.variants import build_model, get_model_config
from fms_fsdp.weights.hf import write_hf_folder
from fms_fsdp.weights.reader import model_reader, read_model

from conftest import train, train_here
from test_hf import read_hf_model, to_hf

VARIANT, VOCAB = "tiny_moe", 512
SPARSE = [f"--model_variant={VARIANT}", f"--vocab_size={VOCAB}", "--batch_size=2"]


def mixtral(folder: Path) -> MixtralForCausalLM:
    """A random MixtralForCausalLM of tiny_moe's shape, saved by transformers into `folder`; its weights
    drawn wider than transformers' init (std 0.1) so that the router's choices differ from token to token."""
    c = get_model_config(VARIANT, VOCAB)
    config = mixtral_config(
        c,
        max_position_embeddings=1024,
        rms_norm_eps=c.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = MixtralForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.1)
    model.save_pretrained(folder)
    return model.eval()


def logits_gap(theirs: torch.nn.Module, weights: dict[str, torch.Tensor]) -> float:
    """The largest difference between transformers' logits and the package's model with `weights`."""
    ours = build_model(get_model_config(VARIANT, VOCAB), torch.device("cpu"))
    ours.load_state_dict(weights)
    tokens = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return (theirs(tokens).logits - ours.eval()(tokens)).abs().max().item()


def test_a_random_mixtral_reads_in_with_transformers_logits(tmp_path):
    theirs = mixtral(tmp_path / "hf")
    keys = load_file(str(tmp_path / "hf" / "model.safetensors")).keys()
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in keys  # the Hub's layout
    read = read_hf_model(str(tmp_path / "hf"), get_model_config(VARIANT, VOCAB))
    assert logits_gap(theirs, read) <= 1e-4


@pytest.mark.slow  # two 2-rank runs
@pytest.mark.parametrize("ep", [1, 2], ids=["ep 1", "ep 2"])
def test_two_fsdp_ranks_read_their_rows_of_every_expert_from_a_mixtral_folder(tmp_path, ep):
    mixtral(tmp_path / "hf")
    read = read_hf_model(str(tmp_path / "hf"), get_model_config(VARIANT, VOCAB))
    # two FSDP ranks read their rows of every expert (ep 2: their own experts, whole) from the folder;
    # learning rate 0 keeps them as read
    run = [*SPARSE, f"--ckpt_load_path={tmp_path / 'hf'}", "--num_steps=1", "--learning_rate=0"]
    run.append(f"--expert_parallel_size={ep}")
    train(tmp_path, [*run, "--export_model_at_end=True"], nproc=2)
    exported = load_file(str(tmp_path / "run" / "model_step_1.safetensors"))
    assert exported.keys() == read.keys() and all(torch.equal(exported[k], read[k]) for k in read)


def test_a_trained_sparse_model_exports_to_transformers_with_equal_logits(tmp_path):
    train_here(tmp_path, [*SPARSE, "--num_steps=3", "--checkpoint_interval=3"])
    ckpt = tmp_path / "run" / "checkpoints" / "step_3_ckp"
    to_hf(ckpt, tmp_path / "hf", dtype="fp32")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["architectures"], config["num_local_experts"], config["num_experts_per_tok"]) == (
        ["MixtralForCausalLM"],
        4,
        2,
    )
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True, dtype=torch.float32)
    assert isinstance(theirs, MixtralForCausalLM)
    assert logits_gap(theirs.eval(), read_model(ckpt)) <= 1e-4
    back = read_hf_model(str(tmp_path / "hf"), get_model_config(VARIANT, VOCAB))
    trained = read_model(ckpt)
    assert all(torch.equal(back[k], trained[k]) for k in trained)  # the round trip is exact
    tensors = model_reader(ckpt)  # in files of 1 MiB: experts' rows cut across files, an index
    shapes = {k: tuple(s) for k, s in tensors.shapes.items()}
    write_hf_folder(
        get_model_config(VARIANT, VOCAB), tensors, shapes, str(tmp_path / "hf2"), torch.float32, None, 0, 2**20
    )
    files = sorted((tmp_path / "hf2").glob("*.safetensors"))
    assert len(files) > 3 and (tmp_path / "hf2" / "model.safetensors.index.json").is_file()
    one = load_file(str(tmp_path / "hf" / "model.safetensors"))
    many = {k: v for f in files for k, v in load_file(str(f)).items()}
    assert one.keys() == many.keys() and all(torch.equal(one[k], many[k]) for k in one)


def test_shared_experts_and_a_dense_folder_for_a_sparse_run_are_refused_in_one_line(tmp_path):
    train_here(tmp_path, [*SPARSE, "--moe_shared_experts=1", "--num_steps=1", "--checkpoint_interval=1"])
    with pytest.raises(HFError, match="^a model with shared experts .* has no Hugging Face export"):
        to_hf(tmp_path / "run" / "checkpoints" / "step_1_ckp", tmp_path / "hf")
    mixtral(tmp_path / "mixtral")
    with pytest.raises(HFError, match="num_local_experts is 4 but the model variant has 0"):
        read_hf_model(str(tmp_path / "mixtral"), get_model_config("tiny", VOCAB))


@pytest.mark.parametrize("ep", [pytest.param(1, marks=pytest.mark.slow), 2], ids=["ep 1", "ep 2"])
def test_periodic_hf_exports_of_a_sparse_run_on_two_ranks_load_in_transformers(tmp_path, ep):
    """Each rank writes its files of the export from the sharded checkpoint (its experts spread over the
    two ranks with ep 2): transformers loads the folder as Mixtral with the logits of the checkpoint of
    the same step."""
    run = [*SPARSE, "--num_steps=2", "--checkpoint_interval=2", "--export_interval=2", "--export_format=hf"]
    run.append(f"--expert_parallel_size={ep}")
    train(tmp_path, run, nproc=2)
    folder = tmp_path / "run" / "exports" / "step_2"
    theirs = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    assert isinstance(theirs, MixtralForCausalLM)
    # the export is bf16: the checkpoint's weights rounded to bf16 give its logits
    weights = {
        k: v.to(torch.bfloat16).float() for k, v in read_model(tmp_path / "run" / "checkpoints" / "step_2_ckp").items()
    }
    assert logits_gap(theirs.eval(), weights) <= 1e-4
