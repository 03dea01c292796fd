"""The composition matrix: for every pair of the package's large features, either the runs that train
with both against a reference (another mesh, one rank, or the run without one of them where that is the
same computation), or the one line the start-up refuses the pair with. tests/test_composition.py holds
it to that: every pair is here, a refusal is what the start-up says (checked without a launch), and each
run named exists (it runs in its own tier). docs/configuration.md's table is generated from it
(scripts/gen_docs.py). A pair no run has tried together yet says so, in the table too.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

# each feature: what it is, and the flags that turn it on for a start-up check (planned on 4 ranks)
FEATURES: dict[str, tuple[str, tuple[str, ...]]] = {
    "PP": ("pipeline parallel", ("--pipeline_parallel_size=2",)),
    "CP": ("context parallel", ("--context_parallel_size=2",)),
    "TP": ("tensor parallel", ("--tensor_parallel_size=2",)),
    "HSDP": ("replicated shard groups", ("--sharding_strategy=hsdp", "--sharding_group_size=1")),
    "FT": ("fault tolerance", ("--fault_tolerance=True", "--ft_replica_groups=2", "--ft_lighthouse=localhost:1")),
    "LoRA": ("LoRA adapters", ("--lora_rank=4",)),
    "float8": ("float8 matmuls", ("--float8=True",)),
    "async": ("background checkpoints", ("--async_checkpoint=True",)),
    "eval": ("periodic evaluation", ("--eval_interval=2",)),
    "harness": ("lm-eval-harness tasks", ("--eval_harness_tasks=hellaswag",)),
    "exports": ("periodic exports", ("--export_interval=2",)),
    "MoE": ("mixture of experts", ("--model_variant=tiny_moe",)),
    "EP": ("expert parallel", ("--model_variant=tiny_moe", "--expert_parallel_size=2")),
    "EMA": ("weight average", ("--ema_decay=0.9",)),
    "int8": ("8-bit optimizer states", ("--optimizer_state_dtype=int8",)),
    "ramps": ("batch-size and line-length ramps", ("--batch_size_schedule=0:2,2:4",)),
    "det": ("deterministic mode", ("--deterministic=True",)),
    "offload": ("FSDP's state on the host", ("--cpu_offload=True",)),
    "act-offload": ("activations on the host", ("--fsdp_activation_checkpointing=True", "--ac_mode=offload")),
}


@dataclass(frozen=True)
class Pair:
    """Two features: the runs that train with both against a reference (`file.py::test[, run]`), or
    the start-up's refusal."""

    a: str
    b: str
    runs: tuple[str, ...] = ()
    refused: Optional[str] = None


M, F, H, HS = "test_meshes.py", "test_ft.py", "test_harness.py", "test_hf_sharded.py"
FT_TP = f"{F}::test_replica_groups_compose_with_the_features_inside_them, tensor parallel, async checkpoints, evaluation, exports"
FT_CP = (
    f"{F}::test_replica_groups_compose_with_the_features_inside_them, context parallel, float8, offloaded state and "
    "activations"
)
PIPELINE = f"{M}::test_pipeline_schedules_take_the_steps_of_one_rank"
TP_RESUME = f"{M}::test_a_checkpoint_resumes_at_another_tensor_parallel_size, tp2"
TOGETHER = "test_composition.py::test_features_run_together_train_and_evaluate_as_one_rank"
PP_CP = f"{TOGETHER}, pp2 x cp2 with LoRA, async checkpoints, evaluation"
LORA = f"{TOGETHER}, LoRA with 8-bit states and ramps on hsdp 2 x 2, async checkpoints, evaluation"
HARNESS = f"{H}::test_the_harness_scores_the_training_model_as_lm_eval_scores_its_export"
MOE_MESHES = "test_moe.py::test_a_sparse_model_trains_on_fsdp_hsdp_and_pipeline_meshes_as_on_one_rank"
FLOAT8 = "test_composition.py::test_float8_with_background_checkpoints_and_evaluation_trains_as_float8_alone"
EXPERTS_TOGETHER = (
    f"{TOGETHER}, experts spread over 2 of 4 ranks with 8-bit states and ramps, async checkpoints, evaluation"
)
EP_MESHES = "test_expert_parallel.py::test_two_expert_ranks_train_as_one_on_fsdp_hsdp_and_pipeline_meshes"
EMA_EXPORTS = "test_ema.py::test_two_ranks_average_their_shards_and_transformers_loads_the_export_with_our_logits"
H_MESHES = f"{H}::test_the_harness_scores_the_same_training_on_other_meshes_the_same"
H_SPARSE = f"{H}::test_the_harness_scores_a_sparse_model_the_same_with_its_experts_spread"
EP_EXPORTS = "test_hf_moe.py::test_periodic_hf_exports_of_a_sparse_run_on_two_ranks_load_in_transformers, ep 2"

