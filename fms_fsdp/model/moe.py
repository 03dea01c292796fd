"""Mixture of experts on the Llama trunk: each block's feed-forward becomes `MoEFeedForward`, Mixtral's
token-choice top-k routing over SwiGLU experts (plus optional shared experts every token passes through).

Dense and sparse models share one code path: the same fms LLaMA (attention, norms, embedding, head,
loss, pipeline stages, checkpoints); only `ff_sub_layer` differs. The layer keeps ibm-fms's
`MOEFeedForward` parameters (`gate`, `cond_ffn.w13` = gate and up rows per expert, `cond_ffn.w2`),
as fms's Mixtral names them, and replaces its forward: fms's runs Triton kernels and has no auxiliary
losses, no capacity and no dispatch over ranks. Routing is dropless unless a capacity factor is set.
The auxiliary losses (Switch's load balancing, ST-MoE's router z-loss) reach the gradients through
`_AuxLossGrad` at each layer, so they need no path to the loss (the same under pipeline stages).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from fms.models.llama import LLaMAConfig
from fms.modules.feedforward import ConditionalFeedForward, GatedLinearUnit, MOEFeedForward
from fms.utils.activation import str_to_activation
from torch.distributed.tensor import DTensor

from fms_fsdp.compat import in_backward
from fms_fsdp.errors import ConfigError


@dataclass
class MoEConfig(LLaMAConfig):
    """An fms LLaMAConfig whose blocks' feed-forward layers are `moe_experts` experts of the dense
    layer's width, `moe_top_k` of them per token, plus `moe_shared_experts` that every token passes."""

    moe_experts: int = 8
    moe_top_k: int = 2
    moe_shared_experts: int = 0


# MoEConfig's own fields, each also a flag (--moe_experts, ...) that makes or reshapes a sparse model
MOE_FIELDS = ("moe_experts", "moe_top_k", "moe_shared_experts")


@dataclass
class Routing:
    """The training's routing settings, shared by every MoE layer of a model (not part of its weights):
    the auxiliary losses' weights, the capacity factor (0: dropless) and the gradient scale of the
    auxiliary losses (1 / the micro-batches of a step, as the main loss is averaged)."""

    balance_weight: float = 0.01
    z_weight: float = 0.0
    capacity_factor: float = 0.0
    grad_scale: float = 1.0
    kernel: str = "auto"  # the experts' matmuls: grouped, loop, or auto (grouped on a GPU in bf16)
    even: bool = False  # the memory plan's trace on fake tensors: no data, the routing taken as even
    stats: Optional["RoutingStats"] = field(default=None, repr=False)


class RoutingStats:
    """Routing figures summed on the device since the last report (no host sync while training): per
    layer and expert the tokens routed and kept, per layer the balance loss, z-loss, slots dropped and
    forwards counted."""

    def __init__(self, layers: int, experts: int, device: torch.device):
        self.tokens = torch.zeros(layers, experts, device=device)
        self.figures = torch.zeros(layers, 4, device=device)  # balance loss, z-loss, dropped slots, forwards

    def add(self, layer: int, kept: torch.Tensor, balance: torch.Tensor, z: torch.Tensor, dropped: torch.Tensor):
        """Count one forward of MoE layer `layer`: slots kept per expert, its losses, slots dropped."""
        self.tokens[layer] += kept.float()
        self.figures[layer] += torch.stack([balance.detach().float(), z.detach().float(), dropped.float(), _one(z)])

    def report(self, dropping: bool) -> dict[str, float]:
        """The interval's routing metrics over every rank (all-reduces: every rank calls it), then zeroed:
        moe_balance_loss and moe_z_loss (mean over layers and forwards), moe_load_max (the busiest
        expert's tokens over the mean, worst layer; 1 when balanced), moe_dropped (share of slots dropped,
        with a capacity factor) and moe_tokens/e<j> (slots expert j took, summed over layers)."""
        both = torch.cat([self.tokens, self.figures], dim=1)
        dist.all_reduce(both)
        tokens, figures = both[:, : self.tokens.shape[1]], both[:, self.tokens.shape[1] :]
        counted = figures[:, 3] > 0
        if not counted.any():
            return {}
        forwards = figures[counted, 3]
        load = tokens[counted].max(1).values / tokens[counted].mean(1).clamp(min=1e-9)
        record = {
            "moe_balance_loss": float((figures[counted, 0] / forwards).mean()),
            "moe_z_loss": float((figures[counted, 1] / forwards).mean()),
            "moe_load_max": float(load.max()),
        }
        if dropping:
            record["moe_dropped"] = float(figures[:, 2].sum() / (figures[:, 2].sum() + tokens.sum()))
        record.update({f"moe_tokens/e{j}": float(n) for j, n in enumerate(tokens.sum(0).tolist())})
        self.zero()
        return record

    def zero(self) -> None:
        """Forget what was counted."""
        self.tokens.zero_()
        self.figures.zero_()


