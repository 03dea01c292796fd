"""Pipeline parallelism (--pipeline_parallel_size=P): the model's blocks split into stages over the
mesh's outermost dimension 'pp' (across nodes), run by torch.distributed.pipelining's schedules.

A rank holds the stages its schedule gives it: one for GPipe and 1F1B; --pipeline_stages_per_rank
(default 2) for Interleaved1F1B and InterleavedZeroBubble, looped (rank r: stages r, r + P, ...), and
exactly 2 for ZBVZeroBubble and DualPipeV, V-shaped (rank r: stages r and 2P-1-r). Its model is the
whole model's CausalLM pruned to those stages' modules under their own names (`base_model.layers.<i>`
as in the whole model, the embedding only with the first stage, the final norm and head only with the
last), so the optimizer, clipping and checkpoints see one module named as the whole model is: a
checkpoint saved at any P resumes at any other. Each stage is a `StagePart` over that model's modules:
the module the schedule runs and FSDP2 roots (parallelize.py). Microbatches are the gradient
accumulation: the step's --batch_size lines are cut into --pipeline_microbatches, each microbatch's
loss is its mean and the schedule averages the gradients over them, as --grad_accum_steps does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generator, Optional

import torch
import torch.distributed as dist
from fms.models.llama import LLaMAConfig
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

from fms_fsdp.compat import v_shaped_schedules_run
from fms_fsdp.errors import ConfigError
from fms_fsdp.model.loss import IGNORE_INDEX
from fms_fsdp.model.shapes import hidden_dim
from fms_fsdp.model.variants import CausalLM
from fms_fsdp.parallel.settings import PipelineSettings

V_SHAPED = ("ZBVZeroBubble", "DualPipeV")  # rank r holds stages r and 2P-1-r
# schedules that run a stage's backward twice: its inputs' gradients first, its weights' later
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


@dataclass(frozen=True)
class PipelinePlan:
    """The pipeline of a run: P ranks, the schedule, the stages each rank holds, the microbatches of
    a step and the blocks [start, stop) of every stage."""

    size: int
    schedule: str
    stages_per_rank: int
    microbatches: int
    blocks: tuple[tuple[int, int], ...]

    @staticmethod
    def of(settings: PipelineSettings, model_config: LLaMAConfig) -> Optional["PipelinePlan"]:
        """The run's plan (None without pipeline parallelism); ConfigError naming the flag and the
        numbers when the schedule, stages, split or microbatches cannot work."""
        size = settings.size
        if size == 1:
            return None
        multi = issubclass(get_schedule_class(settings.schedule), PipelineScheduleMulti)
        per_rank = _stages_per_rank(settings, multi)
        stages, n_blocks = size * per_rank, model_config.nlayers
        if stages > n_blocks:
            raise ConfigError(_too_many_stages(settings, per_rank, n_blocks))
        blocks = _explicit_split(settings.split, stages, n_blocks) if settings.split else None
        if blocks is None:
            blocks = balanced_split(model_config, stages)
        microbatches = _microbatches(settings, stages)
        return PipelinePlan(size, settings.schedule, per_rank, microbatches, blocks)

    @property
    def stages(self) -> int:
        return self.size * self.stages_per_rank

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stages rank `pp_rank` of the pipeline holds, in the order the schedule takes them."""
        if self.schedule in V_SHAPED:
            return [pp_rank, 2 * self.size - 1 - pp_rank]
        return [pp_rank + k * self.size for k in range(self.stages_per_rank)]

    def describe(self) -> str:
        """The start-up line: schedule, microbatches and each stage's blocks."""
        split = ", ".join(f"{stop - start}" for start, stop in self.blocks)
        return (
            f"pipeline: {self.schedule}, {self.stages} stages over {self.size} ranks, "
            f"{self.microbatches} microbatches per step, blocks per stage {split}"
        )


def microbatches_in_flight(plan: PipelinePlan, pp_rank: int) -> float:
    """How many microbatches' activations of all its blocks rank `pp_rank` holds at its peak (the
    memory plan's factor): GPipe all of them; 1F1B the P - r its warm-up starts; the interleaved
    schedules Megatron's warm-up count of stage-microbatches, 2 (P - r - 1) + (v - 1) P + 1, over
    its v stages; the V-shaped ones about one per pipeline rank."""
    m, size, v = plan.microbatches, plan.size, plan.stages_per_rank
    if plan.schedule == "GPipe":
        return float(m)
    if plan.schedule == "1F1B":
        return float(min(m, size - pp_rank))
    if plan.schedule in V_SHAPED:
        return float(min(m, size))
    return min(v * m, 2 * (size - pp_rank - 1) + (v - 1) * size + 1) / v


