"""Every mesh against a reference outside the package (tests/reference.py: transformers' LlamaForCausalLM
trained by plain PyTorch on the same batches from the same Hugging Face folder): each step's loss and
gradient norm within TOL, in fp32 on CPU ranks, for STEPS steps."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from reference import LR, train

from conftest import launch, records

pytestmark = pytest.mark.slow  # a launch per mesh (about 15 s each): the slow tier

STEPS, BATCH, SEQ, VOCAB, SEED = 20, 4, 64, 256, 2023
# fms's LLaMA and transformers' compute the same functions with other kernels and in another order
# (fused q/k/v and gate/up matmuls, the rotary layout, chunked cross entropy); over 20 steps at the
# quick start's learning rate the gaps stay below 1e-4 relative to the loss and gradient norm
TOL = 1e-3
# (name, ranks, flags): global batch BATCH on each, the same lines
MESHES = [
    ("one rank", 1, [f"--batch_size={BATCH}"]),
    ("fsdp", 2, [f"--batch_size={BATCH // 2}", "--sharding_strategy=fsdp"]),
    ("hsdp", 2, [f"--batch_size={BATCH // 2}", "--sharding_strategy=hsdp", "--sharding_group_size=1"]),
    ("tp: sequence and loss parallel", 2, [f"--batch_size={BATCH}", "--tensor_parallel_size=2"]),
    ("pp", 2, [f"--batch_size={BATCH}", "--pipeline_parallel_size=2"]),
    ("cp", 2, [f"--batch_size={BATCH}", "--context_parallel_size=2"]),
    ("dp x tp", 4, [f"--batch_size={BATCH // 2}", "--tensor_parallel_size=2", "--sharding_strategy=fsdp"]),
]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A Hugging Face folder of `tiny` with random weights, written by transformers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fms_fsdp.model.variants import get_model_config
    from fms_fsdp.weights.hf import hf_config

    folder = tmp_path_factory.mktemp("reference") / "hf"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**hf_config(get_model_config("tiny", VOCAB), torch.float32, None, 0))).save_pretrained(
        folder
    )
    return folder


@pytest.fixture(scope="module")
def reference(source) -> np.ndarray:
    """The reference loop's (loss, gradient norm) per step."""
    return np.array(train(source, STEPS, BATCH, SEQ, VOCAB, SEED))


@pytest.mark.parametrize("name, ranks, mesh", MESHES, ids=[m[0] for m in MESHES])
def test_every_mesh_follows_the_reference_loop(source, reference, tmp_path, name, ranks, mesh):
    out = tmp_path / "run"
    flags = [
        "--model_variant=tiny",
        "--device=cpu",
        "--use_dummy_dataset=True",
        "--use_torch_compile=False",
        "--mixed_precision=False",
        f"--vocab_size={VOCAB}",
        f"--seq_length={SEQ}",
        f"--seed={SEED}",
        f"--learning_rate={LR}",
        f"--num_steps={STEPS}",
        "--report_interval=1",
        "--checkpoint_interval=0",
        "--deterministic=True",
        f"--ckpt_load_path={source}",
        f"--ckpt_save_path={out}",
        *mesh,
    ]
    proc = launch("main_training.py", flags, ranks)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = np.array([(r["loss"], r["grad_norm"]) for r in records(out) if "loss" in r])
    assert found.shape == reference.shape
    gap = np.abs(found - reference) / np.abs(reference)
    step, which = np.unravel_index(np.argmax(gap), gap.shape)
    assert gap.max() <= TOL, (
        f"{name}: {('loss', 'grad_norm')[which]} at step {step + 1}: {found[step, which]!r} against the "
        f"reference's {reference[step, which]!r}\n" + json.dumps(found.tolist()) + "\n" + json.dumps(reference.tolist())
    )