PP_HSDP = f"{TOGETHER}, pp2 on hsdp 1 x 2 with 8-bit states and offloaded activations, evaluation"
CP_EXPORTS = f"{TOGETHER}, 8-bit states and ramps on cp2 x hsdp 1 x 2, exports"
TP_STATES = "test_optimizer_states.py::test_eight_bit_states_and_ramps_on_tensor_parallel_ranks_train_as_on_one"
HARNESS_STATES = f"{H}::test_the_harness_in_a_run_with_eight_bit_states_and_ramps_scores_its_model_as_its_export"

SPARSE_REFUSALS = [
    ("CP", "--context_parallel_size"),
    ("TP", "--tensor_parallel_size"),
    ("LoRA", "--lora_rank"),
    ("float8", "--float8"),
    ("FT", "--fault_tolerance"),
]

MATRIX: list[Pair] = [
    Pair("PP", "CP", (PP_CP,)),
    Pair("PP", "async", (PP_CP,)),
    Pair("CP", "async", (PP_CP,)),
    Pair("CP", "eval", (PP_CP,)),
    Pair("LoRA", "HSDP", (LORA,)),
    Pair("LoRA", "async", (LORA,)),
    Pair("LoRA", "eval", (LORA,)),
    Pair("PP", "TP", (f"{PIPELINE}, pp2_tp2",)),
    Pair(
        "PP",
        "eval",
        (
            f"{M}::test_evaluation_through_the_pipeline_equals_one_ranks, pp2_eval",
            f"{M}::test_evaluation_through_the_pipeline_equals_one_ranks, pp2_eval_zb",
        ),
    ),
    Pair("PP", "exports", (f"{M}::test_pipeline_checkpoints_resume_at_any_size_and_export_the_whole_model",)),
    Pair("PP", "FT", refused="--fault_tolerance does not run with --pipeline_parallel_size > 1 yet: drop one"),
    Pair(
        "PP",
        "harness",
        refused="--pipeline_parallel_size=2 does not combine with --eval_harness_tasks yet: score its checkpoints",
    ),
    Pair("CP", "TP", (f"{M}::test_context_parallel_takes_the_steps_of_one_rank, cp2_tp2",)),
    Pair("CP", "HSDP", (FT_CP,)),
    Pair("CP", "FT", (FT_CP,)),
    Pair("CP", "float8", (FT_CP,)),
    Pair("CP", "harness", (f"{H}::test_the_harness_scores_lines_split_over_context_parallel_ranks_the_same",)),
    Pair("CP", "exports", (f"{HS}::test_every_mesh_imports_its_slices_exactly_and_exports_them, cp",)),
    Pair(
        "TP", "HSDP", (f"{M}::test_fsdp_and_hsdp_with_tp_on_4_ranks_give_the_loss_of_the_same_global_batch, hsdp_tp2",)
    ),
    Pair("TP", "FT", (FT_TP,)),
    Pair("TP", "LoRA", refused="--tensor_parallel_size=2 does not combine with --lora_rank yet"),
    Pair("TP", "float8", refused="--tensor_parallel_size=2 does not combine with --float8 yet"),
    Pair("TP", "async", (TP_RESUME, FT_TP)),
    Pair("TP", "eval", (TP_RESUME, FT_TP)),
    Pair(
        "TP", "exports", (f"{M}::test_checkpoints_and_exports_keep_fms_fused_keys_at_any_tensor_parallel_size", FT_TP)
    ),
    Pair("HSDP", "FT", refused="--fault_tolerance replicates across groups"),
    Pair("HSDP", "float8", (FT_CP,)),
    Pair("HSDP", "async", (FT_TP,)),
    Pair("HSDP", "eval", (FT_TP,)),
    Pair("HSDP", "exports", (f"{M}::test_a_2_rank_checkpoint_resumes_on_4_ranks", FT_TP)),
    Pair("FT", "float8", (FT_CP,)),
    Pair("FT", "async", (FT_TP,)),
    Pair("FT", "eval", (FT_TP,)),
    Pair("FT", "exports", (FT_TP,)),
    Pair("LoRA", "float8", refused="--lora_rank with --float8 is not supported"),
    Pair("LoRA", "exports", (f"{HS}::test_every_mesh_imports_its_slices_exactly_and_exports_them, lora",)),
    Pair(
        "float8",
        "exports",
        ("test_float8.py::test_float8_checkpoints_resume_without_float8_and_the_reverse_and_export_the_same",),
    ),
    Pair("async", "eval", (TP_RESUME, FT_TP)),
    Pair(
        "async",
        "exports",
        ("test_checkpoint.py::test_async_checkpoints_and_exports_hold_the_state_of_their_step", FT_TP),
    ),
    Pair("eval", "exports", (TP_RESUME, FT_TP)),
    Pair("harness", "exports", (HARNESS,)),
    Pair("async", "harness", (HARNESS,)),
    Pair("eval", "harness", (HARNESS,)),
    Pair("float8", "async", (FLOAT8,)),
    Pair("float8", "eval", (FLOAT8,)),
    Pair("MoE", "PP", (MOE_MESHES,)),
    Pair("MoE", "HSDP", (MOE_MESHES,)),
    Pair(
        "MoE",
        "exports",
        ("test_hf_moe.py::test_periodic_hf_exports_of_a_sparse_run_on_two_ranks_load_in_transformers",),
    ),
    # a sparse model (MoE, and so EP) refuses these by the flag that turns them on
    *(
        Pair(sparse, feature, refused=f"{flag} does not combine with a mixture-of-experts model yet")
        for sparse in ("MoE", "EP")
        for feature, flag in SPARSE_REFUSALS
    ),
    Pair("async", "MoE", (EXPERTS_TOGETHER,)),
    Pair("eval", "MoE", (EXPERTS_TOGETHER,)),
    Pair("async", "EP", (EXPERTS_TOGETHER,)),
    Pair("eval", "EP", (EXPERTS_TOGETHER,)),
    Pair("EP", "MoE", ("test_expert_parallel.py::test_two_ranks_with_their_experts_spread_train_as_without",)),
    Pair("EP", "PP", (EP_MESHES,)),
    Pair("EP", "HSDP", (EP_MESHES,)),
    Pair("EP", "exports", (EP_EXPORTS,)),
    # the runs together also keep the weight average (--ema_decay), and compare its evaluation
    *(Pair("EMA", feature, (PP_CP,)) for feature in ("PP", "CP", "async", "eval")),
    *(Pair("EMA", feature, (LORA,)) for feature in ("LoRA", "HSDP")),
    *(Pair("EMA", feature, (EXPERTS_TOGETHER,)) for feature in ("MoE", "EP")),
    Pair("EMA", "exports", (EMA_EXPORTS,)),
    Pair("EMA", "FT", refused="--ema_decay with --fault_tolerance"),
    Pair("FT", "LoRA", refused="--fault_tolerance does not combine with --lora_rank yet"),
    Pair("FT", "harness", refused="--fault_tolerance does not combine with --eval_harness_tasks yet"),
    Pair("PP", "LoRA", (PP_CP,)),
    Pair("CP", "LoRA", (PP_CP,)),
    Pair("PP", "HSDP", (PP_HSDP,)),
    Pair("float8", "EMA", (FLOAT8,)),
    Pair("TP", "EMA", (TP_RESUME,)),
    Pair("TP", "harness", (f"{H_MESHES}, tp2",)),
    Pair("HSDP", "harness", (f"{H_MESHES}, hsdp 1 x 2 with the weight average",)),
    Pair("harness", "EMA", (f"{H_MESHES}, hsdp 1 x 2 with the weight average",)),
    Pair("LoRA", "harness", (f"{H}::test_the_harness_scores_a_model_through_its_lora_adapters",)),
    Pair("float8", "harness", (f"{H}::test_fms_evaluate_scores_a_float8_run_as_its_loop_did",)),
    Pair("harness", "MoE", (H_SPARSE,)),
    Pair("harness", "EP", (H_SPARSE,)),
    Pair(
        "PP",
        "float8",
        ("test_composition.py::test_float8_through_a_pipeline_trains_as_one_rank_accumulating_its_microbatches",),
    ),
]


