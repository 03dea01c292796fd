"""lm-eval-harness in the loop (--eval_harness_tasks; fms_fsdp/evaluation/harness.py): tasks of our own, defined in
local yaml over local jsonl (a multiple-choice and a perplexity kind), scored by two FSDP ranks as the
model trains, by `fms-evaluate` on the saved model, and by lm-eval's own Hugging Face model on the
export: the same figures. Needs the `harness` extra (lm-eval): `bash scripts/test_harness.sh` installs it and runs
these (`-m harness`), which the README's test command leaves out; CI runs it after that command."""

import json
import math
import random
from pathlib import Path

import pytest

from fms_fsdp.checkpoint.layout import complete_checkpoints

from conftest import TINY, here, launch, records
from test_data import make_docs, write_dataset
from test_hf import hf_main, save_tokenizer

pytestmark = pytest.mark.harness


@pytest.fixture(scope="module", autouse=True)
def lm_eval():
    """The harness extra, or a skip saying how to get it (a failure under CI=true: tests/no_silent_skip.py)."""
    return pytest.importorskip("lm_eval", reason="the harness extra: bash scripts/test_harness.sh installs lm-eval")


SEQ = 32  # short windows: the perplexity task's texts roll over several
TASKS = "tiny_mc,tiny_ppl"
RUN = [
    *TINY,
    f"--seq_length={SEQ}",
    "--vocab_size=512",
    "--bos_token=510",  # the tokenizer's <s>: lm-eval's Hugging Face model prefixes empty contexts with it
    "--eos_token=511",
    "--num_steps=4",
    "--batch_size=2",
    "--eval_batch_size=3",
]
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
# a checkpoint every 2 steps, the newest kept and the best by an lm-eval score (a perplexity: lower is better)
MONITOR = "harness/tiny_ppl/word_perplexity"
KEEP_BEST = [
    "--checkpoint_interval=2",
    "--checkpoint_keep=1",
    "--checkpoint_keep_best=1",
    f"--checkpoint_monitor={MONITOR}",
]


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(1, 500)}" for _ in range(n))


