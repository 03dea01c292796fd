"""LoRA fine-tuning from a Hugging Face model (--lora_rank): only the adapters train and are
checkpointed, a resume is exact, the merged export is the base plus a low-rank update, and the PEFT
adapter folder gives our logits on the Hugging Face base model."""

import copy
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from fms_fsdp.checkpoint.export import export_checkpoint
from fms_fsdp.errors import CheckpointError, ConfigError
from fms_fsdp.evaluation.evaluate import check_checkpoint_evaluation
from fms_fsdp.flags import make_config
from fms_fsdp.model.initialization import init_weights
from fms_fsdp.model.lora import TARGETS, LoRASpec, add_adapters
from fms_fsdp.model.variants import build_model, get_model_config
from fms_fsdp.settings import checkpoint_evaluation_of
from fms_fsdp.startup import facts
from fms_fsdp.weights.hf import convert as hf_convert
from fms_fsdp.weights.reader import read_model

from conftest import train, train_here

os.environ["HF_HUB_OFFLINE"] = "1"
LORA = [
    "--lora_rank=4",
    "--lora_alpha=8",
    "--learning_rate=1e-2",
    "--checkpoint_interval=2",
    "--report_interval=1",
    "--lr_schedule=constant",
    "--warmup_steps=0",
]  # the same LR whatever --num_steps: runs of 2 and 4 steps compare


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, Path]:
    """(a Hugging Face folder in fp32, the full checkpoint it came from) of a few tiny training steps."""
    out = tmp_path_factory.mktemp("base")
    train_here(out, ["--num_steps=3"])
    ckpt = out / "run" / "checkpoints" / "step_3_ckp"
    return Path(hf_convert(str(ckpt), str(out / "hf"), dtype="fp32")), ckpt


@pytest.fixture(scope="module")
def tuned(base, tmp_path_factory) -> Path:
    """A LoRA run of 4 steps from the Hugging Face folder on two ranks (FSDP shards the adapters and the
    frozen base alike), exported at the end."""
    out = tmp_path_factory.mktemp("lora")
    train(
        out,
        [
            f"--ckpt_load_path={base[0]}",
            *LORA,
            "--num_steps=4",
            "--export_model_at_end=True",
            "--sharding_strategy=fsdp",
        ],
        nproc=2,
    )
    return out / "run"


def test_only_the_adapters_train_and_are_checkpointed(base, tuned):
    hf, full_ckpt = base
    assert folder_bytes(tuned / "checkpoints" / "step_4_ckp") < 0.1 * folder_bytes(full_ckpt)
    before, after = read_model(full_ckpt), load_file(str(tuned / "model_step_4.safetensors"))
    assert after.keys() == before.keys()  # the merged model: no adapter keys
    adapted = [k for k in before if k.endswith(("qkv_fused.weight", "dense.weight", "wg1_fused.weight", "w2.weight"))]
    assert len(adapted) == 16
    for key in before:
        delta = after[key].float() - before[key].float()
        if key in adapted:  # the base plus a low-rank update
            # fp32's rounding of base + update leaves singular values near 1e-6 x the largest
            assert delta.abs().max() > 0 and torch.linalg.matrix_rank(delta, rtol=1e-5) <= 4, key
        else:
            assert torch.equal(after[key], before[key]), key


def test_a_lora_run_resumes_exactly(base, tmp_path):
    flags = [f"--ckpt_load_path={base[0]}", *LORA]
    uninterrupted = {r["step"]: r["loss"] for r in train_here(tmp_path / "whole", [*flags, "--num_steps=4"])}
    train_here(tmp_path, [*flags, "--num_steps=2"])
    resumed = {r["step"]: r["loss"] for r in train_here(tmp_path, [*flags, "--num_steps=4"])}
    assert resumed[3] == pytest.approx(uninterrupted[3], rel=1e-5)
    assert resumed[4] == pytest.approx(uninterrupted[4], rel=1e-5)


