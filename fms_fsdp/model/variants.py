"""Model variants (names -> ibm-fms LLaMAConfig, or model/moe.py's MoEConfig for sparse ones), model
construction and FLOPs.

The model is ibm-fms's LLaMA (its feed-forward layers mixtures of experts in a sparse variant); `CausalLM` only gives it a head that, given labels, returns the loss
without materialising the logits (model/loss.py; under tensor parallelism over each rank's slice of the
vocabulary). A model is built fused as checkpoints hold it, or unfused under tensor parallelism (q, k,
v and gate, up apart; `FUSED` maps one to the other). Weight init is model/initialization.py's.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Optional, Protocol, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from fms.models.llama import LLaMA, LLaMAConfig
from fms.modules.head import LinearClassificationHead
from torch.distributed.tensor import DTensor, Partial, Replicate

from fms_fsdp.errors import ConfigError
from fms_fsdp.model.loss import ChunkFn, VocabShard, chunk_loss, chunked_cross_entropy
from fms_fsdp.model.moe import MoEConfig, Routing, check_experts, inactive_params, sparsify

_L3 = dict(src_vocab_size=128256, rope_theta=500000.0)
_TINY = dict(
    src_vocab_size=4096, emb_dim=256, nheads=4, kvheads=2, nlayers=4, multiple_of=64, max_expected_seq_len=1024
)

# Arguments to fms LLaMAConfig; unspecified fields keep LLaMAConfig's defaults.
VARIANTS: dict[str, dict[str, Any]] = {
    # small variants for CPU tests and the quick start; micro's checkpoints are kept as test data (3 MB)
    "micro": dict(
        src_vocab_size=1024, emb_dim=64, nheads=2, kvheads=1, nlayers=2, multiple_of=32, max_expected_seq_len=256
    ),
    "tiny": dict(_TINY),
    "tiny_llama3": dict(_TINY, rope_theta=500000.0),
    "tiny_tied": dict(_TINY, tie_heads=True),  # the head tied to the embedding, as Llama 3.2's
    "tiny_mha": dict(_TINY, kvheads=4),  # as many KV heads as heads: tensor parallel up to 4 ranks
    "small": dict(
        src_vocab_size=32000, emb_dim=768, nheads=12, kvheads=4, nlayers=12, multiple_of=256, max_expected_seq_len=2048
    ),
    # fms-fsdp's variants, with exactly its dimensions
    "llama2_1.4b": dict(emb_dim=2048, nheads=16, nlayers=24, hidden_grow_factor=3, kvheads=4),
    "llama2_7b": dict(hidden_grow_factor=11008 / 4096, kvheads=32),
    "llama2_13b": dict(emb_dim=5120, nheads=40, nlayers=40, hidden_grow_factor=13824 / 5120),
    "llama2_34b": dict(
        emb_dim=8192,
        nheads=64,
        kvheads=8,
        nlayers=48,
        hidden_grow_factor=22016 / 8192,
        max_expected_seq_len=16384,
        rope_theta=1000000.0,
    ),
    "llama2_70b": dict(
        emb_dim=8192, multiple_of=4096, nheads=64, kvheads=8, nlayers=80, hidden_grow_factor=28672 / 8192
    ),
    "llama3_194m_4k": dict(_L3, emb_dim=1024, nheads=8, nlayers=10, max_expected_seq_len=4096),
    "llama3_1.8b": dict(
        _L3, emb_dim=2048, nheads=16, kvheads=8, nlayers=24, hidden_grow_factor=3.5, max_expected_seq_len=8192
    ),
    "llama3_3.2b": dict(
        _L3, emb_dim=3072, nheads=24, kvheads=8, nlayers=24, hidden_grow_factor=8 / 3, max_expected_seq_len=8192
    ),
    "llama3_8b": dict(
        _L3, emb_dim=4096, nheads=32, kvheads=8, nlayers=32, hidden_grow_factor=3.5, max_expected_seq_len=8192
    ),
    "llama3_70b": dict(
        _L3, emb_dim=8192, nheads=64, kvheads=8, nlayers=80, hidden_grow_factor=3.5, max_expected_seq_len=8192
    ),
}
for _name in ("llama3_1.8b", "llama3_3.2b", "llama3_8b", "llama3_70b"):
    VARIANTS[f"{_name}_4k"] = dict(VARIANTS[_name], max_expected_seq_len=4096)


def llama3_rope_scaling(factor: float, original: int = 8192) -> dict[str, Any]:
    """Llama 3.1's rotary scaling (rope_type llama3), as fms and Hugging Face read it."""
    return dict(
        rope_type="llama3",
        factor=float(factor),
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=original,
    )


