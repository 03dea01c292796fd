"""The optimizer: AdamW kernels by device, weight-decay groups, clipping by the global norm, Muon."""

import pytest
import torch

from fms_fsdp.errors import ConfigError
from fms_fsdp.flags import parse_args
from fms_fsdp.model.initialization import init_weights
from fms_fsdp.model.variants import build_model, get_model_config
from fms_fsdp.optim import (
    build_optimizer,
    check_optimizer,
    clip_gradients,
    decay_groups,
    keep_kernels,
    muon_params,
)
from fms_fsdp.settings import optimizer_of

from conftest import TINY


@pytest.fixture(scope="module")
def model():
    return build_model(get_model_config("tiny"), torch.device("cpu"))


def test_auto_is_fused_on_cpu_and_foreach_can_be_chosen(model):
    cpu = torch.device("cpu")
    assert build_optimizer(model, optimizer_of(parse_args(TINY)), cpu).defaults["fused"] is True
    optimizer = build_optimizer(model, optimizer_of(parse_args([*TINY, "--optimizer_impl=foreach"])), cpu)
    assert optimizer.defaults["foreach"] is True and not optimizer.defaults["fused"]
    with pytest.raises(ConfigError, match="--optimizer_impl=fused: no fused AdamW on meta"):
        build_optimizer(model, optimizer_of(parse_args([*TINY, "--optimizer_impl=fused"])), torch.device("meta"))


def test_a_resumed_optimizer_keeps_this_runs_kernels(model):
    """load_state_dict restores the saved groups' settings: a foreach checkpoint would resume foreach."""
    cpu = torch.device("cpu")
    saved = build_optimizer(model, optimizer_of(parse_args([*TINY, "--optimizer_impl=foreach"])), cpu).state_dict()
    fused = build_optimizer(model, optimizer_of(parse_args(TINY)), cpu)
    fused.load_state_dict(saved)
    assert not fused.param_groups[0]["fused"]
    keep_kernels(fused, fused.defaults["fused"], fused.defaults["foreach"])
    assert fused.param_groups[0]["fused"] is True and not fused.param_groups[0]["foreach"]


def test_weight_decay_exempts_norms_and_embeddings_only_when_asked(model):
    names = {id(p): n for n, p in model.named_parameters()}
    (every,) = build_optimizer(model, optimizer_of(parse_args(TINY)), torch.device("cpu")).param_groups
    assert every["weight_decay"] == 0.1 and len(every["params"]) == len(names)
    decay, exempt = build_optimizer(
        model,
        optimizer_of(parse_args([*TINY, "--weight_decay_norms_and_embeddings=False"])),
        torch.device("cpu"),
    ).param_groups
    assert decay["weight_decay"] == 0.1 and exempt["weight_decay"] == 0.0
    exempt_names = {names[id(p)] for p in exempt["params"]}
    assert "base_model.embedding.weight" in exempt_names and "base_model.dec_norm.weight" in exempt_names
    assert all(n.endswith(("ln.weight", "embedding.weight", "dec_norm.weight")) for n in exempt_names), exempt_names
    assert "head.weight" in {names[id(p)] for p in decay["params"]}
    assert len(decay["params"]) + len(exempt["params"]) == len(names)


def test_clipping_scales_to_the_threshold_and_returns_the_norm_before(model):
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    total = sum(p.numel() for p in model.parameters()) ** 0.5
    assert clip_gradients(model, 0.0, global_norm=False).item() == pytest.approx(total)  # no clipping
    assert clip_gradients(model, 1.0, global_norm=False).item() == pytest.approx(total)
    after = torch.stack([p.grad.norm() for p in model.parameters()]).norm()
    assert after.item() == pytest.approx(1.0, rel=1e-3)
    model.zero_grad(set_to_none=True)


def test_muon_takes_torch_muons_steps_on_the_blocks_matrices_and_adamw_on_the_rest():
    """--optimizer=muon on a model built unfused (q, k, v, gate, up: matrices of their own) equals
    torch.optim.Muon on the blocks' matrices plus AdamW on the rest, step for step, bit for bit."""
    cpu = torch.device("cpu")
    # one block of `tiny` (each of Muon's orthogonalisations takes a tenth of a second on a CPU: bf16)
    unfused = get_model_config("tiny", 256, tensor_parallel=2).updated(nlayers=1)
    ours, theirs = (build_model(unfused, cpu) for _ in range(2))
    init_weights(ours, 0)
    theirs.load_state_dict(ours.state_dict())
    query = "base_model.layers.0.attn.in_proj.query.weight"
    start = ours.state_dict()[query].clone()
    cfg = parse_args([*TINY, "--optimizer=muon", "--learning_rate=0.01", "--weight_decay=0.1"])
    optimizer = build_optimizer(ours, optimizer_of(cfg), cpu)
    matrices = {n for n, p in ours.named_parameters() if p in muon_params(ours)}
    assert len(matrices) == 7  # q, k, v, dense, gate, up, down
    mine = [p for n, p in theirs.named_parameters() if n in matrices]
    muon = torch.optim.Muon(mine, lr=0.01, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")
    rest = [
        {**g, "params": [p for p in g["params"] if all(p is not m for m in mine)]}
        for g in decay_groups(theirs, 0.1, True)
    ]
    adamw = torch.optim.AdamW(rest, lr=0.01, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, fused=True)
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        for model in (ours, theirs):
            model(tokens[:, :-1], labels=tokens[:, 1:]).backward()
        for step in (optimizer, muon, adamw):
            step.step()
            step.zero_grad()
    a, b = ours.state_dict(), theirs.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a[query], start)


def test_muon_does_not_combine_with_skipping_bad_steps_or_lora():
    with pytest.raises(ConfigError, match="--skip_bad_steps leaves steps out inside AdamW's fused kernels"):
        check_optimizer(optimizer_of(parse_args([*TINY, "--optimizer=muon", "--skip_bad_steps=3"])), lora=False)
    with pytest.raises(ConfigError, match="--optimizer=muon updates the blocks' matrices, which --lora_rank freezes"):
        check_optimizer(optimizer_of(parse_args([*TINY, "--optimizer=muon"])), lora=True)
