"""The composition matrix (tests/composition.py): every pair of large features is in it; a refused pair
is refused by the start-up in the line recorded (4 ranks planned from torchrun's environment, no launch);
a pair that composes names runs that exist, each in its tier, with both features against a reference."""

import ast
import re
from pathlib import Path

import pytest
from composition import CASES, FEATURES, MATRIX, NOT_YET, Case, Pair, every_pair
from kept_checkpoints import ASSETS, KEPT_STEP

from fms_fsdp.checkpoint.layout import complete_checkpoints
from fms_fsdp.errors import ConfigError
from fms_fsdp.flags import parse_args
from fms_fsdp.startup import facts

from conftest import ROOT, TINY, launch_runs, records, resume_from


def test_every_pair_of_features_is_in_the_matrix_once():
    listed = [frozenset((p.a, p.b)) for p in MATRIX]
    assert len(listed) == len(set(listed)) and all(p.a in FEATURES and p.b in FEATURES for p in MATRIX)
    assert all(bool(p.runs) != bool(p.refused) for p in MATRIX)
    missing = [pair for pair in every_pair() if frozenset(pair) not in listed]
    assert missing == NOT_YET, missing  # the generated table says so (docs/configuration.md)


@pytest.mark.parametrize("pair", [p for p in MATRIX if p.refused], ids=lambda p: f"{p.a}+{p.b}")
def test_a_refused_pair_is_refused_at_start_up_in_its_line(pair: Pair, monkeypatch, tmp_path):
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(name, value)
    base = "--ckpt_load_path=" + str(ASSETS / "layout1" / "checkpoints" / f"step_{KEPT_STEP}_ckp")  # for LoRA
    args = [*TINY, "--batch_size=4", f"--ckpt_save_path={tmp_path}", "--ft_group_index=0", base]
    with pytest.raises(ConfigError) as e:
        facts(parse_args([*args, *FEATURES[pair.a][1], *FEATURES[pair.b][1]]))
    assert str(e.value).startswith(pair.refused), e.value
    assert "\n" not in str(e.value) and says_what_to_change(str(e.value)), e.value


@pytest.mark.parametrize("case", [c for c in CASES if c.refused], ids=lambda c: c.what)
def test_a_refused_case_beyond_the_pairs_is_refused_at_start_up_in_its_line(case: Case, monkeypatch, tmp_path):
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as e:
        facts(parse_args([*TINY, "--batch_size=4", f"--ckpt_save_path={tmp_path}", *case.flags]))
    assert str(e.value).startswith(case.refused), e.value
    assert "\n" not in str(e.value) and says_what_to_change(str(e.value)), e.value


def says_what_to_change(message: str) -> bool:
    """Whether a refusal goes on to what to do instead: use, drop, leave out, score or ramp otherwise."""
    return re.search(r"[:;] (use|drop|leave|score|ramp) ", message) is not None


def test_every_run_named_exists():
    assert all(bool(c.runs) != bool(c.refused) for c in CASES)
    for pair in [*MATRIX, *CASES]:
        for run in pair.runs:
            where, _, case = run.partition(", ")
            file, _, function = where.partition("::")
            source = (ROOT / "tests" / file).read_text()
            functions = {n.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)}
            assert function in functions, run
            if case:  # a run of the test's launches, named in its file
                assert re.search(rf'["\']{re.escape(case)}["\']', source), run


# runs of several features at once on 4 ranks, each against one rank with the same global batch (its
# evaluation too): (the run's flags, the reference's); both read synthetic lines and evaluate on `data`,
# and start from a kept micro model (LoRA's base; the sparse one from layout2's)
SPARSE = ["--moe_experts=4", "--moe_top_k=2", "--moe_aux_loss_weight=0", "--eval_batch_size=4"]
LORA = ["--lora_rank=4", "--eval_batch_size=4"]  # the same lines evaluated whatever --batch_size
PP = ["--pipeline_parallel_size=2", "--pipeline_schedule=1F1B"]
INT8 = "--optimizer_state_dtype=int8"
ACT_OFFLOAD = ["--fsdp_activation_checkpointing=True", "--ac_mode=offload"]
OFFLOADED = ["--cpu_offload=True", *ACT_OFFLOAD]  # FSDP's state and the blocks' activations on the host