def _stages_per_rank(settings: PipelineSettings, multi: bool) -> int:
    """--pipeline_stages_per_rank, or the schedule's default: 1 for a single-stage schedule, 2 else."""
    asked, name = settings.stages_per_rank, settings.schedule
    if not multi:
        if asked not in (0, 1):
            raise ConfigError(
                f"--pipeline_schedule={name} runs one stage per rank: --pipeline_stages_per_rank={asked} needs "
                "Interleaved1F1B or InterleavedZeroBubble"
            )
        return 1
    if name in V_SHAPED and asked not in (0, 2):
        raise ConfigError(
            f"--pipeline_schedule={name} runs exactly 2 stages per rank, not --pipeline_stages_per_rank={asked}"
        )
    if name in V_SHAPED and not v_shaped_schedules_run():
        raise ConfigError(
            f"--pipeline_schedule={name} needs torch 2.13 or later (torch {torch.__version__} does not run it); "
            "use InterleavedZeroBubble or Interleaved1F1B, or upgrade torch"
        )
    return asked or 2


def _too_many_stages(settings: PipelineSettings, per_rank: int, n_blocks: int) -> str:
    """The message for more stages than blocks: where the stages per rank came from, and what to change."""
    size, name = settings.size, settings.schedule
    one_stage = "a one-stage schedule (--pipeline_schedule=1F1B or GPipe)"
    if name in V_SHAPED:
        why, change = f"(--pipeline_schedule={name} runs 2)", f"use {one_stage} or lower --pipeline_parallel_size"
    elif settings.stages_per_rank == 0 and per_rank > 1:
        why = f"(the default of --pipeline_schedule={name})"
        change = f"set --pipeline_stages_per_rank=1, use {one_stage}, or lower --pipeline_parallel_size"
    else:
        why, change = "", "lower --pipeline_stages_per_rank or --pipeline_parallel_size"
    return (
        f"--pipeline_parallel_size={size} x {per_rank} stage(s) per rank{' ' + why if why else ''} = "
        f"{size * per_rank} stages, more than {settings.variant}'s {n_blocks} blocks: every stage needs a "
        f"block; {change}"
    )