# --optimizer_state_dtype=int8 (torchao's 8-bit AdamW) and --batch_size_schedule with --seq_length_schedule:
# the runs above that keep 8-bit states and ramp, each against one rank's (the ramp of the same global
# batch; 8-bit states quantized in blocks of 256 that fall alike on the shards here)
MATRIX += [
    *(Pair(new, "LoRA", (LORA,)) for new in ("int8", "ramps")),
    *(Pair("ramps", feature, (LORA,)) for feature in ("HSDP", "async", "eval", "EMA")),
    # LoRA's adapters are too small to be quantized: the runs that quantize whole weights stand for int8
    Pair("int8", "HSDP", (CP_EXPORTS, PP_HSDP)),
    Pair("int8", "async", (EXPERTS_TOGETHER,)),
    *(Pair("int8", feature, (CP_EXPORTS,)) for feature in ("eval", "EMA")),
    *(Pair(new, feature, (CP_EXPORTS,)) for new in ("int8", "ramps") for feature in ("CP", "exports")),
    *(Pair(new, feature, (EXPERTS_TOGETHER,)) for new in ("int8", "ramps") for feature in ("MoE", "EP")),
    *(Pair(new, "TP", (TP_STATES,)) for new in ("int8", "ramps")),
    *(Pair(new, "float8", (FLOAT8,)) for new in ("int8", "ramps")),
    *(Pair(new, "harness", (HARNESS_STATES,)) for new in ("int8", "ramps")),
    Pair("int8", "ramps", (LORA, CP_EXPORTS, EXPERTS_TOGETHER)),
    Pair("int8", "PP", (PP_HSDP,)),
    Pair("int8", "FT", refused="--optimizer_state_dtype=int8 does not combine with --fault_tolerance"),
    Pair("ramps", "PP", refused="--batch_size_schedule with --pipeline_parallel_size=2: a pipeline's stages"),
    Pair("ramps", "FT", refused="--batch_size_schedule does not combine with --fault_tolerance yet"),
]


