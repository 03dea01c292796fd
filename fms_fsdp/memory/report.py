"""The memory plan's report (--dry_run's table, suggestions and PLAN line) and the start-up warning
when a run's plan does not fit its device."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import NamedTuple, Optional, Sequence

from fms.models.llama import LLaMAConfig

from fms_fsdp.memory.plan import AGREEMENT, GIB, HEADROOM, Plan, Planner, State, device_memory
from fms_fsdp.memory.settings import MemorySettings, Setting, state_share
from fms_fsdp.parallel.activation_checkpointing import checkpointed_blocks
from fms_fsdp.parallel.pipeline import PipelinePlan, microbatches_in_flight
from fms_fsdp.parallel.settings import MeshShape


def _gathered_row(planner: Planner, compute: str) -> str:
    """The report's row of what FSDP holds whole."""
    if planner.pipeline is not None:
        return f"stages' weights ({compute}) and fp32 gradients whole between microbatches"
    return f"blocks gathered in flight ({compute}, prefetch included)"


def _gib(n: int) -> str:
    return f"{n / GIB:9.2f} GiB"


class PlanReport(NamedTuple):
    """--dry_run's printout (its last line the PLAN line) and whether the plan fits."""

    text: str
    fits: bool


def report(
    settings: MemorySettings,
    shape: MeshShape,
    model_config: LLaMAConfig,
    pipeline: Optional[PipelinePlan],
    local_world_size: int,
    states: Optional[Sequence[State]] = None,
) -> PlanReport:
    """The plan of the run `settings` describe (on a mesh of `shape`), as printed by --dry_run: a table,
    suggestions, the PLAN line. `states`: each pipeline rank's parameters, gradients and optimizer state
    as its real shards hold them (the rehearsal), planned with in place of the analytic figures, which
    they are checked against."""
    device_bytes, device_name = device_memory(settings, local_world_size)
    setting = settings.setting
    planners = [Planner(settings, shape, model_config, pipeline, device_bytes, r) for r in range(shape.pp)]
    checks = [] if states is None else _cross_check(planners, states)
    peaks = [p.plan(setting).peak for p in planners]
    planner = planners[peaks.index(max(peaks))]  # the pipeline rank with the highest peak (or the one rank)
    plan = planner.plan(setting)
    lines = _report_header(planner, setting, peaks)
    lines += _report_table(planner, plan, device_name)
    lines += checks
    lines += _report_suggestions(planner, plan, setting)
    lines.append(plan.line())
    return PlanReport(text="\n".join(lines), fits=plan.fits)


def _cross_check(planners: list[Planner], states: Sequence[State]) -> list[str]:
    """Plan every pipeline rank with its real shards' state; the report's line on how far the analytic
    figures are from them, and a warning for each rank where they are more than AGREEMENT apart."""
    gaps = [planner.state.gap(state) for planner, state in zip(planners, states)]
    lines = [
        f"  (parameters, gradients and optimizer state: the rehearsal's real shards; the analytic plan "
        f"within {max(gaps):.2%} of them)"
    ]
    for planner, state, gap in zip(planners, states, gaps):
        if gap > AGREEMENT:
            analytic = planner.state
            lines.append(
                f"warning: pipeline rank {planner.pp_rank}'s real shards hold {state.params}, {state.grads} and "
                f"{state.optimizer} bytes of parameters, gradients and optimizer state; the analytic plan "
                f"{analytic.params}, {analytic.grads} and {analytic.optimizer} ({gap:.1%} apart): the plan "
                "uses the real ones; please report this"
            )
        planner.adopt(state)
    return lines


