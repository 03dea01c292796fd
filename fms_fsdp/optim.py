"""The optimizer: AdamW over the sharded parameters (fused kernels where the device has them), its
weight-decay groups, and gradient clipping by the global norm; or --optimizer=muon: torch.optim.Muon's
update for the blocks' matrices (each orthogonalised whole, gathered from its shards), AdamW for the
rest (embedding, head, norms), as the Muon papers do."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from fms_fsdp.compat import local_box, local_tensor, muon_adjusted_lr, muon_orthogonalize
from fms_fsdp.console import import_quietly
from fms_fsdp.errors import ConfigError
from fms_fsdp.model.shapes import part_rows

# fused AdamW measured 6-15x faster than foreach on CPU (tiny, small) and 18% more tokens/s on an H100
FUSED_DEVICES = ("cuda", "cpu")


def decay_groups(model: nn.Module, weight_decay: float, decay_all: bool) -> list[dict]:
    """AdamW parameter groups: every weight decays when `decay_all`, else only the matrices of the
    linear layers (norms, biases and embeddings are exempt)."""
    if decay_all:
        return [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": weight_decay}]
    decay: list[nn.Parameter] = []
    exempt: list[nn.Parameter] = []
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad:  # frozen (LoRA's base weights): no optimizer state
                continue
            linear = isinstance(module, nn.Linear) and name in ("weight", "lora_A", "lora_B")
            (decay if linear else exempt).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": exempt, "weight_decay": 0.0}]


def adamw_kernels(impl: str, device: torch.device, skip_bad_steps: int) -> str:
    """--optimizer_impl on `device`: fused or foreach (auto: fused where the device has them);
    ConfigError when the device lacks what is asked, or --skip_bad_steps lacks the fused kernels it
    leaves steps out in (their found_inf input)."""
    if impl == "auto":
        impl = "fused" if device.type in FUSED_DEVICES else "foreach"
    elif impl == "fused" and device.type not in FUSED_DEVICES:
        raise ConfigError(f"--optimizer_impl=fused: no fused AdamW on {device.type}; use foreach or auto")
    if skip_bad_steps and impl != "fused":
        raise ConfigError(
            "--skip_bad_steps leaves steps out inside the fused AdamW kernels, "
            + (
                f"which {device.type} lacks"
                if device.type not in FUSED_DEVICES
                else "use --optimizer_impl=auto or fused"
            )
        )
    return impl


@dataclass(frozen=True, kw_only=True)
class OptimizerSettings:
    """The flags of AdamW: learning rate, weight decay (and whether norms and embeddings decay), betas,
    epsilon, kernels, and --skip_bad_steps (which needs the fused kernels)."""

    learning_rate: float
    weight_decay: float
    decay_all: bool
    betas: tuple[float, float]
    eps: float
    impl: str
    skip_bad_steps: int
    state_dtype: str = "fp32"  # or int8: torchao's 8-bit states
    muon: bool = False
    muon_momentum: float = 0.95
    muon_adjust_lr: str = "match_rms_adamw"


def check_optimizer(settings: OptimizerSettings, lora: bool) -> None:
    """ConfigError for what --optimizer=muon does not combine with (run at start-up)."""
    if settings.muon and settings.skip_bad_steps:
        raise ConfigError(
            "--skip_bad_steps leaves steps out inside AdamW's fused kernels, which --optimizer=muon's "
            "matrices do not use: drop one of them"
        )
    if settings.muon and lora:
        raise ConfigError(
            "--optimizer=muon updates the blocks' matrices, which --lora_rank freezes: use AdamW for LoRA"
        )


def muon_params(model: nn.Module) -> set[nn.Parameter]:
    """The parameters Muon updates: the trainable 2-D weights of the blocks (not LoRA's adapters)."""
    return {
        p
        for name, p in model.named_parameters()
        if p.requires_grad and p.dim() == 2 and ".layers." in f".{name}" and "lora_" not in name
    }


def build_optimizer(model: nn.Module, settings: OptimizerSettings, device: torch.device) -> torch.optim.Optimizer:
    """AdamW with --optimizer_impl's kernels (auto: fused where the device has them); with
    --optimizer=muon, MuonWithAdamW: the blocks' matrices in a Muon group of their own; with
    --optimizer_state_dtype=int8, torchao's AdamW8bit (--optimizer_impl does not apply)."""
    groups = decay_groups(model, settings.weight_decay, settings.decay_all)
    if settings.state_dtype != "fp32":
        return low_bit_adamw(groups, settings)
    impl = adamw_kernels(settings.impl, device, settings.skip_bad_steps)
    kw = dict(lr=settings.learning_rate, betas=settings.betas, eps=settings.eps, **{impl: True})
    if not settings.muon:
        return torch.optim.AdamW(groups, **kw)
    matrices = muon_params(model)
    groups = [{**g, "params": [p for p in g["params"] if p not in matrices]} for g in groups]
    muon = {
        "params": [p for p in model.parameters() if p in matrices],
        "weight_decay": settings.weight_decay,
        "muon": True,
        "momentum": settings.muon_momentum,
        "adjust_lr_fn": settings.muon_adjust_lr,
    }
    rows = part_rows(model)
    parts = {p: rows.get(name, (0, p.shape[0])) for name, p in model.named_parameters() if p in matrices}
    # the same groups on every rank, empty ones too: a pipeline rank's stages may lack some, and a
    # checkpoint's groups are matched by their place
    return MuonWithAdamW([*groups, muon], parts, **kw)


def low_bit_adamw(groups: list[dict], settings: OptimizerSettings) -> torch.optim.Optimizer:
    """torchao's AdamW8bit: each state tensor of 4096 elements or more (a multiple of 256) held as a byte an
    element and a scale per block of 256, dequantized for the update; smaller ones in fp32. Its learning
    rate is a tensor (the LR scheduler fills it); it compiles its update on first use."""
    optimizer = import_quietly("torchao.optim").AdamW8bit(
        groups, lr=settings.learning_rate, betas=settings.betas, eps=settings.eps
    )
    optimizer.state_dtype = settings.state_dtype  # type: ignore[attr-defined]  # what checkpoints record
    return optimizer


def state_dtype(optimizer: torch.optim.Optimizer) -> str:
    """The --optimizer_state_dtype `optimizer` keeps its state in."""
    return getattr(optimizer, "state_dtype", "fp32")


class MuonWithAdamW(torch.optim.AdamW):
    """AdamW for its groups but those marked "muon", which take torch.optim.Muon's update (Nesterov
    momentum, 5 Newton-Schulz steps of its coefficients, its learning-rate adjustment, decoupled weight
    decay) with one difference: a sharded matrix (FSDP2's rows, TP's rows or columns) is gathered whole
    before it is orthogonalised, so every rank computes what one rank holding it would, and keeps its
    own part. A fused weight's parts (q, k, v; gate, up: `parts`, the rows each starts at) are
    orthogonalised each on its own, as the unfused model's weights are under tensor parallelism. One
    optimizer: the LR scheduler, checkpoints and the step all see one."""

    def __init__(self, groups: list[dict], parts: dict[nn.Parameter, tuple[int, ...]], **kw: Any):
        super().__init__(groups, **kw)
        self.parts = parts

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        groups: list[dict[str, Any]] = self.param_groups  # type: ignore[has-type]  # AdamW steps those it sees
        self.param_groups = [g for g in groups if not g.get("muon")]
        try:
            loss = super().step(closure)
        finally:
            self.param_groups = groups
        with torch.no_grad():
            for group in groups:
                if group.get("muon"):
                    self._muon_step(group)
        return loss

    def _muon_step(self, group: dict) -> None:
        momentum, lr, decay = group["momentum"], group["lr"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:  # and a step count, which AdamW's loading expects of every state
                state["momentum_buffer"], state["step"] = torch.zeros_like(p.grad), torch.tensor(0.0)
            state["step"] += 1
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - momentum)
            update = p.grad.lerp(buf, momentum)  # Nesterov, as torch.optim.Muon's default
            whole = update.full_tensor() if isinstance(update, DTensor) else update
            p.mul_(1 - lr * decay)
            (row, col), (rows, cols) = local_box(p)
            local = p.to_local() if isinstance(p, DTensor) else p
            starts = self.parts[p]
            for a, b in zip(starts, starts[1:]):  # each part on its own, with its own learning-rate scale
                lo, hi = max(a, row), min(b, row + rows)
                if lo < hi:  # this rank holds some of the part's rows
                    ortho = muon_orthogonalize(whole[a:b])[lo - a : hi - a, col : col + cols]
                    scale = muon_adjusted_lr(lr, group["adjust_lr_fn"], torch.Size((b - a, p.shape[1])))
                    local[lo - row : hi - row].add_(ortho, alpha=-scale)


def low_bit_state(t: Any) -> bool:
    """Whether `t` (a DTensor's local part) is one of torchao's low-bit optimizer states."""
    return type(local_tensor(t)).__module__.startswith("torchao.optim.")


def load_low_bit_states(optimizer: torch.optim.Optimizer, optim_sd: dict[str, Any]) -> None:
    """After a checkpoint was read into `optim_sd` (get_state_dict's, its torchao low-bit states as fp32
    copies: fused.plain_tensor), each low-bit state of `optimizer` takes its values, quantized in place,
    and `optim_sd` holds the low-bit tensor again for set_state_dict."""
    for group_sd, group in zip(optim_sd["param_groups"], optimizer.param_groups):
        for fqn, param in zip(group_sd["params"], group["params"]):
            loaded = optim_sd["state"].get(fqn, {})
            for key, held in optimizer.state.get(param, {}).items():
                if low_bit_state(held) and key in loaded:
                    held.copy_(loaded[key])
                    loaded[key] = held


def set_learning_rates(optimizer: torch.optim.Optimizer, rates: list[float]) -> None:
    """Each param group's learning rate (torchao's low-bit AdamW keeps it as a tensor)."""
    for group, rate in zip(optimizer.param_groups, rates):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(rate)
        else:
            group["lr"] = rate


def keep_kernels(optimizer: torch.optim.Optimizer, fused: bool, foreach: bool) -> None:
    """After loading a checkpoint's optimizer state, which restores the saved groups' settings: this
    run's --optimizer_impl wins (a checkpoint written with foreach kernels resumes fused)."""
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = fused, foreach


def grad_norm(
    parameters: Iterable[nn.Parameter], global_: bool, pipeline: Optional[dist.ProcessGroup] = None
) -> torch.Tensor:
    """The L2 norm of the gradients, on the device: over all ranks when `global_` (under tensor
    parallelism one all-reduce over the world of each rank's sum of squares, where a piece held by
    several ranks, replicas or a tensor-parallel group, counts once; else DTensor's reduction over the
    mesh, and the squares summed over the `pipeline` group's stages), else of this rank's shards only
    (no collective)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not global_:
        return get_total_norm([g.to_local() if isinstance(g, DTensor) else g for g in grads], 2.0)
    if not any(isinstance(g, DTensor) and "tp" in (g.device_mesh.mesh_dim_names or ()) for g in grads):
        norm = _norm_over_meshes(grads)  # without tensor parallelism: DTensor's reduction over each mesh
        if pipeline is None:
            return norm
        squares = norm.float().square()
        dist.all_reduce(squares, group=pipeline)
        return squares.sqrt()
    by_copies: dict[int, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        if any(placement.is_partial() for placement in g.placements):
            raise RuntimeError(f"a gradient is still a partial sum ({g.placements}): it was never reduced")
        copies = math.prod(
            g.device_mesh.size(d) for d, placement in enumerate(g.placements) if placement.is_replicate()
        )
        by_copies[copies].append(g.to_local())
    squares = torch.zeros((), dtype=torch.float32, device=grads[0].device)
    for copies, tensors in by_copies.items():
        squares += get_total_norm(tensors, 2.0).float().square() / copies
    dist.all_reduce(squares)
    return squares.sqrt()


def _norm_over_meshes(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of `grads`, each reduced over its DTensor's mesh; with expert parallelism the experts'
    mesh is not the other weights', so each mesh's part is reduced on its own and the parts combined."""
    groups = _by_mesh(grads)
    norms = [get_total_norm(group, 2.0) for group in groups]
    norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
    return norms[0] if len(norms) == 1 else get_total_norm(norms, 2.0)


def _by_mesh(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` grouped by their DTensor's mesh (plain tensors together), in order of first appearance."""
    groups: dict[int, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(id(t.device_mesh) if isinstance(t, DTensor) else 0, []).append(t)
    return list(groups.values())


def clip_gradients(
    model: nn.Module, max_norm: float, global_norm: bool, pipeline: Optional[dist.ProcessGroup] = None
) -> torch.Tensor:
    """Clip the gradients to the global norm `max_norm` (0: no clipping) and return the norm, which
    is global when clipping or `global_norm`, else this rank's (enough for the finite check). Under
    pipeline parallelism the model is this rank's stages and the norm is summed over the `pipeline`
    group's (the whole model's)."""
    params = list(model.parameters())
    norm = grad_norm(params, global_=max_norm > 0 or global_norm, pipeline=pipeline)
    if max_norm > 0:
        for group in _by_mesh([p for p in params if p.grad is not None]):  # an op spans one mesh
            clip_grads_with_norm_(group, max_norm, norm)
    return norm
