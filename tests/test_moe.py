"""Mixture of experts (model/moe.py): the layer against transformers' Mixtral block, the balance loss
against transformers' load_balancing_loss_func, capacity counts against a direct count, the auxiliary
losses' gradients, Mixtral's parameter counts and FLOPs of the active experts; in the slow tier, sparse
runs on FSDP, HSDP and pipeline meshes against one rank, and their checkpoints resumed."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock, load_balancing_loss_func

from fms_fsdp.compat import matmul_and_attention_ops
from fms_fsdp.model.initialization import init_weights
from fms_fsdp.model.moe import MoEConfig, MoEFeedForward, RoutingStats, balance_loss, capacity, expert_width, kept_slots
from fms_fsdp.model.variants import build_model, count_params, flops_per_token, get_model_config

from conftest import TINY, launch, launch_runs, records, resume_from, run_here

EXPERTS, TOP_K, DIM = 4, 2, 32


def _layer(capacity_factor: float = 0.0) -> MoEFeedForward:
    config = get_model_config("tiny_moe").updated(emb_dim=DIM, multiple_of=8, moe_experts=EXPERTS, moe_top_k=TOP_K)
    layer = build_model(config, torch.device("cpu")).base_model.layers[0].ff_sub_layer
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3, generator=torch.Generator().manual_seed(p.numel()))
    layer.routing.capacity_factor = capacity_factor
    layer.routing.stats = RoutingStats(1, EXPERTS, torch.device("cpu"))
    return layer


def _mixtral_block(layer: MoEFeedForward) -> MixtralSparseMoeBlock:
    config = MixtralConfig(
        hidden_size=DIM, intermediate_size=layer.intermediate_size, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K
    )
    block = MixtralSparseMoeBlock(config)
    block.gate.weight.data.copy_(layer.gate.weight)
    block.experts.gate_up_proj.data.copy_(layer.cond_ffn.w13)
    block.experts.down_proj.data.copy_(layer.cond_ffn.w2)
    return block.eval()


def test_dropless_routing_gives_transformers_mixtral_block_output_and_sees_every_token():
    layer, x = _layer(), torch.randn(3, 20, DIM, generator=torch.Generator().manual_seed(0))
    out = layer(x)
    torch.testing.assert_close(out, _mixtral_block(layer)(x), rtol=1e-5, atol=1e-5)
    assert layer.routing.stats is not None
    assert layer.routing.stats.tokens.sum() == 3 * 20 * TOP_K  # every slot of every token reached an expert
    assert layer.routing.stats.figures[0, 2] == 0  # none dropped


@pytest.mark.parametrize("capacity_factor", [0.0, 0.6])
def test_the_grouped_gemm_kernel_gives_the_loops_outputs_and_gradients(capacity_factor):
    x = torch.rand(2, 24, DIM, generator=torch.Generator().manual_seed(2)) + 0.1  # positive inputs
    results = []
    for kernel in ("loop", "grouped"):
        layer = _layer(capacity_factor)
        layer.routing.kernel = kernel
        with torch.no_grad():  # the last expert gets no token: an empty group
            layer.gate.weight[-1] = -1.0
        out = layer(x)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(3)))
        results.append((out, layer.cond_ffn.w13.grad, layer.cond_ffn.w2.grad, layer.gate.weight.grad))
    assert results[0][1][-1].abs().sum() == 0  # the empty expert got no gradient
    for loop, grouped in zip(*results):
        torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-6)


def test_the_balance_loss_equals_transformers_on_the_same_router_logits():
    logits = torch.randn(64, EXPERTS, generator=torch.Generator().manual_seed(1))
    probs = torch.softmax(logits, -1)
    ours = balance_loss(probs, torch.topk(probs, TOP_K, -1).indices, EXPERTS)
    torch.testing.assert_close(ours, load_balancing_loss_func((logits,), EXPERTS, TOP_K))


def test_capacity_keeps_the_first_slots_of_each_expert_and_counts_the_dropped():
    layer, x = _layer(capacity_factor=0.5), torch.randn(2, 24, DIM, generator=torch.Generator().manual_seed(2))
    out = layer(x)
    flat = x.reshape(-1, DIM)
    probs = torch.softmax(layer.gate(flat), -1)
    weights, chosen = torch.topk(probs, TOP_K, -1)
    weights = weights / weights.sum(-1, keepdim=True)
    limit, taken, dropped = capacity(flat.shape[0], EXPERTS, TOP_K, 0.5), [0] * EXPERTS, 0
    expected = torch.zeros_like(flat)
    for j in range(TOP_K):  # first choices first, in token order (GShard)
        for t in range(flat.shape[0]):
            e = int(chosen[t, j])
            if taken[e] == limit:
                dropped += 1
                continue
            taken[e] += 1
            gate, up = (flat[t] @ layer.cond_ffn.w13[e].T).chunk(2)
            expected[t] += weights[t, j] * (torch.nn.functional.silu(gate) * up) @ layer.cond_ffn.w2[e].T
    assert dropped > 0 and kept_slots(chosen, EXPERTS, limit).sum() == flat.shape[0] * TOP_K - dropped
    torch.testing.assert_close(out.reshape(-1, DIM), expected, rtol=1e-5, atol=1e-5)
    assert layer.routing.stats is not None
    assert layer.routing.stats.tokens[0].tolist() == taken and layer.routing.stats.figures[0, 2] == dropped


def test_the_auxiliary_losses_train_the_router_as_if_added_to_the_loss():
    x = torch.randn(2, 16, DIM, generator=torch.Generator().manual_seed(3))
    grads = []
    for direct in (False, True):
        layer = _layer()
        layer.routing.balance_weight, layer.routing.z_weight, layer.routing.grad_scale = 0.3, 0.2, 0.5
        out = layer(x).square().mean()
        if direct:  # the same losses added by hand, with the layer's own attachment turned off
            logits = layer.gate(x.reshape(-1, DIM))
            probs = torch.softmax(logits, -1)
            aux = 0.3 * balance_loss(probs, torch.topk(probs, TOP_K, -1).indices, EXPERTS)
            out = layer.eval()(x).square().mean() + 0.5 * (aux + 0.2 * torch.logsumexp(logits, -1).square().mean())
        out.backward()
        grads.append(layer.gate.weight.grad)
    torch.testing.assert_close(grads[0], grads[1])


def mixtral_config(c: MoEConfig, **extra: Any) -> MixtralConfig:
    """transformers' MixtralConfig of the shape of the package's sparse config `c`."""
    return MixtralConfig(
        vocab_size=c.src_vocab_size,
        hidden_size=c.emb_dim,
        intermediate_size=expert_width(c),
        num_hidden_layers=c.nlayers,
        num_attention_heads=c.nheads,
        num_key_value_heads=c.kvheads,
        num_local_experts=c.moe_experts,
        num_experts_per_tok=c.moe_top_k,
        **extra,
    )


@pytest.mark.parametrize("variant", ["mixtral_8x7b", "mixtral_8x22b"])
def test_mixtral_variants_have_transformers_parameter_counts(variant):
    c = get_model_config(variant)
    hf = mixtral_config(c)
    with torch.device("meta"):
        expected = sum(p.numel() for p in MixtralForCausalLM(hf).parameters())
    assert count_params(c) == expected


@pytest.mark.parametrize("variant, experts, top_k", [("llama3_8b", 8, 2), ("llama3_1.8b_4k", 4, 1)])
def test_the_moe_flags_make_a_dense_llama3_variant_sparse_with_transformers_parameter_count(variant, experts, top_k):
    """--moe_experts and --moe_top_k on a dense Llama 3 variant, read as the run reads them: its layers'
    feed-forwards become that many experts of its own width, as transformers' Mixtral of its shape counts."""
    from fms_fsdp.flags import parse_args
    from fms_fsdp.startup import model_config_of

    flags = [f"--model_variant={variant}", f"--moe_experts={experts}", f"--moe_top_k={top_k}", "--device=cpu"]
    c, dense = model_config_of(parse_args(flags)), get_model_config(variant)
    assert (c.moe_experts, c.moe_top_k, c.emb_dim, c.nlayers) == (experts, top_k, dense.emb_dim, dense.nlayers)
    assert expert_width(c) == expert_width(dense)  # each expert is the dense feed-forward's width
    with torch.device("meta"):
        expected = sum(p.numel() for p in MixtralForCausalLM(mixtral_config(c)).parameters())
    assert count_params(c) == expected