# Meta's Llama 3.1 and 3.2 (128k context: rotary scaling over Llama 3's 8192 positions); 3.2 ties the head
for _name, _args in {
    "llama3.1_8b": dict(VARIANTS["llama3_8b"], rope_scaling=llama3_rope_scaling(8)),
    "llama3.1_70b": dict(VARIANTS["llama3_70b"], rope_scaling=llama3_rope_scaling(8)),
    "llama3.1_405b": dict(
        _L3,
        emb_dim=16384,
        nheads=128,
        kvheads=8,
        nlayers=126,
        hidden_grow_factor=3.25,
        rope_scaling=llama3_rope_scaling(8),
    ),  # fmt: skip
    "llama3.2_1b": dict(
        _L3,
        emb_dim=2048,
        nheads=32,
        kvheads=8,
        nlayers=16,
        hidden_grow_factor=4.0,
        tie_heads=True,
        rope_scaling=llama3_rope_scaling(32),
    ),  # fmt: skip
    "llama3.2_3b": dict(
        _L3,
        emb_dim=3072,
        nheads=24,
        kvheads=8,
        nlayers=28,
        hidden_grow_factor=8 / 3,
        tie_heads=True,
        rope_scaling=llama3_rope_scaling(32),
    ),  # fmt: skip
}.items():
    VARIANTS[_name] = dict(_args, max_expected_seq_len=131072)

# Mixture-of-experts variants (MoEConfig's fields): tiny and small for CPU, Mistral's Mixtral with Hugging
# Face's exact dimensions (each expert the width of the dense layer a growth factor gives)
_MIXTRAL = dict(kvheads=8, rope_theta=1000000.0, moe_experts=8, moe_top_k=2)
VARIANTS.update(
    {
        "tiny_moe": dict(_TINY, moe_experts=4, moe_top_k=2, hidden_grow_factor=1.0),
        "small_moe": dict(VARIANTS["small"], moe_experts=8, moe_top_k=2, hidden_grow_factor=1.0),
        "mixtral_8x7b": dict(_MIXTRAL, hidden_grow_factor=3.5, max_expected_seq_len=32768),
        "mixtral_8x22b": dict(
            _MIXTRAL,
            src_vocab_size=32768,
            emb_dim=6144,
            nheads=48,
            nlayers=56,
            hidden_grow_factor=16384 / 6144,
            max_expected_seq_len=65536,
        ),
    }
)

ALIASES = {"7b": "llama2_7b", "13b": "llama2_13b", "34b": "llama2_34b", "70b": "llama2_70b"}

# fms fuses q, k, v into one Linear and the FFN's gate and up projections into another; checkpoints
# and exports hold the fused weights. Tensor parallelism builds them apart (a rank holds its heads of
# each), under the same fused names in checkpoints: module -> (fused Linear, its parts in row order).
FUSED = {"attn.in_proj": ("qkv_fused", ("query", "key", "value")), "ff_sub_layer": ("wg1_fused", ("wg", "w1"))}
_PART = re.compile(r"^(.*\.)(attn\.in_proj|ff_sub_layer)\.(query|key|value|wg|w1)\.(weight|bias)$")


def fused_parts(shapes: Mapping[str, Sequence[int]]) -> dict[str, list[tuple[str, int]]]:
    """For the parameters of a model built unfused (name -> global shape), each fused name as
    checkpoints hold it -> its parts' names and their first rows in it, in fms's order (q, k, v;
    gate, up). Empty for a model built fused."""
    groups: dict[str, list[tuple[str, int]]] = {}
    for name in shapes:
        m = _PART.match(name)
        if m is None or m.group(3) != FUSED[m.group(2)][1][0]:
            continue
        prefix, owner, _, kind = m.groups()
        fused, parts = FUSED[owner]
        row, members = 0, []
        for part in parts:
            member = f"{prefix}{owner}.{part}.{kind}"
            members.append((member, row))
            row += shapes[member][0]
        groups[f"{prefix}{owner}.{fused}.{kind}"] = members
    return groups