def ramp(ranks: int) -> list[str]:
    """A batch of 1 line per data-parallel rank, then 2 (--batch_size) once 2 steps are done, for `ranks` of
    them at once; lines of 32 tokens, then 64 once 3 are."""
    return [f"--batch_size_schedule=0:{ranks},2:{2 * ranks}", "--seq_length_schedule=0:32,3:64"]


RAMP_PER_RANK = ramp(1)
# (the run's flags, the reference's, the run's data-parallel ranks: the reference takes their lines at once)
TOGETHER = {
    "pp2 x cp2 with LoRA, async checkpoints, evaluation": (
        [*PP, "--context_parallel_size=2", "--async_checkpoint=True", "--lora_rank=4"],
        ["--lora_rank=4"],
        1,
    ),
    "LoRA with 8-bit states and ramps on hsdp 2 x 2, async checkpoints, evaluation": (
        [*LORA, INT8, *RAMP_PER_RANK, "--sharding_strategy=hsdp", "--sharding_group_size=2", "--async_checkpoint=True"],
        [*LORA, INT8, *ramp(4)],
        4,
    ),
    # each rank evaluates the same lines, --batch_size at a time under a pipeline
    "pp2 on hsdp 1 x 2 with 8-bit states and offloaded activations, evaluation": (
        [*PP, INT8, *ACT_OFFLOAD, "--sharding_strategy=hsdp", "--sharding_group_size=1"],
        [INT8, "--eval_batch_size=2"],
        2,
    ),
    # no balance loss: over a rank's 2 lines it is not the one rank's over 8 (the language-model loss is)
    "experts spread over 2 of 4 ranks with 8-bit states and ramps, async checkpoints, evaluation": (
        [*SPARSE, INT8, *RAMP_PER_RANK, "--expert_parallel_size=2", "--async_checkpoint=True"],
        [*SPARSE, INT8, *ramp(4)],
        4,
    ),
    "8-bit states and ramps on cp2 x hsdp 1 x 2, exports": (
        [INT8, *RAMP_PER_RANK, "--eval_batch_size=4", "--context_parallel_size=2", "--sharding_strategy=hsdp"]
        + ["--sharding_group_size=1", "--export_interval=2"],
        [INT8, *ramp(2), "--eval_batch_size=4"],
        2,
    ),
    # offloaded to the host: FSDP's parameters, gradients and optimizer state, and the blocks' activations
    "offloaded LoRA with ramps on hsdp 2 x 2, async checkpoints, exports": (
        [*LORA, *OFFLOADED, *RAMP_PER_RANK, "--sharding_strategy=hsdp", "--sharding_group_size=2"]
        + ["--async_checkpoint=True", "--export_interval=2"],
        [*LORA, *ramp(4)],
        4,
    ),
    "offloaded experts spread over 2 of 4 ranks, evaluation": (
        [*SPARSE, *OFFLOADED, "--expert_parallel_size=2"],
        SPARSE,
        4,
    ),
    "offloaded cp2 x fsdp 2, evaluation": (
        [*OFFLOADED, "--context_parallel_size=2", "--eval_batch_size=4"],
        ["--eval_batch_size=4"],
        2,
    ),
    "offloaded pp2 x fsdp 2, evaluation": ([*PP, *OFFLOADED], ["--eval_batch_size=2"], 2),
}
# torchao's 8-bit update, eager: as compiled, less the compiling
EAGER = {"TORCHDYNAMO_DISABLE": "1"}
# run twice (--deterministic): the pipeline's, context parallelism's and the experts' all-to-all reductions
# in a fixed order, so the second run's losses are the first's to the bit
TWICE = ("pp2 x cp2 with LoRA, async checkpoints, evaluation", "offloaded experts spread over 2 of 4 ranks, evaluation")


def by_step(found: list[dict]) -> dict[int, dict]:
    """A run's metrics records merged by step (a step's training and evaluation records are two)."""
    merged: dict[int, dict] = {}
    for record in found:
        merged.setdefault(record["step"], {}).update(record)
    return merged