# --deterministic (in every run of TOGETHER and their references), --cpu_offload and --ac_mode=offload: the
# runs that keep FSDP's state or the blocks' activations on the host, each against its reference
OFF_LORA = f"{TOGETHER}, offloaded LoRA with ramps on hsdp 2 x 2, async checkpoints, exports"
OFF_EP = f"{TOGETHER}, offloaded experts spread over 2 of 4 ranks, evaluation"
OFF_CP = f"{TOGETHER}, offloaded cp2 x fsdp 2, evaluation"
OFF_PP = f"{TOGETHER}, offloaded pp2 x fsdp 2, evaluation"
OFF_TP = f"{M}::test_fsdp_and_hsdp_with_tp_on_4_ranks_give_the_loss_of_the_same_global_batch, fsdp_tp2_offloaded"
OFF_FLOAT8 = (
    "test_composition.py::test_float8_through_a_pipeline_trains_as_one_rank_accumulating_its_microbatches, offloaded"
)
OFF_HARNESS = f"{H_MESHES}, offloaded, deterministic"
OFFLOADED_TOO = {"PP": OFF_PP, "CP": OFF_CP, "TP": OFF_TP, "HSDP": OFF_LORA, "FT": FT_CP, "LoRA": OFF_LORA}
OFFLOADED_TOO |= {"float8": OFF_FLOAT8, "async": OFF_LORA, "eval": OFF_CP, "harness": OFF_HARNESS}
OFFLOADED_TOO |= {"exports": OFF_LORA, "MoE": OFF_EP, "EP": OFF_EP, "EMA": OFF_CP, "ramps": OFF_LORA}
DETERMINISTIC_TOO = {"PP": PP_CP, "CP": PP_CP, "TP": OFF_TP, "HSDP": LORA, "LoRA": LORA, "float8": FLOAT8}
DETERMINISTIC_TOO |= {"async": LORA, "eval": LORA, "harness": OFF_HARNESS, "exports": CP_EXPORTS}
DETERMINISTIC_TOO |= {"MoE": EXPERTS_TOGETHER, "EP": EXPERTS_TOGETHER, "EMA": LORA, "int8": LORA, "ramps": LORA}
MATRIX += [
    *(Pair(new, feature, (run,)) for new in ("offload", "act-offload") for feature, run in OFFLOADED_TOO.items()),
    Pair("act-offload", "int8", (PP_HSDP,)),
    Pair("offload", "int8", refused="--optimizer_state_dtype=int8 does not combine with --cpu_offload"),
    Pair("offload", "act-offload", (OFF_LORA,)),
    *(Pair("det", feature, (run,)) for feature, run in DETERMINISTIC_TOO.items()),
    *(Pair("det", new, (OFF_LORA,)) for new in ("offload", "act-offload")),
    Pair("det", "FT", refused="--deterministic with --fault_tolerance"),
]