def _one(like: torch.Tensor) -> torch.Tensor:
    return torch.ones((), device=like.device)


class _AuxLossGrad(torch.autograd.Function):
    """Identity on the layer's output whose backward also gives `aux` the gradient `scale`: the
    auxiliary loss trains the router as if added to the loss (Megatron's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.save_for_backward(aux)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


class _GradScale(torch.autograd.Function):
    """The identity, whose gradient is scaled by `scale`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def balance_loss(probs: torch.Tensor, chosen: torch.Tensor, experts: int) -> torch.Tensor:
    """Switch Transformer's load-balancing loss of one layer: experts x sum over experts of (the share
    of routed slots it got) x (its mean router probability). `probs` [tokens, experts]
    (softmax of the router logits), `chosen` [tokens, k]. transformers' load_balancing_loss_func of one
    layer's logits; k when balanced."""
    share = (
        torch.zeros(experts, device=probs.device).index_add_(
            0, chosen.reshape(-1), torch.ones(chosen.numel(), device=probs.device)
        )
        / chosen.shape[0]
    )
    return experts * (share * probs.mean(0)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean over tokens of logsumexp(router logits)^2."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


def capacity(tokens: int, experts: int, top_k: int, factor: float) -> int:
    """Slots each expert takes under --moe_capacity_factor: ceil(factor x tokens x k / experts)."""
    return math.ceil(factor * tokens * top_k / experts)


def kept_slots(chosen: torch.Tensor, experts: int, limit: int) -> torch.Tensor:
    """Which of the [tokens, k] slots an expert of `limit` slots keeps: the first ones in token order
    (a token's first choice before its second), as GShard drops."""
    flat = chosen.t().reshape(-1)  # every token's first choice, then every token's second, ...
    onehot = F.one_hot(flat, experts)
    position = (onehot.cumsum(0) * onehot).sum(-1) - 1
    return (position < limit).reshape(chosen.shape[1], -1).t()


class Experts(ConditionalFeedForward):
    """A sparse layer's experts: ibm-fms's stacked SwiGLU weights (`w13` [experts, 2 x width, dim], `w2`
    [experts, dim, width]), called on rows grouped by expert, so that FSDP gathers them for the call."""

    def __init__(self, experts: int, dim: int, width: int, routing: Routing):
        super().__init__(experts, dim, width)
        self.routing = routing
        # 1 / the ranks of an expert group under expert parallelism: each expert's one copy sums its whole
        # group's tokens' gradients, where data parallelism averages a copy per rank
        self.grad_scale = 1.0

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:  # type: ignore[override]
        """The SwiGLU of this rank's experts (all of them without expert parallelism) over `x`, its rows
        grouped by expert: `counts` rows each, in order."""
        w13, w2 = _local(self.w13), _local(self.w2)
        if self.grad_scale != 1.0:
            w13, w2 = (_GradScale.apply(w, self.grad_scale) for w in (w13, w2))
        kernel, dtype = self.routing.kernel, _compute_dtype(x)
        if kernel == "grouped" or (kernel == "auto" and x.is_cuda and dtype == torch.bfloat16):
            return grouped_swiglu(x.to(dtype), w13.to(dtype), w2.to(dtype), counts)
        outs = []
        for e, rows in enumerate(x[: sum(counts)].split(counts)):
            gate, up = F.linear(rows, w13[e]).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate) * up, w2[e]))
        return torch.cat(outs)