def test_peft_loads_the_adapter_onto_the_hugging_face_base_with_our_logits(base, tuned):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(base[0], local_files_only=True, dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(hf, tuned / "adapter_step_4").eval()
    ours = build_model(get_model_config("tiny", 256), torch.device("cpu"))
    ours.load_state_dict(load_file(str(tuned / "model_step_4.safetensors")))
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs, mine = with_adapter(tokens).logits, ours.eval()(tokens)
        base_logits = AutoModelForCausalLM.from_pretrained(base[0], local_files_only=True, dtype=torch.float32)(
            tokens
        ).logits
    assert (theirs - mine).abs().max().item() <= 1e-4
    assert (base_logits - mine).abs().max().item() > 1e-2  # the adapter changed the model


def test_lora_trains_with_bf16_and_activation_checkpointing(base, tmp_path):
    """Its losses over the last steps are below those of the same batches without updates
    (--learning_rate=0): one batch's loss against another's says nothing of learning. (With
    --use_torch_compile=True too it trains; compiling costs this suite 12 s, so it is left out.)"""
    flags = [
        f"--ckpt_load_path={base[0]}",
        *LORA,
        "--num_steps=8",
        "--learning_rate=3e-3",
        "--mixed_precision=True",
        "--fsdp_activation_checkpointing=True",
        "--ac_mode=op",
        "--checkpoint_interval=8",
    ]
    trained = train_here(tmp_path / "trained", flags)
    still = train_here(tmp_path / "still", [*flags, "--learning_rate=0"])
    assert [r["step"] for r in trained] == [r["step"] for r in still] == list(range(1, 9))

    def late(records: list[dict]) -> float:
        return sum(r["loss"] for r in records[-4:]) / 4

    assert late(trained) < late(still) - 0.1, (late(trained), late(still))


def test_a_lora_checkpoint_is_not_taken_for_a_model_nor_resumed_on_another_base(base, tuned, tmp_path):
    with pytest.raises(CheckpointError, match="is a LoRA checkpoint: it holds the adapters only"):
        export_checkpoint(str(tuned / "checkpoints" / "step_4_ckp"), str(tmp_path / "m.safetensors"))
    with pytest.raises(ConfigError, match="evaluation takes whole models: drop --lora_rank"):
        check_checkpoint_evaluation(
            checkpoint_evaluation_of(
                make_config(
                    model_variant="tiny", lora_rank=4, ckpt_load_path=str(base[0]), eval_data_path="x", eval_interval=1
                )
            )
        )
    flags = [*LORA, "--num_steps=2"]
    train_here(tmp_path, [f"--ckpt_load_path={base[0]}", *flags])
    with pytest.raises(CheckpointError, match="holds LoRA adapters of the base .* but --ckpt_load_path is now"):
        train_here(tmp_path, [f"--ckpt_load_path={base[1]}", *LORA, "--num_steps=3"])


def test_lora_flags_are_checked_at_start_up():
    with pytest.raises(ConfigError, match="--lora_rank needs the model to adapt: set --ckpt_load_path"):
        facts(make_config(model_variant="tiny", lora_rank=4))
    with pytest.raises(ConfigError, match="--lora_rank with --float8 is not supported"):
        facts(make_config(model_variant="tiny", lora_rank=4, ckpt_load_path="x", float8=True))
    with pytest.raises(ConfigError, match="--lora_targets: unknown q_proj"):
        facts(make_config(model_variant="tiny", lora_rank=4, ckpt_load_path="x", lora_targets=["q_proj"]))


def test_an_adapted_layer_is_still_its_linear_with_its_keys_and_forward():
    """add_adapters swaps each target layer's class for LoRA<class>: it stays an nn.Linear with the same
    parameter names (the adapters added), runs the base layer's forward while lora_B is zero and adds
    (alpha / r) B A x once it is not; a deep copy runs its own adapters."""
    plain = build_model(get_model_config("tiny", 256), torch.device("cpu"))
    init_weights(plain, 0)
    lora = copy.deepcopy(plain)
    assert add_adapters(lora, LoRASpec(rank=4, alpha=8.0, dropout=0.0, targets=TARGETS)) == 4 * plain.config.nlayers
    init_weights(lora, 0)  # lora_A drawn, lora_B zero
    adapted = {n for n, m in lora.named_modules() if hasattr(m, "lora_A")}
    assert len(adapted) == 4 * plain.config.nlayers
    for name in adapted:
        layer, base = lora.get_submodule(name), plain.get_submodule(name)
        assert isinstance(layer, type(base)) and isinstance(layer, nn.Linear), name
        assert type(layer).__name__ == f"LoRA{type(base).__name__}"
    extra = {f"{n}.{a}" for n in adapted for a in ("lora_A", "lora_B")}
    assert set(lora.state_dict()) == set(plain.state_dict()) | extra
    missing, unexpected = lora.load_state_dict(plain.state_dict(), strict=False)  # the base, under its keys
    assert (set(missing), unexpected) == (extra, [])
    assert {n for n, p in lora.named_parameters() if p.requires_grad} == extra
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(lora(tokens), plain(tokens))
        name = sorted(adapted)[0]
        layer = lora.get_submodule(name)
        layer.lora_B.normal_(generator=torch.Generator().manual_seed(1))
        x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(2))
        expected = plain.get_submodule(name)(x) + 2.0 * x @ layer.lora_A.t() @ layer.lora_B.t()
        assert torch.allclose(layer(x), expected, rtol=1e-5, atol=1e-6)
        assert not torch.equal(lora(tokens), plain(tokens))
        twin = copy.deepcopy(lora)
        twin.get_submodule(name).lora_B.zero_()
        assert torch.equal(twin(tokens), plain(tokens))
        assert not torch.equal(lora(tokens), plain(tokens))