def test_flops_count_only_the_experts_a_token_uses():
    sparse, two = get_model_config("tiny_moe", 256), get_model_config("tiny_moe", 256, moe={"moe_experts": 2})
    assert count_params(sparse) > count_params(two)
    # top-2 of 4 experts costs as 2 of 2: only the router's two more columns differ
    assert flops_per_token(sparse, 64) - flops_per_token(two, 64) == 6 * sparse.nlayers * 2 * sparse.emb_dim
    dense = get_model_config("tiny", 256)
    expert = 3 * dense.emb_dim * 256  # tiny_moe's experts are 256 wide (growth factor 1)
    assert math.isclose(flops_per_token(sparse, 64) - flops_per_token(dense.updated(hidden_grow_factor=1.0), 64),
                        6 * dense.nlayers * (expert + EXPERTS * dense.emb_dim))  # fmt: skip


SPARSE = [*TINY, "--model_variant=tiny_moe", "--moe_z_loss_weight=0.001", "--num_steps=10", "--batch_size=2"]


def _losses(tmp, name: str, nproc: int, *extra: str) -> list[float]:
    out = tmp / name
    proc = launch("main_training.py", [*SPARSE, f"--ckpt_save_path={out}", *extra], nproc, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [r["loss"] for r in records(out) if "loss" in r]


@pytest.mark.slow
def test_a_sparse_model_trains_on_fsdp_hsdp_and_pipeline_meshes_as_on_one_rank(tmp_path):
    """Each mesh sees the one rank's batches in micro-batches of the same lines, so the balance losses
    (per micro-batch) agree too; fp32, so the sums' order is all that differs."""
    one = _losses(tmp_path, "one", None, "--batch_size=1", "--grad_accum_steps=4")
    hsdp = _losses(tmp_path, "hsdp", 4, "--batch_size=1", "--sharding_strategy=hsdp", "--sharding_group_size=2")
    two = {  # one launch of 2 ranks
        "fsdp": ["--batch_size=1", "--grad_accum_steps=2"],
        "pp": ["--batch_size=4", "--pipeline_parallel_size=2", "--pipeline_microbatches=4"],
    }
    launch_runs(2, [[*SPARSE, f"--ckpt_save_path={tmp_path / name}", *extra] for name, extra in two.items()])
    fsdp, pipe = ([r["loss"] for r in records(tmp_path / name) if "loss" in r] for name in two)
    for other in (fsdp, hsdp, pipe):
        torch.testing.assert_close(other, one, rtol=2e-4, atol=0)
    assert one[-1] < one[0] - 0.5


@pytest.mark.slow
def test_a_sparse_checkpoint_resumes_exactly_and_at_another_data_parallel_size(tmp_path):
    full = tmp_path / "full"
    proc = launch("main_training.py", [*SPARSE, f"--ckpt_save_path={full}", "--checkpoint_interval=5"], 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = [r for r in records(full) if "loss" in r]
    assert {"moe_balance_loss", "moe_load_max", "moe_z_loss"} <= set(expected[0])
    per_expert = [expected[0][f"moe_tokens/e{e}"] for e in range(4)]
    assert sum(per_expert) == 2 * 2 * 64 * 2 * 4  # ranks x lines x tokens x top-2 x layers, none dropped
    for nproc, extra in ((2, ()), (None, ("--batch_size=4",))):
        out = resume_from(full, 5, tmp_path / f"resumed{nproc}")
        proc = launch("main_training.py", [*SPARSE, f"--ckpt_save_path={out}", *extra], nproc)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got = [r["loss"] for r in records(out) if "loss" in r]
        if nproc == 2:
            assert got == [r["loss"] for r in expected[5:]]  # bit-identical
        else:  # one rank, the same lines per step: the balance loss is over 4 lines, not 2 per rank
            torch.testing.assert_close(got, [r["loss"] for r in expected[5:]], rtol=2e-3, atol=0)


def test_moe_flags_make_a_dense_variant_sparse_and_shared_experts_add_to_every_token():
    config = get_model_config("tiny", 256, moe={"moe_experts": 4, "moe_top_k": 1, "moe_shared_experts": 2})
    model = build_model(config, torch.device("cpu"))
    init_weights(model, 0)
    layer = model.base_model.layers[0].ff_sub_layer
    assert isinstance(layer, MoEFeedForward) and layer.cond_ffn.w13.shape == (4, 2 * 704, 256)
    assert layer.shared is not None and layer.shared.hidden_dim == 1408  # two dense layers' width
    x = torch.randn(1, 8, 256, generator=torch.Generator().manual_seed(4))
    routed_only = layer.shared
    layer.shared = None
    routed = layer(x)
    layer.shared = routed_only
    torch.testing.assert_close(layer(x), routed + routed_only(x))


def test_a_run_with_a_capacity_reports_the_share_of_slots_it_dropped(tmp_path):
    """--moe_capacity_factor=0.5: each expert keeps at most ceil(0.5 x 128 tokens x top-2 / 4) = 32 of a
    micro-batch's 256 slots, so at least half are dropped, and every record says how many; dropless, none."""
    moe = [*TINY, "--model_variant=tiny_moe", "--num_steps=2", "--batch_size=2"]
    printed = run_here([*moe, "--moe_capacity_factor=0.5", f"--ckpt_save_path={tmp_path / 'capped'}"])
    dropped = [r["moe_dropped"] for r in records(tmp_path / "capped") if "loss" in r]
    assert len(dropped) == 2 and all(0.5 <= d < 1 for d in dropped), dropped
    assert f"dropped {100 * dropped[-1]:.1f}%" in printed
    run_here([*moe, f"--ckpt_save_path={tmp_path / 'dropless'}"])
    assert all("moe_dropped" not in r for r in records(tmp_path / "dropless"))


def test_per_op_checkpointing_of_a_sparse_model_keeps_its_losses_and_the_grouped_gemms_output(tmp_path):
    """--ac_mode=op on a sparse model (one rank, the experts' loop of matmuls on the CPU): the losses of the
    run without checkpointing, and the GPU's grouped GEMM is among the ops whose outputs it keeps."""
    if hasattr(torch.ops.aten, "_grouped_mm"):
        assert torch.ops.aten._grouped_mm.default in matmul_and_attention_ops()
    moe = [*TINY, "--model_variant=tiny_moe", "--num_steps=3", "--batch_size=2"]
    per_op = ["--fsdp_activation_checkpointing=True", "--ac_mode=op", "--selective_checkpointing=1"]
    run_here([*moe, *per_op, f"--ckpt_save_path={tmp_path / 'op'}"])
    run_here([*moe, f"--ckpt_save_path={tmp_path / 'plain'}"])
    got, want = ([r["loss"] for r in records(tmp_path / name) if "loss" in r] for name in ("op", "plain"))
    assert len(got) == 3 and got == pytest.approx(want, rel=1e-6), (got, want)