def fuse_full(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A whole (unsharded) state dict with fms's fused keys, whether the model was built fused or not."""
    groups = fused_parts({k: v.shape for k, v in state.items()})
    parts = {m for members in groups.values() for m, _ in members}
    out = {k: v for k, v in state.items() if k not in parts}
    for fused, members in groups.items():
        out[fused] = torch.cat([state[m] for m, _ in members])
    return out


def split_full(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """A whole state dict with fused keys made to fit `model`: cut into its parts where it is built unfused."""
    groups = fused_parts({k: p.shape for k, p in model.named_parameters()})
    out = dict(state)
    for fused, members in groups.items():
        if fused in out:
            whole = out.pop(fused)
            for i, (member, row) in enumerate(members):
                stop = members[i + 1][1] if i + 1 < len(members) else whole.shape[0]
                out[member] = whole[row:stop].contiguous()
    return out


def resolve_variant(name: str) -> str:
    """The canonical variant name for `name` (aliases included); ConfigError listing the valid ones."""
    if name in VARIANTS:
        return name
    if name in ALIASES:
        return ALIASES[name]
    valid = ", ".join(list(VARIANTS) + list(ALIASES))
    raise ConfigError(f"--model_variant: unknown variant {name!r}; valid: {valid}")


def get_model_config(
    name: str,
    vocab_size: Optional[int] = None,
    seq_length: Optional[int] = None,
    tensor_parallel: int = 1,
    rope_theta: Optional[float] = None,
    rope_scaling_factor: Optional[float] = None,
    norm_eps: Optional[float] = None,
    positions: Optional[int] = None,
    moe: Optional[Mapping[str, int]] = None,
) -> LLaMAConfig:
    """The fms LLaMAConfig of variant `name`, with its vocabulary replaced by `vocab_size` if given and
    its rotary cache grown to `seq_length` if that is longer (a run setting, not a model limit: the
    weights do not depend on it); built unfused for tensor parallelism (each rank holds its heads of
    q, k and v: `FUSED`). `rope_theta` and `rope_scaling_factor` (llama3 scaling from the variant's
    original context; 1: none) replace the variant's, to extend a model's context; `norm_eps` and
    `positions` (--norm_eps, --max_position_embeddings) replace the variant's RMSNorm epsilon and
    positions, to match a Hugging Face model's. `moe` (MoEConfig fields: --moe_experts, --moe_top_k,
    --moe_shared_experts) makes a dense variant sparse or changes a sparse one's experts."""
    args = dict(VARIANTS[resolve_variant(name)])
    args.update(moe or {})
    if "moe_experts" not in args and any(k.startswith("moe_") for k in args):
        raise ConfigError(f"--moe_top_k and --moe_shared_experts need --moe_experts on a dense variant ({name})")
    if vocab_size is not None:
        args["src_vocab_size"] = vocab_size
    if norm_eps is not None:
        args["norm_eps"] = float(norm_eps)
    if rope_theta is not None:
        args["rope_theta"] = float(rope_theta)
    if rope_scaling_factor is not None:
        original = args.get("rope_scaling", {}).get("original_max_position_embeddings", args["max_expected_seq_len"])
        args["rope_scaling"] = llama3_rope_scaling(rope_scaling_factor, original) if rope_scaling_factor != 1 else {}
    if positions is not None:  # after the scaling, which counts from the variant's own context
        args["max_expected_seq_len"] = positions
    if tensor_parallel > 1:
        args["fused_weights"] = False
    config = MoEConfig(**args) if "moe_experts" in args else LLaMAConfig(**args)
    if isinstance(config, MoEConfig):
        check_experts(config)
    if seq_length is not None and seq_length > config.max_expected_seq_len:
        config = config.updated(max_expected_seq_len=seq_length)
    return config


def context_length(model_config: LLaMAConfig) -> int:
    """The positions a model serves: its max_expected_seq_len (the variant's, or the trained length when
    longer) or, with llama3 rotary scaling, its original context times the factor when that is more."""
    scaling = model_config.rope_scaling or {}
    scaled = 0
    if scaling.get("rope_type") == "llama3":
        scaled = int(scaling["original_max_position_embeddings"] * scaling["factor"])
    return max(model_config.max_expected_seq_len, scaled)


class LMHead(LinearClassificationHead):
    """fms's output head; called with labels it returns the mean cross entropy (chunked, see model/loss.py)
    instead of the logits, plus `z_loss_weight` x the mean lse^2 when training (--z_loss_weight; that
    term of the last forward, detached, in `z_loss`). `chunk_fn` is replaced by a compiled copy when
    the run compiles; `max_chunk_bytes` (default: by device) is set by the memory plan to trace a GPU's
    chunks on the CPU."""

    chunk_fn: ChunkFn = staticmethod(chunk_loss)
    max_chunk_bytes: Optional[int] = None
    z_loss_weight: float = 0.0
    z_loss: Optional[torch.Tensor] = None
    backward_twice: bool = False  # zero-bubble pipeline schedules: the inputs' gradients, then the weights'

    def forward(self, x: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        if isinstance(self.weight, DTensor):
            return self._vocab_parallel(x, labels)
        if labels is None:
            return super().forward(x)
        weight, device = self.weight, x.device.type
        if torch.is_autocast_enabled(device):  # the loss's own gradient matmuls run in bf16 too, as under FSDP
            dtype = torch.get_autocast_dtype(device)
            x, weight = x.to(dtype), weight.to(dtype)
        loss, self.z_loss = chunked_cross_entropy(
            x,
            weight,
            labels,
            self.chunk_fn,
            self.max_chunk_bytes,
            z_weight=self.z_loss_weight,
            backward_twice=self.backward_twice,
        )
        return loss

    def _vocab_parallel(self, x: torch.Tensor, labels: Optional[torch.Tensor]) -> torch.Tensor:
        """Tensor parallel: this rank's weight is a slice of the vocabulary, the hidden states arrive
        split over the sequence (sequence parallel) and are gathered; the loss reduces over the slices
        (loss parallel, eager); the hidden states' gradient is a partial sum, reduce-scattered back."""
        weight, mesh = self.weight, self.weight.device_mesh
        assert isinstance(x, DTensor), "the final norm is sequence parallel: its output is a DTensor"
        hidden = x.redistribute(placements=[Replicate()])
        if labels is None:
            return F.linear(hidden, weight).full_tensor()
        local = weight.to_local()
        shard = VocabShard(mesh.get_group(), mesh.get_local_rank() * local.shape[0])
        loss, self.z_loss = chunked_cross_entropy(
            hidden.to_local(grad_placements=[Partial()]),
            local,
            labels,
            None,
            self.max_chunk_bytes,
            shard,
            self.z_loss_weight,
            self.backward_twice,
        )
        return loss


class Lines(Protocol):
    """How a batch of packed lines is fed to the blocks (parallel/attention.py's LinePlan): documents kept
    apart, the line split over a context-parallel group (`context`, None without one)."""

    @property
    def context(self) -> Any: ...

    def prepare(
        self, x: torch.Tensor, labels: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, Optional[torch.Tensor], dict[str, Any]]: ...


class CausalLM(LLaMA):
    """fms's LLaMA whose forward also takes `labels` and then returns the loss, not the logits. With a
    `lines` plan (parallel/attention.py) the attention stays inside each document of a packed line
    (--document_masking) and the line is split over a context-parallel group: the forward takes whole
    lines, computes on this rank's part, and returns the whole line's logits, or its share of the loss."""

    lines: Optional[Lines] = None
    routing: Optional[Routing] = None  # a sparse model's routing settings, shared by its MoE layers

    def __init__(self, config: LLaMAConfig):
        super().__init__(config)
        if isinstance(config, MoEConfig):
            self.routing = sparsify(self, config)
        self.head = LMHead(config.emb_dim, config.src_vocab_size, bias=False)
        # fms gives its embedding padding_idx=config.pad_id, whose default -1 is the vocabulary's last
        # token: that row would never get a gradient. Packed pretraining has no padding, and
        # transformers' Llama trains every row (tests/test_reference.py found the difference)
        self.base_model.embedding.padding_idx = None

    def forward(self, x: torch.Tensor, labels: Optional[torch.Tensor] = None, **kwargs: Any) -> torch.Tensor:
        x, labels, extra = self.prepare(x, labels)
        kwargs = {**extra, **kwargs}
        if labels is None:
            logits = super().forward(x, **kwargs)
            cp = None if self.lines is None else self.lines.context
            return logits if cp is None else cp.gather(logits, 1)
        hidden, _ = self.base_model(x, **kwargs)
        return self.loss(hidden, labels)

    def prepare(
        self, x: torch.Tensor, labels: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, Optional[torch.Tensor], dict[str, Any]]:
        """(this rank's part of the lines `x`, of their labels, the blocks' attention kwargs): the lines
        plan's, or the lines as they are."""
        return (x, labels, {}) if self.lines is None else self.lines.prepare(x, labels)

    def loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss of the final norm's output `hidden`: the head's mean over the labels, scaled to this
        rank's share of the line under context parallelism."""
        loss = self.head(hidden, labels)
        cp = None if self.lines is None else self.lines.context
        return loss if cp is None else loss * cp.loss_scale(labels)


def build_model(model_config: LLaMAConfig, device: torch.device) -> CausalLM:
    """An fms LLaMA with uninitialised weights on `device` (use torch.device('meta') to allocate nothing)."""
    with device:
        return CausalLM(model_config)


def count_params(model_config: LLaMAConfig) -> int:
    """Parameters of a model with this config, counted on the meta device (a tied head once)."""
    model = build_model(model_config, torch.device("meta"))
    if model_config.tie_heads:  # as post_init ties them
        model.head.weight = model.base_model.embedding.weight
    return sum(p.numel() for p in model.parameters())


def flops_per_token(model_config: LLaMAConfig, seq_length: int) -> float:
    """Training FLOPs per token, PaLM count: 6*N + 12*L*H*Q*T, N the parameters a token uses without the
    input embedding (the output head is a real matmul and counts; of a sparse model's experts only the
    top-k chosen count)."""
    n = count_params(model_config) - model_config.src_vocab_size * model_config.emb_dim * (not model_config.tie_heads)
    if isinstance(model_config, MoEConfig):
        n -= inactive_params(model_config)
    head_dim = model_config.emb_dim // model_config.nheads
    return 6 * n + 12 * model_config.nlayers * model_config.nheads * head_dim * seq_length
