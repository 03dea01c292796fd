"""The chunked cross entropy (model/loss.py) against torch's, and the model's loss path against its logits."""

import pytest
import torch
import torch.nn.functional as F

from fms_fsdp.model.initialization import init_weights
from fms_fsdp.model.loss import IGNORE_INDEX, chunk_tokens, chunked_cross_entropy
from fms_fsdp.model.variants import build_model, get_model_config


def close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> bool:
    return (a - b).abs().max().item() <= rel * b.abs().max().item()


def test_chunks_are_equal_and_bounded():
    assert chunk_tokens(4096, 128256, 1 << 27) == 256  # 262 would fit; 256 divides
    assert chunk_tokens(8, 100, 1 << 30) == 8
    assert chunk_tokens(7, 100, 800) == 1  # tiny chunks either way
    assert chunk_tokens(4099, 128256, 1 << 27) == 257  # a prime count: 16 chunks, the last one shorter


@pytest.mark.parametrize("chunk_bytes", [400 * 4 * 100, 1 << 30])  # 10 chunks of 40 tokens; one chunk
def test_loss_and_gradients_equal_plain_cross_entropy_in_fp32(chunk_bytes):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 100, 32, generator=g, requires_grad=True)
    weight = torch.randn(400, 32, generator=g, requires_grad=True)
    labels = torch.randint(0, 400, (4, 100), generator=g)
    labels[:, :7] = IGNORE_INDEX  # ignored tokens count neither in the sum nor in the mean
    loss, z = chunked_cross_entropy(hidden, weight, labels, max_chunk_bytes=chunk_bytes)
    (0.5 * loss).backward()
    ours = loss.detach(), hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    ref = F.cross_entropy((hidden @ weight.t()).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    (0.5 * ref).backward()
    assert ours[0].item() == pytest.approx(ref.item(), rel=1e-5) and z.item() == 0.0
    assert close(ours[1], hidden.grad) and close(ours[2], weight.grad)


@pytest.mark.parametrize("chunk_bytes", [400 * 4 * 100, 1 << 30])
def test_z_loss_equals_a_full_logit_z_loss_in_loss_and_gradients(chunk_bytes):
    """--z_loss_weight w: cross entropy + w * mean(logsumexp(logits)^2) over the valid tokens, as a
    textbook full-logit implementation computes it; the z term alone is reported."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 100, 32, generator=g, requires_grad=True)
    weight = torch.randn(400, 32, generator=g, requires_grad=True)
    labels = torch.randint(0, 400, (4, 100), generator=g)
    labels[:, :7] = IGNORE_INDEX
    loss, z = chunked_cross_entropy(hidden, weight, labels, max_chunk_bytes=chunk_bytes, z_weight=1e-2)
    loss.backward()
    ours = loss.detach(), hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    logits, flat = (hidden @ weight.t()).flatten(0, 1), labels.flatten()
    valid = flat != IGNORE_INDEX
    z_ref = 1e-2 * logits.logsumexp(-1)[valid].square().mean()
    ref = F.cross_entropy(logits, flat, ignore_index=IGNORE_INDEX) + z_ref
    ref.backward()
    assert ours[0].item() == pytest.approx(ref.item(), rel=1e-5) and z.item() == pytest.approx(z_ref.item(), rel=1e-5)
    assert z.item() > 0.01 * ref.item() and not z.requires_grad  # the term is there, and only reported
    assert close(ours[1], hidden.grad) and close(ours[2], weight.grad)


def test_without_gradients_only_the_loss_is_computed_and_it_is_the_same():
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(4099, 16, generator=g), torch.randn(300, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 300, (4099,), generator=g)
    labels[::3] = IGNORE_INDEX
    with_grad, _ = chunked_cross_entropy(hidden, weight, labels, max_chunk_bytes=300 * 4 * 500)
    with torch.no_grad():
        without, z = chunked_cross_entropy(hidden, weight, labels, max_chunk_bytes=300 * 4 * 500)
    ref = F.cross_entropy(hidden @ weight.detach().t(), labels, ignore_index=IGNORE_INDEX)
    assert not without.requires_grad and z is None
    assert without.item() == pytest.approx(ref.item(), rel=1e-5) and with_grad.item() == pytest.approx(
        ref.item(), rel=1e-5
    )


def test_bf16_inputs_get_bf16_gradients_and_an_fp32_loss():
    hidden = torch.randn(64, 16, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 50, (64,))
    loss, _ = chunked_cross_entropy(hidden, weight, labels, max_chunk_bytes=16 * 50 * 4)
    loss.backward()
    assert loss.dtype == torch.float32 and hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
    ref = F.cross_entropy((hidden.float() @ weight.float().t()), labels)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-2)


def test_the_models_loss_equals_cross_entropy_of_its_logits():
    """CausalLM(x, labels) == cross_entropy(CausalLM(x)), with the same gradient for every parameter."""
    model = build_model(get_model_config("tiny", vocab_size=512), torch.device("cpu"))
    init_weights(model, seed=3)
    g = torch.Generator().manual_seed(1)
    inputs, labels = torch.randint(0, 512, (2, 2, 32), generator=g)
    model(inputs, labels=labels).backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten()).backward()
    for name, p in model.named_parameters():
        assert close(ours[name], p.grad), name
