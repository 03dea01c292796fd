"""The memory plan (--dry_run): what one rank will hold at its peak, predicted on the CPU before any
GPU is touched, for any world size (--plan_world_size) and device (--plan_device_memory_gib).

Parameters, gradients and optimizer state follow from the parameter shapes (built on the meta device)
and FSDP2's sharding: fp32 master shards (each parameter's first dimension padded to the shard size),
fp32 gradient shards, AdamW's two fp32 moments. --dry_run rehearses the start (memory/rehearsal.py) and
plans with its real shards' bytes instead, these figures checked against them (within AGREEMENT).
FSDP2 holds whole, in the compute dtype: the block in use and the one prefetched, the last block and
the final norm with the head (kept from forward to backward), and one block's unsharded gradients
before their reduce-scatter. Activations are not
counted from a formula: they are traced on fake tensors under torch's MemTracker (memory/activations.py),
per block and outside the blocks, with the loss's working set, for each activation-checkpointing mode.
Activations grow linearly in the micro-batch, so the plan extends to any batch size and checkpointing
fraction.

The predicted peak is params + optimizer + in-flight blocks + the larger of (activations + loss) at
the end of forward and the gradient shards at the end of backward, plus one block's recomputation
when blocks are checkpointed. A plan fits when the peak is at most 90% of the device's memory (the
rest for the CUDA context, communication buffers and allocator fragmentation).

One rank trains the plain module (parallel/parallelize.py): its parameters, gradients and optimizer state are
whole and nothing is gathered; in bf16 the traces run under autocast over fp32 weights, so the bf16
copies of the weights that autograd keeps count among the activations.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Optional, Sequence

import torch
from fms.models.llama import LLaMAConfig

from fms_fsdp.memory.activations import Activations, Shape, trace_activations
from fms_fsdp.memory.settings import MemorySettings, Setting, state_share
from fms_fsdp.model.lora import add_adapters
from fms_fsdp.model.variants import build_model
from fms_fsdp.parallel.activation_checkpointing import checkpointed_blocks
from fms_fsdp.parallel.attention import flex_documents
from fms_fsdp.parallel.pipeline import PipelinePlan, blocks_of, microbatches_in_flight, prune
from fms_fsdp.parallel.settings import MeshShape
from fms_fsdp.parallel.tensor_parallel import TP_COLWISE, TP_ROWWISE

HEADROOM = 0.9  # of the device's memory a plan may use
AGREEMENT = 0.01  # how far the analytic state may be from the rehearsal's real shards
GIB = 2**30
PLAN_FIELDS = ("params", "grads", "optimizer", "gathered", "activations", "loss", "peak", "device")


@dataclass(frozen=True)
class Plan:
    """Bytes one rank holds, by kind, and whether its peak fits the device."""

    params: int
    grads: int
    optimizer: int
    gathered: int
    activations: int
    loss: int  # saved for backward and transient
    peak: int
    device: int
    loss_saved: int
    host: int = 0  # --ac_mode=offload: the chosen blocks' activations, in host memory (not in the peak)

    @property
    def fits(self) -> bool:
        return self.peak <= HEADROOM * self.device

    def line(self) -> str:
        """The one machine-readable line."""
        values = " ".join(f"{name}_bytes={getattr(self, name)}" for name in PLAN_FIELDS)
        return f"PLAN {values} fits={str(self.fits).lower()}"


@dataclass(frozen=True)
class State:
    """Bytes of the model's state on one rank: parameters, gradients, optimizer state."""

    params: int
    grads: int
    optimizer: int

    def gap(self, other: "State") -> float:
        """The largest relative difference of a kind of bytes from `other`'s (0 where both hold none)."""
        pairs = zip((self.params, self.grads, self.optimizer), (other.params, other.grads, other.optimizer))
        return max(abs(a - b) / max(a, b) if max(a, b) else 0.0 for a, b in pairs)


# under tensor parallelism (parallel/tensor_parallel.py's plan): the weights split by rows (column-wise Linear layers,
# the embedding and the head over the vocabulary) and by columns (row-wise ones); the norms are whole
_TP_ROWS = (*(f".{name}.weight" for name in TP_COLWISE), "base_model.embedding.weight", "head.weight")
_TP_COLS = tuple(f".{name}.weight" for name in TP_ROWWISE)