def _report_header(planner: Planner, setting: Setting, peaks: list[int]) -> list[str]:
    """The report's first line (model, mesh, micro-batch, precision, checkpointing) and, under pipeline
    parallelism, the rank planned (the highest peak) and every rank's peak."""
    settings = planner.settings
    compute = "bf16" if settings.mixed_precision else "fp32"
    chosen = sum(checkpointed_blocks(planner.n_blocks, setting.fraction)) if setting.checkpointing else 0
    dims = planner.mesh.dims()
    lines = [
        f"memory plan, per rank: {settings.variant} on {planner.world_size} ranks, mesh "
        f"({', '.join(name for name, _ in dims)}) = {tuple(size for _, size in dims)}, "
        f"micro-batch {setting.batch} x {settings.seq_length} tokens, "
        f"{compute}, activation checkpointing: "
        + (f"{chosen}/{planner.n_blocks} blocks, {setting.mode}" if chosen else "off")
    ]
    if planner.pipeline is not None:
        stages = planner.pipeline.stages_of(planner.pp_rank)
        blocks = [i for s in stages for i in range(*planner.pipeline.blocks[s])]
        lines.append(
            f"  pipeline rank {planner.pp_rank} of {planner.mesh.pp} has the highest peak: stages "
            f"{', '.join(map(str, stages))} ({len(blocks)} blocks), {microbatches_in_flight(planner.pipeline, planner.pp_rank):g} "
            f"of {planner.pipeline.microbatches} microbatches of {-(-setting.batch // planner.pipeline.microbatches)} "
            f"lines in flight; every rank's peak: " + ", ".join(f"{_gib(p).strip()}" for p in peaks)
        )
    return lines


def _report_table(planner: Planner, plan: Plan, device_name: str) -> list[str]:
    """The report's table of bytes by kind, its notes on what is estimated, and whether the peak fits."""
    settings = planner.settings
    compute = "bf16" if settings.mixed_precision else "fp32"
    whole = planner.mesh.whole
    copies = ", bf16 weight copies included" if planner.shape.autocast else ""
    host = " on the host" if settings.cpu_offload else ""  # not in the device's peak
    rows = [
        ("parameters (fp32)" if whole else f"parameters (fp32 master shards){host}", plan.params),
        ("gradients (fp32)" if whole else f"gradients (fp32 shards){host}", plan.grads),
        (
            (
                "optimizer state (Muon 1 x fp32, AdamW 2 x fp32)"
                if settings.muon
                else f"optimizer state (AdamW, 2 x {settings.optimizer_state_dtype})"
            )
            + host,
            plan.optimizer,
        ),
        *([] if whole else [(_gathered_row(planner, compute), plan.gathered)]),
        (f"activations saved for backward{copies}", plan.activations),
        *([("activations offloaded to the host (not on the device)", plan.host)] if plan.host else []),
        ("loss working set", plan.loss),
        ("predicted peak", plan.peak),
        (f"device ({device_name})", plan.device),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"  {name:<{width}}  {_gib(value)}" for name, value in rows]
    if planner.mesh.tp > 1 or planner.mesh.cp > 1:
        lines.append("  (tensor or context parallel: activations and loss estimated from the unsplit model's traces)")
    if whole:
        lines.append(
            f"  (one rank: the module itself, no FSDP{', bf16 through autocast' if settings.mixed_precision else ''})"
        )
    verdict = "fits" if plan.fits else "does NOT fit"
    lines.append(
        f"  {verdict}: the peak is {plan.peak / plan.device:.0%} of the device (plans keep within {HEADROOM:.0%})"
    )
    return lines