def _explicit_split(text: str, stages: int, n_blocks: int) -> tuple[tuple[int, int], ...]:
    """--pipeline_split=a,b,...: the blocks of each stage, in order."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError(
            f"--pipeline_split={text}: give the blocks of each stage as integers, such as 3,5,5,3"
        ) from None
    if len(counts) != stages or sum(counts) != n_blocks or min(counts) < 1:
        raise ConfigError(
            f"--pipeline_split={text}: needs {stages} counts of at least 1 block (one per stage) adding up to "
            f"the model's {n_blocks} blocks"
        )
    bounds = [sum(counts[:i]) for i in range(stages + 1)]
    return tuple(zip(bounds[:-1], bounds[1:]))


def balanced_split(model_config: LLaMAConfig, stages: int) -> tuple[tuple[int, int], ...]:
    """Consecutive blocks per stage, every stage at least one, the largest stage's cost the least it
    can be: a block costs its parameters, the first stage also the embedding's and the last stage the
    final norm's and head's (the head's matmul and loss run there)."""
    emb, n = model_config.emb_dim, model_config.nlayers
    kv = (model_config.kvheads or model_config.nheads) * (emb // model_config.nheads)
    block = 2 * emb * emb + 2 * emb * kv + 3 * emb * hidden_dim(model_config)
    vocab = model_config.src_vocab_size * emb
    # best[s][i]: the least largest cost of the first i blocks cut into s stages (the first stage's with
    # the embedding; the head's added where the last stage closes at i = n)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                stage = (i - j) * block + (vocab if j == 0 else 0) + (vocab if i == n else 0)
                value = max(best[s - 1][j], stage)
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    bounds, i = [n], n
    for s in range(stages, 0, -1):
        i = cut[s][i]
        bounds.append(i)
    bounds.reverse()
    return tuple(zip(bounds[:-1], bounds[1:]))


def _microbatches(settings: PipelineSettings, stages: int) -> int:
    """--pipeline_microbatches, or the fewest that divide --batch_size and are at least the stages
    (fewer leave the pipeline mostly idle); ConfigError when they do not divide the batch or are fewer
    than the schedule runs with."""
    m, batch, name = settings.microbatches, settings.batch_size, settings.schedule
    size = settings.size
    looped = name in ("Interleaved1F1B", "InterleavedZeroBubble")  # whose rounds, m // P, must divide m
    if m == 0:
        fits = [d for d in range(1, batch + 1) if batch % d == 0 and (not looped or d % max(1, d // size) == 0)]
        m = next((d for d in fits if d >= stages), fits[-1])
    if batch % m:
        raise ConfigError(f"--pipeline_microbatches={m} must divide --batch_size={batch} (lines per step per pipeline)")
    if name in ("1F1B", "DualPipeV") and m < stages:
        raise ConfigError(
            f"--pipeline_schedule={name} needs at least as many microbatches as stages ({stages}), not {m}: raise "
            "--batch_size (and --pipeline_microbatches) or use GPipe"
        )
    rounds = max(1, m // size)
    if looped and m % rounds:
        raise ConfigError(
            f"--pipeline_schedule={name} needs --pipeline_microbatches a multiple of its rounds "
            f"({m} // {size} ranks = {rounds}), not {m}: use a multiple of {size}"
        )
    return m


def check_pipeline(settings: PipelineSettings, model_config: LLaMAConfig) -> None:
    """Settings pipeline parallelism does not combine with yet (ConfigError, one line)."""
    if settings.size == 1:
        return
    for flag, used, change in (
        (
            "--grad_accum_steps > 1",
            settings.grad_accum_steps > 1,
            "its microbatches are the accumulation: raise --pipeline_microbatches",
        ),
        (
            "--eval_harness_tasks",
            settings.harness,
            "score its checkpoints with fms-evaluate --eval_harness_tasks, without --pipeline_parallel_size",
        ),
        (
            "an --eval_batch_size other than --batch_size",
            settings.eval_batch_size not in (None, settings.batch_size),
            "the stages take microbatches of one shape: leave --eval_batch_size out",
        ),
        (
            "a head tied to the embedding",
            model_config.tie_heads,
            "the first and last stages would share it: use an untied variant",
        ),
    ):
        if used:
            raise ConfigError(f"--pipeline_parallel_size={settings.size} does not combine with {flag} yet: {change}")
    if settings.evaluates and settings.schedule in V_SHAPED:
        raise ConfigError(
            f"--eval_interval does not run under --pipeline_schedule={settings.schedule} yet (torch's V-shaped "
            "schedules cannot run forward only): use InterleavedZeroBubble or Interleaved1F1B for a run that evaluates"
        )


def prune(model: CausalLM, plan: PipelinePlan, pp_rank: int) -> None:
    """Keep in `model` only the modules of rank `pp_rank`'s stages, under their whole-model names."""
    stages = plan.stages_of(pp_rank)
    kept = [i for s in stages for i in range(*plan.blocks[s])]
    base = model.base_model
    base.layers = nn.ModuleDict({str(i): base.layers[i] for i in sorted(kept)})
    if 0 not in stages:
        base.embedding = None
    if plan.stages - 1 not in stages:  # parallelize.py and the stages check for a missing head
        base.dec_norm = None
        model.head = None  # type: ignore[assignment]


class StagePart(nn.Module):
    """One stage over the rank's pruned model: the first embeds the line's tokens, every stage runs
    its blocks, the last applies the final norm and returns the loss of the microbatch (its labels,
    like its tokens, reach every stage: attention's masks and positions come from the tokens)."""

    def __init__(self, model: CausalLM, blocks: tuple[int, int], first: bool, last: bool):
        super().__init__()
        base = model.base_model
        self.embedding = base.embedding if first else None
        self.blocks = nn.ModuleList([base.layers[str(i)] for i in range(*blocks)])
        self.dec_norm = base.dec_norm if last else None
        self.head = model.head if last else None
        self._model = [model]  # not a child: the model's modules are this stage's and the others'
        self.z_losses: list[torch.Tensor] = []  # the last stage's z-loss terms, one per microbatch

    def forward(self, *received: torch.Tensor, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The first stage takes no positional input (torch 2.11's schedules would hand later stages the
        step's positional inputs too); a later one the hidden states received from the stage before."""
        model = self._model[0]
        x, labels, kwargs = model.prepare(tokens, labels)
        h = self.embedding(x) if self.embedding is not None else received[0]
        for block in self.blocks:
            h = block(x=h, **kwargs)
        if self.dec_norm is None or self.head is None:
            return h
        assert labels is not None
        loss = model.loss(self.dec_norm(h), labels)
        if self.head.z_loss is not None:
            self.z_losses.append(self.head.z_loss)
        return loss.reshape(1)  # the schedule concatenates the microbatches' outputs


class Pipeline:
    """The rank's stages (`parts`, which parallelize.py wraps) and the schedule that runs them (`start`,
    once they are wrapped); `step` trains one batch (and reports its z-loss term with `z_loss`)."""

    def __init__(
        self, plan: PipelinePlan, model: CausalLM, group: dist.ProcessGroup, device: torch.device, z_loss: bool
    ):
        self.plan, self.group, self.device, self.z_loss = plan, group, device, z_loss
        self.indices = plan.stages_of(dist.get_rank(group))
        last = plan.stages - 1
        self.parts = [StagePart(model, plan.blocks[s], s == 0, s == last) for s in self.indices]
        self.last = next((p for p, s in zip(self.parts, self.indices) if s == last), None)  # holding the loss
        if model.head is not None:
            model.head.backward_twice = plan.schedule in ZERO_BUBBLE
        self.schedule: Any = None
        # the schedule's first step first runs the stages on uninitialised tensors to learn their shapes
        self.routing = model.routing if model.routing is not None and model.routing.stats is not None else None

    def start(self) -> None:
        """Build the schedule over the stages."""
        stages = [
            PipelineStage(part, index, self.plan.stages, self.device, group=self.group)
            for part, index in zip(self.parts, self.indices)
        ]
        cls = get_schedule_class(self.plan.schedule)
        first = stages if issubclass(cls, PipelineScheduleMulti) else stages[0]
        self.schedule = cls(first, n_microbatches=self.plan.microbatches, loss_fn=_microbatch_loss)

    def reads_data(self, model: CausalLM) -> bool:
        """Whether this rank needs the lines: for the first stage's inputs, the last one's labels, or
        any stage's attention (the masks and positions of --document_masking or a context-parallel
        split come from the tokens). A rank of middle stages alone reads nothing."""
        ends = {0, self.plan.stages - 1}
        return model.lines is not None or any(s in ends for s in self.indices)

    @staticmethod
    def no_data(batch_size: int, seq_length: int) -> Generator[tuple[torch.Tensor, torch.Tensor], None, None]:
        """Batches of the lines' shape that a rank of middle stages passes on unread (the schedule cuts
        them into microbatches for every stage)."""
        zeros = torch.zeros(batch_size, seq_length, dtype=torch.long)
        while True:
            yield zeros, zeros

    def step(self, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Forward and backward of one batch through the pipeline, the gradients averaged over its
        microbatches; (its loss, its z-loss term or None without one) on every rank of the pipeline,
        on the device (one all-reduce over the pipeline, no host sync)."""
        losses: list[torch.Tensor] = []
        last = self.last
        if last is not None:
            last.z_losses.clear()
        inferring, self.routing = self.routing, None
        self.schedule.step(tokens=tokens, labels=labels, target=labels, losses=losses)
        if inferring is not None and inferring.stats is not None:  # a sparse model's routing figures of that
            inferring.stats.zero()  # first step: the shape inference's count nothing real
        out = torch.zeros(2, device=self.device)
        if last is not None:
            out[0] = torch.stack([loss.detach().float() for loss in losses]).mean()
            if last.z_losses:
                out[1] = torch.stack([z.float() for z in last.z_losses]).mean()
        dist.all_reduce(out, group=self.group)
        return out[0], out[1] if self.z_loss else None

    def evaluate(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss of a batch summed over its counted tokens (each microbatch's mean times its count),
        forward only, on every rank of the pipeline (fp64, on the device). The batch has the training's
        --batch_size lines."""
        losses: list[torch.Tensor] = []
        self.schedule.eval(tokens=tokens, labels=labels, target=labels, losses=losses)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.last is not None:
            for loss, part in zip(losses, labels.tensor_split(self.plan.microbatches)):
                total += loss.double().sum() * _counted(part)
        dist.all_reduce(total, group=self.group)
        return total


def _counted(labels: torch.Tensor) -> torch.Tensor:
    """The tokens the loss counts."""
    return (labels != IGNORE_INDEX).sum()


def _microbatch_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The last stage returns its microbatch's loss already (as a 1-element tensor)."""
    return output.sum()


def blocks_of(model: CausalLM) -> list[nn.Module]:
    """The model's blocks in order: all of them, or a pipeline rank's (`prune` keeps them in a
    ModuleDict under their whole-model numbers)."""
    layers = model.base_model.layers
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)