def _tp_shape(name: str, shape: torch.Size, tp: int) -> tuple[int, ...]:
    """A parameter's shape on one rank of a tensor-parallel group of `tp` (before FSDP shards it), in a
    model built as tensor parallelism builds it (unfused)."""
    if name.endswith(_TP_ROWS):
        return (shape[0] // tp, *shape[1:])
    if name.endswith(_TP_COLS):
        return (shape[0], shape[1] // tp)
    return tuple(shape)


def _ep_shape(shape: tuple[int, ...], ep: int) -> tuple[int, ...]:
    """A parameter's part on this rank's expert group: a 1/ep of a sparse block's stacked experts."""
    return (shape[0] // ep, *shape[1:]) if len(shape) == 3 else shape


def _numel_sharded(shape: Sequence[int], shards: int, ep: int = 1) -> int:
    """Elements of a parameter's shard: its first dimension padded to a multiple of the shard count (a
    sparse block's stacked experts [experts, rows, columns]: its rows, over the shards / ep ranks that
    hold the same experts, parallelize.py's placement)."""
    if len(shape) == 3:
        return shape[0] * math.ceil(shape[1] / (shards // ep)) * shape[2]
    return math.ceil(shape[0] / shards) * math.prod(shape[1:]) if len(shape) else 1


class Planner:
    """Plans of one model and mesh for any micro-batch and checkpointing setting."""

    def __init__(
        self,
        settings: MemorySettings,
        shape: MeshShape,
        model_config: LLaMAConfig,
        pipeline: Optional[PipelinePlan],
        device_bytes: int,
        pp_rank: int = 0,
    ):
        """`pipeline`: the run's plan of stages (run.pipeline), None without pipeline parallelism."""
        self.settings, self.device_bytes, self.mesh = settings, device_bytes, shape
        self.world_size = shape.dp * shape.tp * shape.cp * shape.pp
        model = build_model(model_config, torch.device("meta"))
        self.lora, self.pipeline = settings.lora, pipeline
        if self.lora is not None:
            add_adapters(model, self.lora)
        if self.pipeline is not None:  # pipeline rank `pp_rank`'s stages only
            prune(model, self.pipeline, pp_rank)
        self.pp_rank, self.first, self.last = pp_rank, model.base_model.embedding is not None, model.head is not None
        self.n_blocks, self.emb_dim = len(blocks_of(model)), model_config.emb_dim
        # each parameter's part on this rank's tensor-parallel group and expert group (a 1/ep of the experts)
        tp = {name: _ep_shape(_tp_shape(name, p.shape, shape.tp), shape.ep) for name, p in model.named_parameters()}
        sharded = {n: _numel_sharded(tp[n], shape.shard * shape.cp, shape.ep) for n in tp}  # FSDP: shard x cp
        held, trained = sum(sharded.values()), sum(sharded[n] for n, p in model.named_parameters() if p.requires_grad)
        # the keys and values of a whole line (context parallel all-gathers them), per token
        heads = model_config.kvheads or model_config.nheads
        self.kv_width = 2 * heads * (model_config.emb_dim // model_config.nheads)
        first_block = next(n for n in tp if n.startswith("base_model.layers.")).split(".")[2]
        block = sum(math.prod(tp[n]) for n in tp if n.startswith(f"base_model.layers.{first_block}."))
        # the final norm and head: none off a pipeline's last stage
        head = sum(math.prod(tp[n]) for n in tp if n.startswith(("base_model.dec_norm.", "head.")))
        # --optimizer=muon keeps one buffer (its momentum) for the blocks' matrices, AdamW two for the rest
        matrices = [
            n for n, p in model.named_parameters() if p.requires_grad and p.dim() == 2 and ".layers." in f".{n}"
        ]
        muon = sum(sharded[n] for n in matrices if "lora_" not in n) if settings.muon else 0
        self.compute = 2 if settings.mixed_precision else 4
        # documents masked by FlexAttention's BlockMask: no seq^2 mask (a plan is for a GPU unless --device=cpu)
        self._flex = flex_documents(settings.compile, "cpu" if settings.device == "cpu" else "cuda")
        self.average = 4 * trained * (settings.ema and not settings.ema_on_host)  # --ema_decay's, on the device
        adamw = int(2 * 4 * state_share(settings.optimizer_state_dtype) * (trained - muon))
        self.params, self.grads, self.optimizer = 4 * held, 4 * trained, adamw + 4 * muon + self.average
        # the block in use, the one prefetched, the last block and the head kept gathered, and one
        # block's unsharded gradients; none on one rank, which has no FSDP
        self.gathered = 0 if shape.whole else self.compute * (4 * block + head)
        if self.pipeline is not None and not shape.whole:
            # torch's stages keep their FSDP units whole from a step's first microbatch to its last (then
            # resharded and reduce-scattered): this rank's weights in the compute dtype, fp32 gradients
            whole = sum(math.prod(shape_) for shape_ in tp.values())
            trained_whole = sum(math.prod(tp[n]) for n, p in model.named_parameters() if p.requires_grad)
            self.gathered = self.compute * whole + 4 * trained_whole
        self.shape = Shape(
            settings.variant,
            settings.vocab_size,
            settings.seq_length,
            settings.mixed_precision,
            settings.device != "cpu",
            self.lora,
            shape.whole and settings.mixed_precision,
        )

    @property
    def state(self) -> State:
        return State(self.params, self.grads, self.optimizer)

    def adopt(self, state: State) -> None:
        """Plan with `state` (the rehearsal's real shards) in place of the analytic figures."""
        self.params, self.grads, self.optimizer = state.params, state.grads, state.optimizer + self.average

    def plan(self, setting: Setting, offload: Optional[bool] = None) -> Plan:
        """The plan at `setting`, with --cpu_offload as the run has it unless `offload` says otherwise."""
        chosen = sum(checkpointed_blocks(self.n_blocks, setting.fraction)) if setting.checkpointing else 0
        traced = (setting.mode,) if chosen and setting.mode != "offload" else ()  # offloaded blocks keep nothing
        acts = trace_activations(self.shape, traced)  # only the traces it needs
        in_flight, step = 1.0, setting
        if self.pipeline is not None:  # one microbatch's activations, times those the schedule keeps
            step = replace(setting, batch=-(-setting.batch // self.pipeline.microbatches))
            in_flight = microbatches_in_flight(self.pipeline, self.pp_rank)
        per_block = {mode: Activations.at(line, step.batch) for mode, line in acts.per_block.items()}
        activations = (
            (Activations.at(acts.outside, step.batch) if self.first or self.last else 0)
            + chosen * per_block.get(setting.mode, 0)
            + (self.n_blocks - chosen) * per_block["none"]
        )
        # the loss's saved gradients: one set per microbatch in flight on the last stage
        saved = int(Activations.at(acts.loss_saved, step.batch) * in_flight) if self.last else 0
        loss = (saved + Activations.at(acts.loss_transient, step.batch)) if self.last else 0
        if self.mesh.tp > 1:  # estimated from the traces, not traced: see _tensor_parallel
            activations, saved, loss = self._tensor_parallel(step, chosen, activations, saved, loss)
        if self.mesh.cp > 1:  # likewise: see _context_parallel
            activations, saved, loss = self._context_parallel(step, chosen, activations, saved, loss)
        elif self.settings.document_masking and not self._flex:
            activations += step.batch * self.settings.seq_length**2  # SDPA's boolean mask of the documents
        activations = int(activations * in_flight)
        recompute = per_block["none"] if chosen else 0  # one block's, recomputed or brought back from the host
        # --cpu_offload keeps the state on the host: the device holds what is gathered and computed
        offload = self.settings.cpu_offload if offload is None else offload
        state, grads = (0, 0) if offload else (self.params + self.optimizer, self.grads)
        peak = state + self.gathered + max(activations + loss, grads) + recompute
        if self.settings.optimizer_state_dtype != "fp32":  # a save: the 8-bit states' fp32 copy, 2 x 4 bytes
            peak = max(peak, state + 2 * self.grads)  # a trained parameter, beside no gradient or activation
        host = int(chosen * per_block["none"] * in_flight) if setting.mode == "offload" else 0
        return Plan(
            self.params,
            self.grads,
            self.optimizer,
            self.gathered,
            activations,
            loss,
            peak,
            self.device_bytes,
            saved,
            host,
        )

    def _tensor_parallel(
        self, setting: Setting, chosen: int, activations: int, saved: int, loss: int
    ) -> tuple[int, int, int]:
        """A rank of a tensor-parallel group of T keeps 1/T of what the unsplit model saves (its heads,
        its FFN width, its part of the sequence), plus the whole-sequence inputs of attention and the
        FFN that a block not checkpointed whole keeps for its matmuls' backward (2 x tokens x width),
        and in the loss the whole hidden states' gradient (tokens x width)."""
        tp, tokens = self.mesh.tp, setting.batch * self.settings.seq_length
        gathered = int(2 * tokens * self.emb_dim * self.compute * (1 - 1 / tp))
        whole = self.n_blocks - chosen if setting.mode == "block" else self.n_blocks
        hidden_grad = int(tokens * self.emb_dim * self.compute * (1 - 1 / tp)) if self.last else 0
        return activations // tp + whole * gathered, saved // tp + hidden_grad, loss // tp + hidden_grad

    def _context_parallel(
        self, setting: Setting, chosen: int, activations: int, saved: int, loss: int
    ) -> tuple[int, int, int]:
        """A rank of a context-parallel group of C keeps 1/C of what the unsplit line saves (its tokens),
        plus, in every block not checkpointed whole, the whole line's keys and values (all-gathered for
        attention and kept for its backward; the CPU's unmasked path gathers them again instead, and
        --cp_attention=ring passes them round the ranks and keeps none), and
        under SDPA's --document_masking the boolean mask of its queries against the line (batch x seq /
        C x seq bytes, one for all blocks)."""
        cp, tokens = self.mesh.cp, setting.batch * self.settings.seq_length
        keys_values = tokens * self.kv_width * self.compute // self.mesh.tp
        if self.settings.cp_attention == "ring" or (
            self.settings.device == "cpu" and not self.settings.document_masking
        ):
            keys_values = 0
        kept = self.n_blocks - chosen if setting.mode == "block" else self.n_blocks
        mask = tokens * self.settings.seq_length // cp if self.settings.document_masking and not self._flex else 0
        return activations // cp + kept * keys_values + mask, saved // cp, loss // cp

    def largest_batch(self, setting: Setting) -> int:
        """The largest micro-batch that fits with this checkpointing (0: not even one)."""
        lo, hi = 0, 1
        while hi <= 1 << 16 and self.plan(replace(setting, batch=hi)).fits:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            fits = self.plan(replace(setting, batch=mid)).fits
            lo, hi = (mid, hi) if fits else (lo, mid)
        return lo

    def least_checkpointing(self, batch: int) -> Optional[Setting]:
        """The cheapest checkpointing, in recomputation, that fits this micro-batch (None: none does)."""
        candidates = [Setting(batch=batch, checkpointing=False, fraction=Fraction(0), mode="block")]
        candidates += [
            Setting(batch=batch, checkpointing=True, fraction=f, mode="op") for f in (Fraction(1, 2), Fraction(1))
        ]
        candidates += [
            Setting(batch=batch, checkpointing=True, fraction=Fraction(k, 4), mode="block") for k in range(1, 5)
        ]
        return next((s for s in candidates if self.plan(s).fits), None)


def device_memory(settings: MemorySettings, local_world_size: int) -> tuple[int, str]:
    """(bytes, what they are) of one rank's device: --plan_device_memory_gib, else the visible GPU,
    else this machine's memory shared by its ranks."""
    if settings.device_gib is not None:
        return int(settings.device_gib * GIB), "--plan_device_memory_gib"
    if torch.cuda.is_available() and settings.device != "cpu":
        props = torch.cuda.get_device_properties(0)
        return props.total_memory, props.name
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total // local_world_size, f"this machine's memory / {local_world_size} ranks"