# neither run together nor refused yet: the table shows them as such
NOT_YET: list[tuple[str, str]] = []


@dataclass(frozen=True)
class Case:
    """A model or schedule with a feature, beyond the pairs: its flags (for a start-up check on 4 ranks), and
    the runs that train it against a reference, or the start-up's refusal."""

    what: str
    flags: tuple[str, ...]
    runs: tuple[str, ...] = ()
    refused: Optional[str] = None


TIED = ("--model_variant=tiny_tied",)  # Llama 3.2's head, tied to the embedding
V_EVAL = ("--pipeline_parallel_size=2", "--pipeline_stages_per_rank=2", "--eval_interval=2", "--eval_data_path=.")
CASES: list[Case] = [
    Case(
        "a tied head (Llama 3.2's) with TP",
        (*TIED, "--tensor_parallel_size=2"),
        ("test_composition.py::test_a_head_tied_to_the_embedding_trains_under_tensor_parallelism_as_on_one_rank",),
    ),
    Case(
        "a tied head with PP",
        (*TIED, "--pipeline_parallel_size=2"),
        refused="--pipeline_parallel_size=2 does not combine with a head tied to the embedding yet: the first",
    ),
    *(
        Case(
            f"eval under PP's {schedule}",
            (*V_EVAL, f"--pipeline_schedule={schedule}"),
            refused=f"--eval_interval does not run under --pipeline_schedule={schedule} yet",
        )
        for schedule in ("ZBVZeroBubble", "DualPipeV")
    ),
    Case(
        "an lm-eval-harness score as the checkpoint monitor (--checkpoint_keep_best)",
        ("--eval_harness_tasks=hellaswag", "--checkpoint_keep_best=1", "--checkpoint_monitor=harness/hellaswag/acc"),
        (f"{H}::test_the_harness_scores_the_training_model_as_lm_eval_scores_its_export",),
    ),
]


def every_pair() -> list[tuple[str, str]]:
    return list(itertools.combinations(FEATURES, 2))


def entry(a: str, b: str) -> Optional[Pair]:
    return next((p for p in MATRIX if {p.a, p.b} == {a, b}), None)


def cases_table() -> str:
    """docs/configuration.md's list of CASES: what, and C (composes) or R (refused at start-up)."""
    rows = ["| beyond the pairs | |", "|---|---|"]
    rows += [f"| {c.what} | {'R' if c.refused else 'C'} |" for c in CASES]
    return "\n".join(rows)


def table() -> str:
    """docs/configuration.md's table: a row per feature, a column per feature; C composes (a run with both
    matches its reference), R is refused at start-up in one line, - not yet run together."""
    names = list(FEATURES)
    rows = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for a in names:
        cells = []
        for b in names:
            pair = None if a == b else entry(a, b)
            cells.append("" if a == b else "-" if pair is None else "R" if pair.refused else "C")
        rows.append(f"| **{a}** ({FEATURES[a][0]}) | " + " | ".join(cells) + " |")
    return "\n".join(rows)