class MoEFeedForward(MOEFeedForward):
    """A block's sparse feed-forward layer: the router picks `top_k` experts per token from the softmax
    of its logits, their outputs are summed with those probabilities renormalised over the chosen
    (Mixtral, transformers' MixtralSparseMoeBlock), plus the shared experts' output."""

    def __init__(self, config: MoEConfig, layer: int, routing: Routing):
        dense_hidden = expert_width(config, 1)
        super().__init__(config.moe_experts, config.moe_top_k, config.emb_dim, dense_hidden)
        self.layer, self.experts, self.routing = layer, config.moe_experts, routing
        self.cond_ffn = Experts(config.moe_experts, config.emb_dim, dense_hidden, routing)
        self.shared = _shared(config) if config.moe_shared_experts else None
        # where the experts are spread over ranks (parallel/expert_parallel.py): (rows, counts, experts) ->
        # the outputs of experts, this rank's, for every rank's rows
        self.dispatch: Optional[Callable[[torch.Tensor, list[int], Callable], torch.Tensor]] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits = self.gate(flat)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, chosen = torch.topk(probs, self.num_activated_experts, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        keep = None
        if self.routing.capacity_factor > 0:
            limit = capacity(flat.shape[0], self.experts, self.num_activated_experts, self.routing.capacity_factor)
            keep = kept_slots(chosen, self.experts, limit)
            weights = weights * keep
        out = self.combine(flat, chosen, weights, keep)
        if self.shared is not None:
            out = out + self.shared(x).reshape(flat.shape)
        out = self._with_aux_losses(out, logits, probs, chosen, keep)
        return out.view_as(x)

    def combine(
        self, flat: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, keep: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """Every token's chosen experts' outputs, weighted and summed in a fixed order (no atomics: the
        same sums on every run). Slots dropped by capacity get no expert and count 0."""
        k = chosen.shape[1]
        slots = chosen.reshape(-1)
        if keep is not None:  # a dropped slot goes to a bin past the last expert, never computed
            slots = torch.where(keep.reshape(-1), slots, self.experts)
        order = torch.argsort(slots, stable=True)
        counts = _counts(slots, self.experts + 1, self.routing.even)
        sorted_rows, counts = flat[order // k], counts[: self.experts]
        if self.dispatch is None:
            routed = self.cond_ffn(sorted_rows, counts)
        else:
            routed = self.dispatch(sorted_rows, counts, self.cond_ffn)
        per_slot = torch.zeros(slots.shape[0], flat.shape[1], dtype=routed.dtype, device=flat.device)
        per_slot[order[: routed.shape[0]]] = routed
        return (per_slot.view(-1, k, flat.shape[1]) * weights.unsqueeze(-1)).sum(1)

    def _with_aux_losses(
        self,
        out: torch.Tensor,
        logits: torch.Tensor,
        probs: torch.Tensor,
        chosen: torch.Tensor,
        keep: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """`out`, with the auxiliary losses' gradient attached when training; the routing figures
        counted once per forward (not again when activation checkpointing recomputes it)."""
        if not (self.training and torch.is_grad_enabled()):
            return out
        routing = self.routing
        balance = balance_loss(probs, chosen, self.experts)
        z = router_z_loss(logits)
        aux = routing.balance_weight * balance + routing.z_weight * z
        if routing.stats is not None and not in_backward():
            slots = chosen if keep is None else torch.where(keep, chosen, self.experts)
            kept = torch.zeros(self.experts + 1, device=out.device).index_add_(
                0, slots.reshape(-1), torch.ones(slots.numel(), device=out.device)
            )
            routing.stats.add(self.layer, kept[: self.experts], balance, z, kept[self.experts])
        if aux.requires_grad:
            out = _AuxLossGrad.apply(out, aux, routing.grad_scale)
        return out


GROUP_ALIGN = 16  # rows: each expert's group of a grouped GEMM starts 16-row aligned (TMA loads, float8)


def grouped_swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The experts' SwiGLU as two grouped GEMMs over all experts at once (torch's grouped_mm, as
    torchtitan's and Megatron's grouped experts), each expert's rows padded to GROUP_ALIGN."""
    rows, offsets, padded = _aligned_rows(counts, x.device)
    grouped = x.new_zeros(padded, x.shape[1]).index_copy(0, rows, x[: rows.shape[0]])
    gate, up = F.grouped_mm(grouped, w13.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
    out = F.grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offsets)
    return out.index_select(0, rows)


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a stacked expert weight (a DTensor sharded by expert under expert
    parallelism), the weight itself otherwise."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype matmuls on `x` run in: autocast's where it is on (one GPU's bf16), else x's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


@torch.compiler.disable
def _aligned_rows(counts: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where each routed row goes once every expert's group is padded to GROUP_ALIGN rows, the groups'
    end offsets, and the padded total."""
    sizes = torch.tensor(counts, dtype=torch.int64)
    padded = (sizes + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    shift = torch.repeat_interleave(padded.cumsum(0) - padded - (sizes.cumsum(0) - sizes), sizes)
    rows = torch.arange(int(sizes.sum())) + shift
    ends = padded.cumsum(0).to(torch.int32)
    return rows.to(device), ends.to(device), int(padded.sum())


@torch.compiler.disable
def _counts(slots: torch.Tensor, bins: int, even: bool) -> list[int]:
    """Slots per expert, on the host (the experts' matmuls need their sizes; compiled code breaks its
    graph here); `even`: split evenly (the memory plan's trace has no data and assumes balanced routing)."""
    if even:
        even, rest = divmod(slots.shape[0], bins - 1)
        return [even + (e < rest) for e in range(bins - 1)] + [0]
    return torch.bincount(slots, minlength=bins).tolist()


def expert_width(config: LLaMAConfig, width: int = 1) -> int:
    """The hidden size fms's dense feed-forward layer has at `width` times the config's growth factor
    (an expert's, `width` 1)."""
    hidden = int(config.hidden_grow_factor * width * config.emb_dim)
    return config.multiple_of * ((hidden + config.multiple_of - 1) // config.multiple_of)


def _shared(config: MoEConfig) -> GatedLinearUnit:
    """The shared experts as one dense SwiGLU layer, `moe_shared_experts` experts wide, built as fms
    builds a block's dense layer."""
    return GatedLinearUnit(
        config.emb_dim,
        hidden_grow_factor=config.hidden_grow_factor * config.moe_shared_experts,
        multiple_of=config.multiple_of,
        activation_fn=str_to_activation(config.activation_fn),
        p_dropout=config.p_dropout,
        use_bias=config.mlp_bias,
        fused=config.fused_weights,
        linear_config=config.linear_config,
    )


def sparsify(model: nn.Module, config: MoEConfig) -> Routing:
    """Give every block of `model` (an fms LLaMA) a `MoEFeedForward` in place of its dense feed-forward
    layer; returns the routing settings they share."""
    routing = Routing()
    for i, block in enumerate(model.base_model.layers):
        block.ff_sub_layer = MoEFeedForward(config, i, routing)
    return routing


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    """The model's MoE layers (none for a dense model)."""
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def inactive_params(config: MoEConfig) -> int:
    """Parameters of the experts a token does not use: every layer's unchosen experts."""
    per_expert = 3 * config.emb_dim * expert_width(config, 1)
    return config.nlayers * (config.moe_experts - config.moe_top_k) * per_expert


def check_experts(config: MoEConfig) -> None:
    """ConfigError unless the routing can be made: top-k at most the experts."""
    if config.moe_top_k > config.moe_experts:
        raise ConfigError(
            f"--moe_top_k={config.moe_top_k} routes each token to more experts than the model has "
            f"(--moe_experts={config.moe_experts}); lower it"
        )


def check_sparse(config: LLaMAConfig, used: dict[str, bool]) -> None:
    """ConfigError naming the first of the features `used` (flag -> given) that a mixture-of-experts
    model does not combine with yet."""
    if not isinstance(config, MoEConfig):
        return
    for flag, given in used.items():
        if given:
            raise ConfigError(
                f"{flag} does not combine with a mixture-of-experts model yet; drop it (FSDP/HSDP "
                "and pipeline stages shard one)"
            )