def write_tasks(folder: Path) -> Path:
    """tiny_mc (multiple choice, 3 to 4 choices), tiny_ppl (rolling perplexity, texts of 5 to 90 words)
    and tiny_gen (generation) over jsonl files in `folder`; returns the folder of their yaml files."""
    rng = random.Random(0)
    mc = [
        {
            "question": words(rng, rng.randrange(2, 12)),
            "choices": [words(rng, rng.randrange(1, 4)) for _ in range(3 + k % 2)],
        }
        for k in range(24)
    ]
    for k, doc in enumerate(mc):
        doc["answer"] = k % len(doc["choices"])
    texts = [{"text": words(rng, rng.randrange(5, 90))} for _ in range(10)]
    tasks = folder / "tasks"
    tasks.mkdir(parents=True)
    for name, docs in (("mc", mc), ("ppl", texts)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    data = "dataset_path: json\ntest_split: train\ndataset_kwargs:\n  data_files:\n    train: {}\n"
    (tasks / "tiny_mc.yaml").write_text(
        "task: tiny_mc\n"
        + data.format(folder / "mc.jsonl")
        + "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    (tasks / "tiny_ppl.yaml").write_text(
        "task: tiny_ppl\n"
        + data.format(folder / "ppl.jsonl")
        + "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n"
    )
    (tasks / "tiny_gen.yaml").write_text(  # a generation task: refused in the loop
        "task: tiny_gen\n"
        + data.format(folder / "mc.jsonl")
        + "output_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n"
    )
    return tasks


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two FSDP ranks training 4 steps with the harness at steps 2 and 4, held-out evaluation and checkpoints
    in the background too; (run folder, tasks, tokenizer)."""
    tmp = tmp_path_factory.mktemp("harness")
    tasks, tok = write_tasks(tmp), tmp / "tok"
    save_tokenizer(tok)
    out = tmp / "run"
    write_dataset(tmp / "held_out", "web", make_docs(10, 100, 1))  # ids below the vocabulary of 512
    harness = [f"--eval_harness_tasks={TASKS}", f"--eval_harness_include_path={tasks}", f"--tokenizer_path={tok}"]
    harness += ["--async_checkpoint=True", "--eval_interval=2", f"--eval_data_path={tmp / 'held_out'}"]
    proc = launch(
        "main_training.py",
        [
            *RUN,
            *harness,
            *KEEP_BEST,
            "--eval_harness_interval=2",
            "--export_model_at_end=True",
            f"--ckpt_save_path={out}",
        ],
        2,
        extra_env={**OFFLINE, "HF_DATASETS_CACHE": str(tmp / "hf_cache")},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, tasks, tok, proc.stdout


def harness_records(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in records(out) if "harness_seconds" in r}


def test_the_harness_scores_the_training_model_as_lm_eval_scores_its_export(trained, tmp_path, monkeypatch):
    from lm_eval.evaluator import evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    out, tasks, tok, stdout = trained
    scored = harness_records(out)
    assert sorted(scored) == [2, 4]  # every --eval_harness_interval steps and at the last
    assert scored[2]["harness/tiny_mc/acc"] != scored[4]["harness/tiny_mc/acc"] or (
        scored[2]["harness/tiny_ppl/word_perplexity"] != scored[4]["harness/tiny_ppl/word_perplexity"]
    ), "the model trains between the two"
    assert "harness step 4 | tiny_mc/acc" in stdout
    assert [r["step"] for r in records(out) if "eval_loss" in r] == [2, 4]  # held-out evaluation beside it
    best = min(scored, key=lambda s: (scored[s][MONITOR], s))  # --checkpoint_keep_best by the harness's score
    assert [s for s, _ in complete_checkpoints(out / "checkpoints")] == sorted({best, 4}), (best, scored)
    # lm-eval's own run over the Hugging Face export of the same weights (fp32)
    for k, v in {**OFFLINE, "HF_DATASETS_CACHE": str(tmp_path / "hf_cache")}.items():
        monkeypatch.setenv(k, v)
    hf_main(
        str(out / "model_step_4.safetensors"),
        str(tmp_path / "hf"),
        model_variant="tiny",
        vocab_size="512",
        dtype="fp32",
        tokenizer_name_or_path=str(tok),
    )
    lm = HFLM(pretrained=str(tmp_path / "hf"), max_length=SEQ, batch_size=4, dtype="float32", device="cpu")
    results = evaluate(lm, TaskManager(include_path=str(tasks)).load(TASKS.split(",")), bootstrap_iters=0)
    assert results is not None
    theirs = results["results"]
    for task, metric in [("tiny_mc", "acc"), ("tiny_mc", "acc_norm"), ("tiny_ppl", "word_perplexity"),
                         ("tiny_ppl", "byte_perplexity"), ("tiny_ppl", "bits_per_byte")]:  # fmt: skip
        ours, expected = scored[4][f"harness/{task}/{metric}"], theirs[task][f"{metric},none"]
        assert math.isclose(ours, expected, rel_tol=1e-5), (task, metric, ours, expected)


def test_fms_evaluate_scores_a_saved_model_the_same(trained, monkeypatch):
    from fms_fsdp.cli import evaluate

    out, tasks, tok, _ = trained
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    args = [
        *RUN,
        f"--ckpt_load_path={out / 'model_step_4.safetensors'}",
        f"--eval_harness_tasks={TASKS}",
        f"--eval_harness_include_path={tasks}",
        f"--tokenizer_path={tok}",
    ]
    with here() as printed:
        evaluate(args)
    assert_same_scores(printed_scores(printed.getvalue()), harness_records(out)[4], 1e-5)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--eval_harness_tasks=no_such_task_xyz", "TOK"], "--eval_harness_tasks: unknown task 'no_such_task_xyz'"),
        (["--eval_harness_tasks=tiny_mc"], "--eval_harness_tasks needs --tokenizer_path"),
        (["--eval_harness_interval=5"], "--eval_harness_interval and --eval_harness_limit need --eval_harness_tasks"),
        (["--eval_harness_tasks=tiny_gen", "TOK"], "--eval_harness_tasks: tiny_gen is a generate_until task"),
    ],
)
def test_harness_errors_are_one_line_at_start_up(extra, message, trained, tmp_path):
    _, tasks, tok, _ = trained
    extra = [f"--tokenizer_path={tok}" if a == "TOK" else a for a in extra]
    args = [*RUN, f"--eval_harness_include_path={tasks}", *extra, f"--ckpt_save_path={tmp_path / 'run'}"]
    proc = launch("main_training.py", args, 1, extra_env=OFFLINE)
    assert proc.returncode != 0
    errors = [line for line in proc.stdout.splitlines() + proc.stderr.splitlines() if line.startswith("error:")]
    assert errors and message in errors[0], proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_the_harness_scores_lines_split_over_context_parallel_ranks_the_same(trained, tmp_path):
    """The same training on 2 ranks that split every line (--context_parallel_size=2: the same global
    batch on one data-parallel rank) scores the tasks as the FSDP run does: the logits are gathered
    whole from the ranks' parts. Rank 0 alone draws lm-eval's progress bars, and no rank warns of a
    deprecated torch API."""
    out, tasks, tok, _ = trained
    harness = [f"--eval_harness_tasks={TASKS}", f"--eval_harness_include_path={tasks}", f"--tokenizer_path={tok}"]
    split = tmp_path / "run"
    proc = launch(
        "main_training.py",
        [*RUN, "--batch_size=4", "--context_parallel_size=2", *harness, f"--ckpt_save_path={split}"],
        2,
        extra_env={**OFFLINE, "HF_DATASETS_CACHE": str(tmp_path / "hf_cache")},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # only rank 0 prints: lm-eval's progress bar of the one evaluation once, and no rank's deprecation warnings
    assert proc.stderr.count("Tokenizing inputs: 100%") == 1, proc.stderr
    assert "Warning" not in proc.stderr and "deprecated" not in proc.stderr, proc.stderr
    ours, theirs = harness_records(split)[4], harness_records(out)[4]
    scores = [k for k in theirs if k.startswith("harness/")]
    assert scores and all(math.isclose(ours[k], theirs[k], rel_tol=1e-4) for k in scores), (ours, theirs)


# the FSDP run's training on other meshes and with other features (its global batch of 4 lines), scored
# as that run is: the harness composes with each
MESHES = {
    "tp2": ["--batch_size=4", "--tensor_parallel_size=2"],
    "hsdp 1 x 2 with the weight average": ["--sharding_strategy=hsdp", "--sharding_group_size=1", "--ema_decay=0.9"],
    "offloaded, deterministic": [
        "--cpu_offload=True",  # FSDP's state on the host
        "--fsdp_activation_checkpointing=True",
        "--ac_mode=offload",  # the blocks' activations too
        "--deterministic=True",
    ],
}


def harness_flags(trained) -> list[str]:
    _, tasks, tok, _ = trained
    return [f"--eval_harness_tasks={TASKS}", f"--eval_harness_include_path={tasks}", f"--tokenizer_path={tok}"]


def scored_run(trained, out: Path, flags: list[str], script: str = "main_training.py") -> str:
    """`script` on 2 ranks with RUN, the harness and `flags`, writing to `out`: its stdout."""
    env = {**OFFLINE, "HF_DATASETS_CACHE": str(out.parent / "hf_cache")}
    proc = launch(script, [*RUN, *harness_flags(trained), *flags, f"--ckpt_save_path={out}"], 2, extra_env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def printed_scores(stdout: str) -> dict[str, float]:
    """fms-evaluate's `HARNESS task/metric=value` lines, under the metrics' names."""
    pairs = (line.split(" ", 1)[1].split("=") for line in stdout.splitlines() if line.startswith("HARNESS "))
    return {f"harness/{k}": float(v) for k, v in pairs}


def assert_same_scores(ours: dict, theirs: dict, rel: float) -> None:
    scores = [k for k in theirs if k.startswith("harness/")]
    assert scores and all(math.isclose(ours[k], theirs[k], rel_tol=rel) for k in scores), (ours, theirs)


@pytest.mark.parametrize("mesh", MESHES)
def test_the_harness_scores_the_same_training_on_other_meshes_the_same(mesh, trained, tmp_path):
    scored_run(trained, tmp_path / "run", MESHES[mesh])
    assert_same_scores(harness_records(tmp_path / "run")[4], harness_records(trained[0])[4], 1e-4)


def test_the_harness_in_a_run_with_eight_bit_states_and_ramps_scores_its_model_as_its_export(trained, tmp_path):
    """8-bit optimizer states (torchao's) and ramped batches and lines: the harness in the loop scores the
    model it trained as `fms-evaluate` scores its export, and not as the training with fp32 states and no
    ramp."""
    changed = ["--optimizer_state_dtype=int8", "--batch_size_schedule=0:1,2:2", f"--seq_length_schedule=0:16,3:{SEQ}"]
    run = tmp_path / "run"
    scored_run(trained, run, [*changed, "--export_model_at_end=True"])
    export = [f"--ckpt_load_path={run / 'model_step_4.safetensors'}"]
    stdout = scored_run(trained, tmp_path / "evaluated", export, script="scripts/evaluate.py")
    in_loop = harness_records(run)[4]
    assert_same_scores(printed_scores(stdout), in_loop, 1e-4)
    assert in_loop[MONITOR] != harness_records(trained[0])[4][MONITOR]


def test_the_harness_scores_a_model_through_its_lora_adapters(trained, tmp_path):
    """LoRA adapters trained for two steps on the trained model: the harness in the loop scores the adapted
    model as `fms-evaluate` on 2 ranks scores its merged export (W + scale B A), and not as the base."""
    base = trained[0] / "model_step_4.safetensors"
    run = tmp_path / "run"
    lora = ["--lora_rank=4", "--num_steps=2", f"--ckpt_load_path={base}", "--export_model_at_end=True"]
    scored_run(trained, run, lora)
    stdout = scored_run(
        trained,
        tmp_path / "merged",
        [f"--ckpt_load_path={run / 'model_step_2.safetensors'}"],
        script="scripts/evaluate.py",
    )
    in_loop = harness_records(run)[2]
    assert_same_scores(printed_scores(stdout), in_loop, 1e-4)
    assert in_loop[MONITOR] != harness_records(trained[0])[4][MONITOR]  # the adapters changed the model


def test_the_harness_scores_a_sparse_model_the_same_with_its_experts_spread(trained, tmp_path):
    """A mixture-of-experts model trained on 2 FSDP ranks, and the same with its experts spread over the 2
    ranks (--expert_parallel_size=2): the harness runs through the routed experts, and scores both alike."""
    sparse = ["--model_variant=tiny_moe", "--moe_aux_loss_weight=0"]
    for name, extra in {"fsdp": [], "ep2": ["--expert_parallel_size=2"]}.items():
        scored_run(trained, tmp_path / name, [*sparse, *extra])
    assert_same_scores(harness_records(tmp_path / "ep2")[4], harness_records(tmp_path / "fsdp")[4], 1e-4)


def test_fms_evaluate_scores_a_float8_run_as_its_loop_did(trained, tmp_path):
    """A float8 run scored by the harness as it trains (its matmuls in float8), and `fms-evaluate --float8`
    on its saved model with as many ranks (float8 scales each batch of requests by its own largest values,
    so the ranks' batches must be the same): the same figures."""
    float8 = ["--float8=True", "--float8_min_size=16"]
    run = tmp_path / "run"
    scored_run(trained, run, [*float8, "--export_model_at_end=True"])
    evaluated = [*float8, f"--ckpt_load_path={run / 'model_step_4.safetensors'}"]
    stdout = scored_run(trained, tmp_path / "evaluated", evaluated, script="scripts/evaluate.py")
    assert_same_scores(printed_scores(stdout), harness_records(run)[4], 1e-5)