@pytest.fixture(scope="module")
def together(tmp_path_factory, data) -> Path:
    """TOGETHER's runs, each from a kept checkpoint of step 2 for 4 steps, evaluated and checkpointed at 2 and 4:
    every case's on 4 ranks in one launch (those of TWICE again: <case>/again), its reference on one rank in
    another (<case>/run, <case>/one)."""
    root = tmp_path_factory.mktemp("together")
    runs: dict[int, list[list[str]]] = {4: [], 1: []}
    for i, (case, (flags, reference, dp)) in enumerate(TOGETHER.items()):
        kept = "layout2" if "experts" in case else "layout1"
        base = str(ASSETS / kept / "checkpoints" / f"step_{KEPT_STEP}_ckp")
        common = [
            *TINY,
            "--model_variant=micro",
            "--vocab_size=1024",
            f"--ckpt_load_path={base}",
            "--lr_schedule=constant",
            "--warmup_steps=2",
            "--num_steps=4",
            "--checkpoint_interval=2",
            "--eval_interval=2",
            f"--eval_data_path={data}",
            "--eval_batches=2",
            "--ema_decay=0.5",  # the weight average too: evaluated as eval_loss_ema
            "--deterministic=True",
        ]
        for again in ("run", "again") if case in TWICE else ("run",):
            runs[4].append([*common, "--batch_size=2", *flags, f"--ckpt_save_path={root / str(i) / again}"])
        runs[1].append([*common, f"--batch_size={2 * dp}", *reference, f"--ckpt_save_path={root / str(i) / 'one'}"])
    for ranks, listed in runs.items():
        launch_runs(ranks, listed, EAGER)  # eager: torchao's 8-bit update, and compile is off in every run
    return root


@pytest.mark.slow
@pytest.mark.parametrize("case", TOGETHER)
def test_features_run_together_train_and_evaluate_as_one_rank(case, together):
    flags = TOGETHER[case][0]
    out = together / str(list(TOGETHER).index(case)) / "run"
    got, want = (by_step(records(run)) for run in (out, out.parent / "one"))
    pairs = [(got[s][k], want[s][k]) for s in want for k in ("loss", "eval_loss", "eval_loss_ema") if k in want[s]]
    assert len(pairs) == 4 + 2 * 2 and all(a == pytest.approx(b, rel=1e-4) for a, b in pairs), pairs
    assert [s for s, _ in complete_checkpoints(out / "checkpoints")] == [2, 4]
    if RAMP_PER_RANK[0] in flags:  # the steps took the stages' shapes
        assert [(got[s]["batch_size"], got[s]["seq_length"]) for s in sorted(got)] == [
            (1, 32),
            (1, 32),
            (2, 32),
            (2, 64),
        ]
    if "--export_interval=2" in flags:
        assert sorted(p.name for p in (out / "exports").iterdir()) == ["step_2", "step_4"]
    if case in TWICE:  # --deterministic: the same command twice, the same losses and evaluations to the bit
        again = by_step(records(out.parent / "again"))
        numerics = [(s, k) for s in got for k in got[s] if k.startswith(("loss", "eval_loss", "grad_norm"))]
        assert len(numerics) > 8 and [again[s][k] for s, k in numerics] == [got[s][k] for s, k in numerics]


@pytest.mark.slow
def test_a_head_tied_to_the_embedding_trains_under_tensor_parallelism_as_on_one_rank(tmp_path):
    """Llama 3.2's tied head (tiny_tied) under TP=2, built eagerly and on the meta device (--low_cpu_fsdp):
    the losses of one rank, and the TP=2 checkpoint resumes on one rank to them."""
    tied = [*TINY, "--model_variant=tiny_tied", "--num_steps=4", "--batch_size=2", "--checkpoint_interval=2"]
    runs = {
        "one": [],
        "tp2": ["--tensor_parallel_size=2"],
        "tp2_meta": ["--tensor_parallel_size=2", "--low_cpu_fsdp=True"],
    }
    launch_runs(2, [[*tied, *extra, f"--ckpt_save_path={tmp_path / name}"] for name, extra in runs.items() if extra])
    resumed = resume_from(tmp_path / "tp2", 2, tmp_path / "resumed")
    launch_runs(1, [[*tied, f"--ckpt_save_path={tmp_path / name}"] for name in ("one", "resumed")])
    want = [r["loss"] for r in records(tmp_path / "one")]
    for name in ("tp2", "tp2_meta"):
        assert [r["loss"] for r in records(tmp_path / name)] == pytest.approx(want, rel=1e-5), name
    assert [r["loss"] for r in records(resumed) if r["step"] > 2] == pytest.approx(want[2:], rel=1e-5)