def _report_suggestions(planner: Planner, plan: Plan, setting: Setting) -> list[str]:
    """The report's suggestions: the largest micro-batch that fits with this checkpointing, and the least
    checkpointing that fits --batch_size (else a smaller batch, or how many ranks the state needs)."""
    largest = planner.largest_batch(setting)
    state = plan.params + plan.grads + plan.optimizer  # divided among the ranks sharing the model
    room = HEADROOM * plan.device - plan.gathered
    state_alone = state >= room  # no micro-batch fits, however small
    sharing = planner.mesh.shard * planner.mesh.tp * planner.mesh.cp
    need = f"at least {math.ceil(sharing * state / room)} " if room > 0 else ""
    more_ranks = (
        f"none: the model's state alone takes {_gib(state).strip()} per rank; shard it over {need}ranks "
        "(--sharding_strategy=fsdp, a larger --sharding_group_size, or --tensor_parallel_size)"
    )
    least = planner.least_checkpointing(setting.batch)
    return [
        *_offload_suggestion(planner, plan, setting),
        *_low_bit_states_suggestion(planner, plan),
        "largest micro-batch that fits with this checkpointing: " + (f"--batch_size={largest}" if largest else "none"),
        f"least checkpointing that fits --batch_size={setting.batch}: "
        + (
            least.flags().split(" ", 1)[1]
            if least
            else "none does: lower --batch_size"
            if setting.batch > 1 and not state_alone
            else more_ranks
        ),
        *_activation_offload_suggestion(planner, least),
    ]


def _activation_offload_suggestion(planner: Planner, least: Optional[Setting]) -> list[str]:
    """Where whole blocks must be recomputed to fit: the same blocks offloaded instead, if that fits, with
    the host memory it takes."""
    if least is None or not least.checkpointing or least.mode != "block":
        return []
    offloaded = replace(least, mode="offload")
    plan = planner.plan(offloaded)
    if not plan.fits:
        return []
    return [
        f"or, recomputing nothing: {offloaded.flags().split(' ', 1)[1]} (the activations to the host and back: "
        f"{_gib(plan.host).strip()} of host memory per rank)"
    ]


def _low_bit_states_suggestion(planner: Planner, plan: Plan) -> list[str]:
    """Where the plan does not fit with fp32 AdamW states on the device: its peak with torchao's 8-bit ones."""
    settings = planner.settings
    if (
        plan.fits
        or settings.optimizer_state_dtype != "fp32"
        or settings.muon
        or settings.cpu_offload
        or settings.skip_bad_steps
    ):
        return []
    peak = plan.peak - int((plan.optimizer - planner.average) * (1 - state_share("int8")))
    verdict = "fits" if peak <= HEADROOM * plan.device else "still does not fit"
    return [
        f"with --optimizer_state_dtype=int8 (torchao's 8-bit AdamW states) the peak is {_gib(peak).strip()}: {verdict}"
    ]


def _offload_suggestion(planner: Planner, plan: Plan, setting: Setting) -> list[str]:
    """Where the plan does not fit and FSDP could offload: the device's peak with --cpu_offload, whose
    state stays on the host (the gathered blocks, activations and loss remain)."""
    if plan.fits or planner.settings.cpu_offload or planner.mesh.whole:
        return []
    offloaded = planner.plan(setting, offload=True)
    verdict = "fits" if offloaded.fits else "still does not fit"
    return [
        "with --cpu_offload=True (the state on the host, slower steps) the device's peak is "
        f"{_gib(offloaded.peak).strip()}: {verdict}"
    ]


def fits_or_warning(
    settings: MemorySettings,
    shape: MeshShape,
    model_config: LLaMAConfig,
    pipeline: Optional[PipelinePlan],
    local_world_size: int,
) -> Optional[str]:
    """None when the run's plan fits its device, else the start-up warning."""
    device_bytes, device_name = device_memory(settings, local_world_size)
    plans = [
        Planner(settings, shape, model_config, pipeline, device_bytes, r).plan(settings.setting)
        for r in range(shape.pp)
    ]
    plan = max(plans, key=lambda p: p.peak)
    if plan.fits:
        return None
    return (
        f"warning: the memory plan predicts a peak of {plan.peak / GIB:.1f} GiB per rank, more than "
        f"{HEADROOM:.0%} of {device_name}'s {device_bytes / GIB:.1f} GiB: this run will likely run out of "
        "memory; `python main_training.py --dry_run=True <these flags>` shows the plan and what fits"
    )
