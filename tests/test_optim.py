"""The optimizer: AdamW kernels by device, weight-decay groups, clipping by the global norm."""

import pytest
import torch

from fms_fsdp.errors import ConfigError
from fms_fsdp.flags import parse_args
from fms_fsdp.models import build_model, get_model_config
from fms_fsdp.optim import OptimizerSettings, build_optimizer, clip_gradients, keep_kernels

from conftest import TINY


@pytest.fixture(scope="module")
def model():
    return build_model(get_model_config("tiny"), torch.device("cpu"))


def test_auto_is_fused_on_cpu_and_foreach_can_be_chosen(model):
    cpu = torch.device("cpu")
    assert build_optimizer(model, OptimizerSettings.of(parse_args(TINY)), cpu).defaults["fused"] is True
    optimizer = build_optimizer(model, OptimizerSettings.of(parse_args([*TINY, "--optimizer_impl=foreach"])), cpu)
    assert optimizer.defaults["foreach"] is True and not optimizer.defaults["fused"]
    with pytest.raises(ConfigError, match="--optimizer_impl=fused: no fused AdamW on meta"):
        build_optimizer(
            model, OptimizerSettings.of(parse_args([*TINY, "--optimizer_impl=fused"])), torch.device("meta")
        )


def test_a_resumed_optimizer_keeps_this_runs_kernels(model):
    """load_state_dict restores the saved groups' settings: a foreach checkpoint would resume foreach."""
    cpu = torch.device("cpu")
    saved = build_optimizer(
        model, OptimizerSettings.of(parse_args([*TINY, "--optimizer_impl=foreach"])), cpu
    ).state_dict()
    fused = build_optimizer(model, OptimizerSettings.of(parse_args(TINY)), cpu)
    fused.load_state_dict(saved)
    assert not fused.param_groups[0]["fused"]
    keep_kernels(fused, fused.defaults["fused"], fused.defaults["foreach"])
    assert fused.param_groups[0]["fused"] is True and not fused.param_groups[0]["foreach"]


def test_weight_decay_exempts_norms_and_embeddings_only_when_asked(model):
    names = {id(p): n for n, p in model.named_parameters()}
    (every,) = build_optimizer(model, OptimizerSettings.of(parse_args(TINY)), torch.device("cpu")).param_groups
    assert every["weight_decay"] == 0.1 and len(every["params"]) == len(names)
    decay, exempt = build_optimizer(
        model,
        OptimizerSettings.of(parse_args([*TINY, "--weight_decay_norms_and_embeddings=False"])),
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
