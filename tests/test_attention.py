"""Document masking (--document_masking, --document_positions; fms_fsdp/parallel/attention.py): a packed line's
documents are scored as if each were alone, by FlexAttention and by SDPA with a mask alike."""

import functools
import re

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from fms_fsdp.errors import ConfigError
from fms_fsdp.flags import parse_args
from fms_fsdp.model.variants import build_model, get_model_config
from fms_fsdp.parallel.attention import LinePlan
from fms_fsdp.parallel.context_parallel import ContextParallel
from fms_fsdp.settings import mesh_of

from conftest import TINY, train_here

EOS = 0


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = build_model(get_model_config("tiny", 256, 128), torch.device("cpu"))
    m.reset_parameters()
    return m.eval()


def packed(lengths: list[int]) -> tuple[torch.Tensor, list[slice]]:
    """One line of documents of these lengths (each ending with EOS) and where each one lies."""
    gen = torch.Generator().manual_seed(1)
    docs = [torch.cat([torch.randint(1, 256, (n - 1,), generator=gen), torch.tensor([EOS])]) for n in lengths]
    bounds, start = [], 0
    for d in docs:
        bounds.append(slice(start, start + len(d)))
        start += len(d)
    return torch.cat(docs)[None], bounds


@pytest.mark.parametrize("flex", [False, True])
@pytest.mark.parametrize("restart", [True, False])
def test_each_document_of_a_packed_line_is_scored_as_if_alone(model, flex, restart):
    line, bounds = packed([20, 33, 11])
    documents = LinePlan(EOS, restart, None, flex)
    with torch.no_grad():
        together = model(line, **documents.prepare(line, None)[2])
        plain = model(line)
        for where in bounds:
            alone = line[:, where]
            # a document alone, at position 0 (--document_positions=document) or where it lies in the line
            positions = torch.arange(alone.shape[1]) + (0 if restart else where.start)
            expected = model(alone, position_ids=positions[None])
            assert torch.allclose(together[:, where], expected, atol=1e-5), (where, flex, restart)
        # without the mask the later documents see the earlier ones (what this test would catch)
        assert not torch.allclose(plain[:, bounds[1]], together[:, bounds[1]], atol=1e-3)


def test_flex_and_sdpa_masks_agree_on_a_batch(model):
    a, _ = packed([5, 40, 19])
    b, _ = packed([64])
    batch = torch.cat([a, b])
    with torch.no_grad():
        sdpa = model(batch, **LinePlan(EOS, True, None, flex=False).prepare(batch, None)[2])
        flex = model(batch, **LinePlan(EOS, True, None, flex=True).prepare(batch, None)[2])
    assert torch.allclose(sdpa, flex, atol=1e-5)


@pytest.mark.parametrize("size", [2, 4])
def test_a_context_parallel_ranks_block_mask_gives_its_queries_the_attention_of_one_rank(size):
    """Each rank of C, attending with its own chunks' queries under its BlockMask to the whole line's
    keys, gets its rows of one rank's document-masked attention (as the CUDA path does after the
    all-gather)."""
    line, bounds = packed([5, 40, 19])
    q, k, v = torch.randn(3, 1, 4, line.shape[1], 16, generator=torch.Generator().manual_seed(2)).unbind(0)
    mask = LinePlan(EOS, True, None, flex=False).prepare(line, None)[2]["mask"]
    whole = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for rank in range(size):
        cp = ContextParallel(None, rank, size)  # split only: no group needed
        kwargs = LinePlan(EOS, True, cp, flex=True).prepare(line, None)[2]
        got = flex_attention(cp.split(q, 2), k, v, block_mask=kwargs["block_mask"])
        assert torch.allclose(got, cp.split(whole, 2), atol=1e-5), rank
        assert not torch.allclose(got, cp.split(causal, 2), atol=1e-3)  # the documents' mask is there


def test_document_positions_need_document_masking():
    with pytest.raises(ConfigError, match="--document_positions=document restarts positions at each document"):
        parse_args([*TINY, "--document_positions=document"])


def test_a_run_trains_with_document_masking(tmp):
    records = train_here(
        tmp, ["--num_steps=4", "--batch_size=2", "--document_masking=True", "--document_positions=document"]
    )
    assert records[-1]["loss"] < records[0]["loss"]