@pytest.mark.slow
def test_float8_with_background_checkpoints_and_evaluation_trains_as_float8_alone(tmp_path, data):
    """Background checkpoints, evaluation and the weight average change nothing of a float8 run's steps (the
    same computation: bit-equal losses), and it evaluates both weights and checkpoints at its steps. The
    runs ramp and keep 8-bit optimizer states: they train as with fp32 ones within the states' tolerance."""
    float8 = [*TINY, "--vocab_size=1024", "--float8=True", "--float8_min_size=16", "--num_steps=4", "--batch_size=2"]
    beside = ["--async_checkpoint=True", "--checkpoint_interval=2", "--eval_interval=2", f"--eval_data_path={data}"]
    beside += ["--eval_batches=2", "--ema_decay=0.5"]
    runs = {"alone": [INT8, "--checkpoint_interval=0"], "beside": [INT8, *beside], "fp32": ["--checkpoint_interval=0"]}
    runs = {name: [*RAMP_PER_RANK, *extra, "--deterministic=True"] for name, extra in runs.items()}
    launch_runs(1, [[*float8, *extra, f"--ckpt_save_path={tmp_path / name}"] for name, extra in runs.items()], EAGER)
    got, want = ([r["loss"] for r in records(tmp_path / name) if "loss" in r] for name in ("beside", "alone"))
    assert len(want) == 4 and got == want
    fp32 = [r["loss"] for r in records(tmp_path / "fp32") if "loss" in r]  # 8-bit moments: within 1% of fp32's
    assert want != fp32 and want == pytest.approx(fp32, rel=1e-2)
    evals = [r for r in records(tmp_path / "beside") if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4] and all(r["eval_loss_ema"] != r["eval_loss"] for r in evals)
    assert [s for s, _ in complete_checkpoints(tmp_path / "beside" / "checkpoints")] == [2, 4]


@pytest.mark.slow
def test_float8_through_a_pipeline_trains_as_one_rank_accumulating_its_microbatches(tmp_path):
    """float8 scales each microbatch by its own largest values: two pipeline stages over microbatches of one
    line train as one rank accumulating one line at a time (the same lines, the same scales). The first
    step's losses agree within 1e-6, but its gradients differ in their last fp32 digits (the pipeline sums in
    another order; without float8 the runs stay within 1e-6): float8's roundings carry them to 1.8e-6 of the
    second step's loss on one CI machine (under 1e-6 on another), within 1e-5, and to 4e-4 of the loss by
    step 3: within 1e-3."""
    float8 = [*TINY, "--vocab_size=1024", "--float8=True", "--float8_min_size=16", "--num_steps=4"]
    runs = {
        "pp2": (2, ["--batch_size=2", "--pipeline_parallel_size=2", "--pipeline_schedule=1F1B"]),
        "one": (1, ["--batch_size=1", "--grad_accum_steps=2"]),
        # two data-parallel ranks of a line each, and the same with FSDP's state and the blocks' activations on
        # the host, deterministic: the same computation, the same losses to the bit
        "fsdp2": (2, ["--batch_size=1"]),
        "offloaded": (2, ["--batch_size=1", *OFFLOADED, "--deterministic=True"]),
    }
    for ranks in (2, 1):
        listed = [[*float8, *extra, f"--ckpt_save_path={tmp_path / name}"] for name, (n, extra) in runs.items()]
        launch_runs(ranks, [run for run, (n, _) in zip(listed, runs.values()) if n == ranks])
    got, want, fsdp2, offloaded = ([r["loss"] for r in records(tmp_path / name) if "loss" in r] for name in runs)
    assert len(want) == 4 and got[0] == pytest.approx(want[0], rel=1e-6), (got, want)
    assert got[1] == pytest.approx(want[1], rel=1e-5), (got, want)
    assert got == pytest.approx(want, rel=1e-3), (got, want)
    # FSDP's state and the activations on the host, deterministic, change nothing of float8's steps on 2 ranks
    assert len(fsdp2) == 4 and offloaded == fsdp2