@pytest.mark.parametrize(
    "args, world, message",
    [
        (["--context_parallel_size=3"], 4, "--context_parallel_size=3 must divide the world size 4"),
        (
            ["--context_parallel_size=2", "--tensor_parallel_size=2"],
            2,
            "--context_parallel_size=2 must divide the world size 2 / --tensor_parallel_size=2 = 1",
        ),
        (["--context_parallel_size=3", "--seq_length=64"], 3, "--seq_length=64 must be a multiple of 6"),
        (
            ["--context_parallel_size=2", "--tensor_parallel_size=4", "--seq_length=36"],
            8,
            "each rank's 18 tokens of a line must divide by 4",
        ),
        (
            ["--context_parallel_size=2", "--cp_attention=ring", "--document_masking=True"],
            2,
            "--document_masking=True needs --cp_attention=allgather",
        ),
        (
            ["--context_parallel_size=2", "--cp_attention=ring", "--device=cuda"],
            2,
            "--cp_attention=ring runs CUDA's flash attention, which takes bf16: set --mixed_precision=True",
        ),
    ],
)
def test_context_parallel_errors_name_the_numbers_at_start_up(args, world, message):
    from fms_fsdp.parallel.mesh import check_context_parallel, mesh_shape

    settings = mesh_of(parse_args([*TINY, *args]))
    device = "cuda" if "--device=cuda" in args else "cpu"
    with pytest.raises(ConfigError, match=re.escape(message)):
        mesh_shape(settings, world, world)
        check_context_parallel(settings, torch.device(device))


def test_context_parallel_in_compiled_blocks_needs_torch_2_13(monkeypatch):
    """torch 2.11's compiled backward of the merged attention took wrong steps (tests/test_meshes.py's
    compiled C=2 run on 2.11): refused there, in one line."""
    from fms_fsdp import compat
    from fms_fsdp.parallel.mesh import check_context_parallel

    settings = mesh_of(parse_args([*TINY, "--context_parallel_size=2", "--use_torch_compile=True"]))
    monkeypatch.setattr(compat, "TORCH", (2, 11))
    with pytest.raises(ConfigError, match="with --use_torch_compile=True needs torch 2.13 or later"):
        check_context_parallel(settings, torch.device("cpu"))
    monkeypatch.setattr(compat, "TORCH", (2, 13))
    check_context_parallel(settings, torch.device("cpu"))


def _saved_bytes(forward) -> int:
    """Bytes of the distinct storages autograd keeps for the backward of `forward()`."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(storages.values())


def test_a_context_parallel_rank_keeps_no_more_per_token_than_one_rank(model, one_process_group):
    """Both context-parallel attentions, on a group of one rank (the whole line), keep no more for the
    backward than plain SDPA does with its keys and values one per KV head (fms's SDPA keeps them
    repeated for every query head): their output once (laid out as the output projection reads it, one
    tensor for both backwards) and their own copy of the values, not the fused q, k, v projection's
    output that the values view. Either regression alone fails this."""
    cp = ContextParallel(torch.distributed.group.WORLD, 0, 1)
    line = torch.randint(0, 256, (1, 128), generator=torch.Generator().manual_seed(4))
    model.train()
    try:
        config, (batch, seq) = model.config, line.shape
        head_dim = config.emb_dim // config.nheads
        repeated = config.nlayers * 2 * (config.nheads - config.kvheads) * batch * seq * head_dim * 4  # fp32 K/V
        plain = _saved_bytes(lambda: model(line)) - repeated
        for ring in (False, True):
            kwargs = LinePlan(None, False, cp, flex=False, ring=ring).prepare(line, None)[2]
            assert torch.allclose(model(line, **kwargs), model(line), atol=1e-5), ring
            assert _saved_bytes(functools.partial(model, line, **kwargs)) <= plain, ring
    finally:
        model.eval()


def test_ring_attention_compiles_as_one_op_and_is_causal_attention(one_process_group):
    """--cp_attention=ring's op (torch's ring attention) in a fullgraph-compiled function, forward and
    backward, on a group of one rank: causal attention with grouped-query keys and values, within 1e-5,
    leaving torch's own context-parallel settings as they were. Its split over ranks is
    tests/test_meshes.py's (C=2 eager, and under TP)."""
    from fms_fsdp.compat import torch_cp
    from fms_fsdp.parallel.context_parallel import ring_attention_op

    def options() -> tuple:
        return tuple(vars(torch_cp._cp_options).values())

    before = options()
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 32, 16, generator=gen).requires_grad_()
    k, v = (torch.randn(2, 2, 32, 16, generator=gen).requires_grad_() for _ in range(2))
    name = torch.distributed.group.WORLD.group_name
    ring = torch.compile(lambda q, k, v: ring_attention_op(q, k, v, name, None)[0], fullgraph=True)
    got = ring(q, k, v).transpose(1, 2)  # tokens first
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    expected = torch.autograd.grad(want.square().sum(), (q, k, v))
    assert torch.allclose(got, want, atol=1e-5)
    assert all(torch.allclose(g, e, atol=1e-5) for g, e in zip(grads, expected))
    assert options() == before  # torch's process-wide ring settings are its own again
