"""Real training runs: torchrun with gloo on CPU, several processes, the tiny model."""

import contextlib
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
import yaml
from fms.models.llama import LLaMA
from torch._dynamo.utils import counters
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fms_fsdp.data.dummy import DummyDataLoader
from fms_fsdp.flags import parse_args
from fms_fsdp.model.initialization import init_weights
from fms_fsdp.model.variants import build_model, get_model_config
from fms_fsdp.parallel.parallelize import apply_fsdp
from fms_fsdp.schedule import build_scheduler
from fms_fsdp.settings import schedule_of
from fms_fsdp.startup import facts, optimizer_and_schedule, sharded_model, started
from fms_fsdp.storage import umask
from fms_fsdp.train.guard import StepGuard
from fms_fsdp.train.step import out_of_memory_error, train_step

from conftest import ROOT, TINY, here, inspect, launch, run_here, train, train_here

pytestmark = pytest.mark.torch_api  # also run on the oldest and newest torch (scripts/test_torch.sh)

STEPS = 10
FIELDS = {
    "step",
    "loss",
    "lr",
    "grad_norm",
    "tokens_seen",
    "step_time",
    "tokens_per_sec_per_gpu",
    "overall_tokens_per_sec_per_gpu",
    "tokens_per_day",
    "data_wait",
    "max_rss_gb",
}


def losses(records):
    return [r["loss"] for r in records]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The reference: 1 rank (in this process), global batch 4."""
    return train_here(tmp_path_factory.mktemp("one"), [f"--num_steps={STEPS}", "--batch_size=4"])


def test_fsdp_two_ranks_matches_one_rank_with_the_same_global_batch(tmp, one_rank):
    logs = tmp / "logs"
    two = train(
        tmp,
        [f"--num_steps={STEPS}", "--batch_size=2", "--sharding_strategy=fsdp"],
        nproc=2,
        torchrun_args=(f"--log-dir={logs}", "--redirects=3"),
        extra_env={"NCCL_DEBUG": "WARN"},
    )
    assert [r["step"] for r in two] == list(range(1, STEPS + 1))
    assert losses(two)[-1] < losses(two)[0] - 2.0, losses(two)
    for a, b in zip(losses(two), losses(one_rank)):
        assert a == pytest.approx(b, rel=1e-4)
    assert all(FIELDS <= set(r) for r in two)
    # every report names the slowest rank (tests/test_diagnostics.py: a stopped rank is named)
    assert all(r["slowest_rank"] in (0, 1) and r["slowest_rank_ratio"] >= 1 and "slowest_data_wait" in r for r in two)
    assert two[-1]["tokens_seen"] == STEPS * 4 * 64
    saved = (tmp / "run" / "config.yaml").read_text()
    assert yaml.safe_load(saved)["batch_size"] == 2 and parse_args([f"--config={tmp / 'run' / 'config.yaml'}"])
    # the run record heads it: what ran, where, with which environment
    head = [line for line in saved.splitlines() if line.startswith("# ")]
    assert head[0].startswith("# run record") and re.match(r"# fms-fsdp \S+, git [0-9a-f]{40}", head[1]), head
    assert f"torch {torch.__version__}, ibm-fms " in head[2] and "# world 2, mesh (replicate, shard) = (1, 2)" in head
    assert "# NCCL_DEBUG=WARN" in head
    # rank 0 prints, rank 1 stays silent
    out0, out1 = (next(logs.rglob(f"attempt_0/{r}/stdout.log")).read_text() for r in (0, 1))
    # a short summary of what runs (the model's line, the data, the steps, where the config went) before step 1
    head = out0.split("step 1 |")[0].splitlines()
    assert (
        head[0].startswith("model tiny: ")
        and head[-1] == f"config: {tmp / 'run' / 'config.yaml'} (every flag; --config=<it> runs it again)"
    )
    assert "data: synthetic token lines (--use_dummy_dataset)" in head and len(head) <= 6, head
    assert f"step {STEPS} | loss" in out0 and " | tok/s/rank " in out0 and "gpu" not in out0.lower()
    assert out1 == ""


def test_a_failed_start_says_its_error_first_and_leaves_no_folder(tmp):
    """A start that fails after the lease was taken (here, a dataset without files: found as the loader is
    built) prints its one error line and nothing before it, and leaves no folder or empty metrics.jsonl."""
    from fms_fsdp.cli import train as fms_train

    (tmp / "data" / "web").mkdir(parents=True)
    out = tmp / "new" / "run"
    err = io.StringIO()
    with here() as printed, contextlib.redirect_stderr(err), pytest.raises(SystemExit) as end:
        fms_train([*TINY, "--use_dummy_dataset=False", f"--data_path={tmp / 'data'}", f"--ckpt_save_path={out}"])
    assert end.value.code == 2
    assert printed.getvalue() == "" and err.getvalue().startswith(
        f"error: {tmp / 'data' / 'web'}: no .arrow or .parquet"
    )
    assert sorted(p.name for p in tmp.iterdir()) == ["data"]


def test_gradient_accumulation_equals_the_bigger_batch(tmp, one_rank):
    accum = train_here(tmp, [f"--num_steps={STEPS}", "--batch_size=2", "--grad_accum_steps=2"])
    for a, b in zip(losses(accum), losses(one_rank)):
        assert a == pytest.approx(b, rel=1e-4)


@pytest.mark.parametrize("mode", ["block", "op"])
def test_activation_checkpointing_keeps_the_losses(tmp, one_rank, mode):
    ac = train_here(
        tmp,
        [
            f"--num_steps={STEPS}",
            "--batch_size=4",
            "--fsdp_activation_checkpointing=True",
            "--selective_checkpointing=1/2",
            f"--ac_mode={mode}",
        ],
    )
    for a, b in zip(losses(ac), losses(one_rank)):
        assert a == pytest.approx(b, rel=1e-5)


def test_each_rank_holds_only_its_shard_and_meta_init_equals_eager(tmp):
    eager, meta, ddp = inspect(
        tmp,
        [],
        nproc=2,
        cases=[
            ["--sharding_strategy=fsdp"],
            ["--sharding_strategy=fsdp", "--low_cpu_fsdp=True"],
            ["--sharding_strategy=ddp"],
        ],
        backward=True,
    )
    full = eager[0]["full_numel"]
    for ranks in (eager, meta):
        assert sum(r["local_numel"] for r in ranks) == full
        assert all(r["local_numel"] < 0.6 * full and r["mesh"] == [1, 2] for r in ranks)
    assert all(r["local_numel"] == full and r["mesh"] == [2, 1] for r in ddp)
    # the meta path materialises exactly the eager weights, so the first loss is the same
    assert meta[0]["weight_fingerprint"] == eager[0]["weight_fingerprint"] == ddp[0]["weight_fingerprint"]
    assert meta[0]["initial_loss"] == eager[0]["initial_loss"]
    # gradient accumulation: sharded runs reduce-scatter every micro-batch (one micro-batch of unsharded
    # gradients at a time); ddp, whose gradients are whole anyway, reduces once at the last
    assert all(r["reduced_per_micro_batch"] for r in eager + meta)
    assert not any(r["reduced_per_micro_batch"] for r in ddp)


@pytest.mark.slow  # inductor's C++ build on a cold cache: up to 40 s
@pytest.mark.parametrize("mode", ["op", "block"])
def test_bf16_mixed_precision_and_compile_with_activation_checkpointing(tmp, one_rank, mode):
    """bf16 trains; the blocks, checkpointed per op or whole, compile whole (fullgraph: a graph break
    would fail the run) into one graph shared by all four, the loss into one more, and no step after
    the first compiles again."""
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):  # a recompile fails the run
        records = train_here(
            tmp,
            [
                "--num_steps=4",
                "--batch_size=4",
                "--mixed_precision=True",
                "--use_torch_compile=True",
                "--fsdp_activation_checkpointing=True",
                f"--ac_mode={mode}",
                "--document_masking=True",  # a new mask each batch: no recompile (FlexAttention: test_cuda.py)
            ],
        )
    assert losses(records)[0] == pytest.approx(losses(one_rank)[0], abs=0.02)  # same weights, bf16 forward
    assert losses(records)[-1] < losses(records)[0] - 1.0
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert not counters["graph_break"]


@pytest.mark.parametrize("bf16", [False, True])
def test_one_rank_trains_the_module_itself_with_the_losses_of_fsdp(bf16):
    """One rank trains the plain module, without FSDP's parameter copies in and out: in fp32 the losses
    and gradient norms of FSDP2 on that rank bit for bit; in bf16 (autocast over fp32 weights, where
    FSDP2 casts the parameters) the same within bf16's rounding."""
    cfg = parse_args([*TINY, "--num_steps=6", "--batch_size=2", f"--mixed_precision={bf16}"])
    curves = []
    with here(), started(facts(cfg)) as run:
        for plain in (True, False):
            if plain:
                model = sharded_model(run)
                assert not isinstance(model, FSDPModule) and not any(isinstance(p, DTensor) for p in model.parameters())
                assert all(p.dtype == torch.float32 for p in model.parameters())
            else:
                model = build_model(run.model_config, run.device)
                init_weights(model, cfg.seed)
                apply_fsdp(model, run.mesh, bf16)
            optimizer, scheduler = optimizer_and_schedule(run, model)
            guard = StepGuard(0, None, optimizer, run.device)
            batches = iter(
                DummyDataLoader(
                    batch_size=cfg.batch_size,
                    seq_length=cfg.seq_length,
                    vocab_size=cfg.vocab_size,
                    seed=cfg.seed,
                    rank=0,
                    world_size=1,
                )
            )
            curves.append([])
            for step in range(1, 7):
                done = train_step(
                    model=model,
                    optimizer=optimizer,
                    guard=guard,
                    step=step,
                    batches=batches,
                    settings=run.settings.step,
                    device=run.device,
                    global_norm=True,
                )
                scheduler.step()
                curves[-1].append((done.loss.item(), done.grad_norm.item()))
    plain, fsdp = curves
    assert plain[-1][0] < plain[0][0] - 1.0
    if not bf16:
        assert plain == fsdp
    else:
        # this lr makes the tiny model's later steps chaotic: the norms diverge after three, and the last
        # step's loss jumps (2.7 to 4.5), which amplifies the rounding differences (3% measured)
        assert plain != fsdp and all(a[0] == pytest.approx(b[0], rel=0.02) for a, b in zip(plain[:5], fsdp)), curves
        assert all(a[1] == pytest.approx(b[1], rel=0.02) for a, b in zip(plain[:3], fsdp[:3])), curves


def test_loss_curve_equals_a_plain_training_loop(one_rank):
    """The product (one rank: the module itself, chunked loss, fused AdamW, device-side checks) takes the losses
    of a textbook loop: fms LLaMA, full-logit cross entropy, foreach AdamW, torch's clipping."""
    cfg = parse_args([*TINY, f"--num_steps={STEPS}", "--batch_size=4"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = LLaMA(get_model_config(cfg.model_variant, cfg.vocab_size))
        model.base_model.embedding.padding_idx = None  # every row trains, as in transformers' Llama
        init_weights(model, cfg.seed)
        optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=cfg.learning_rate,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
            foreach=True,
        )
        scheduler = build_scheduler(optimizer, schedule_of(cfg))
        batches = iter(
            DummyDataLoader(
                batch_size=cfg.batch_size,
                seq_length=cfg.seq_length,
                vocab_size=cfg.vocab_size,
                seed=cfg.seed,
                rank=0,
                world_size=1,
            )
        )
        reference = []
        for _ in range(STEPS):
            inputs, labels = next(batches)
            loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip_thresh)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            reference.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    assert reference[-1] < reference[0] - 2.0
    for a, b in zip(losses(one_rank), reference, strict=True):
        assert a == pytest.approx(b, rel=1e-4)


def test_a_run_called_from_python_leaves_the_signal_handlers_as_it_found_them(tmp):
    def mine(signum, frame):
        pass

    found = {sig: signal.signal(sig, mine) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        train_here(tmp, ["--num_steps=1"])
        assert signal.getsignal(signal.SIGTERM) is mine and signal.getsignal(signal.SIGUSR1) is mine
    finally:
        for sig, handler in found.items():
            signal.signal(sig, handler)


def test_sequences_longer_than_the_variants_rotary_cache(tmp):
    """tiny's rotary cache holds 1024 positions: a 2048-token run sizes it to --seq_length, says so at
    start, and its Hugging Face export records the trained length."""
    from fms_fsdp.weights.hf import convert

    out = tmp / "run"
    said = run_here(["--num_steps=1", "--batch_size=1", "--seq_length=2048", f"--ckpt_save_path={out}"])
    (record,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert math.isfinite(record["loss"]) and record["tokens_seen"] == 2048
    assert "note: --seq_length=2048 is beyond tiny's 1024 positions" in said
    hf = convert(str(out / "checkpoints" / "step_1_ckp"), str(tmp / "hf"), dtype="fp32")
    assert json.loads((hf / "config.json").read_text())["max_position_embeddings"] == 2048
    assert all((p.stat().st_mode & 0o777) == 0o666 & ~umask() for p in hf.iterdir())  # as any file: the umask


def test_out_of_memory_is_one_line_naming_the_step_the_allocation_and_the_flags():
    error = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 15.66 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
        "3.12 GiB is free. Including non-PyTorch memory, this process has 76.06 GiB memory in use."
    )
    cfg = parse_args([*TINY, "--batch_size=8", "--fsdp_activation_checkpointing=True", "--selective_checkpointing=1/2"])
    message = str(out_of_memory_error(12, error, cfg.batch_size, Fraction(1, 2), torch.device("cpu")))
    assert "\n" not in message
    assert message.startswith("step 12: out of memory allocating 15.66 GiB on cpu")
    assert "--batch_size (now 8)" in message and "--selective_checkpointing=1" in message
    assert "shard over more GPUs" in str(out_of_memory_error(1, error, 8, Fraction(1), torch.device("cpu")))


@pytest.mark.pinned_torch  # the package's own check of the loss
def test_non_finite_loss_stops_the_run_naming_the_step(tmp):
    proc = launch(
        "main_training.py",
        [*TINY, "--num_steps=30", "--learning_rate=1e30", "--grad_clip_thresh=0", f"--ckpt_save_path={tmp}"],
        nproc=2,
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert errors[0].startswith("error: step ") and "the loss or gradient norm is not finite" in errors[0]
    assert not (tmp / "checkpoints").exists() or not any((tmp / "checkpoints").iterdir())


@pytest.mark.slow
def test_profiler_writes_one_bounded_trace_per_rank_and_steps_take_no_collective_of_their_own(tmp):
    """3 profiled steps of 7, one trace per rank with --profiler_rank0_only=False. In those steps (no
    report, no clipping) every collective is FSDP's, but for the agreements on stop requests: a small
    all-reduce, at most one a step, which the ranks take only every AGREE_SECONDS of steps."""
    train(
        tmp,
        [
            "--num_steps=7",
            "--batch_size=2",
            "--use_profiler=True",
            "--profiler_rank0_only=False",
            f"--profiler_dir={tmp / 'prof'}",
            "--sharding_strategy=fsdp",
            "--grad_clip_thresh=0",
            "--report_interval=100",
        ],
        nproc=2,
    )
    for rank in (0, 1):
        traces = list((tmp / "prof").glob(f"rank{rank}.*.pt.trace.json"))
        assert len(traces) == 1, traces
        events = [e for e in json.loads(traces[0].read_text())["traceEvents"] if e.get("ph") == "X"]
        steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
        assert {e["name"] for e in steps} == {"ProfilerStep#3", "ProfilerStep#4", "ProfilerStep#5"}, steps
        fsdp = [e for e in events if e["name"].startswith("FSDP::")]
        collectives = [e for e in events if e["name"].startswith("c10d::")]
        ours = [e for e in collectives if not any(inside(e, f) for f in fsdp)]
        assert len(collectives) - len(ours) >= 3 * 16  # a step: 10 all-gathers, 6 reduce-scatters (and more)
        # the agreement (resilience/triggers.py): a handful of figures in one all-reduce, at most one a step. How many
        # fall in the profiled steps depends on the machine: the ranks agree every AGREE_SECONDS of steps as the
        # steps before measured them, so every step on a machine loaded enough that a step takes that long
        tensors = [e["args"]["Input Dims"][0] for e in ours]  # [[figures]]: one 1-D tensor
        assert all(len(t) == 1 and len(t[0]) == 1 and t[0][0] <= 8 for t in tensors), ours
        assert len(ours) <= len(steps), ours


def inside(e: dict, outer: dict) -> bool:
    return e["tid"] == outer["tid"] and outer["ts"] <= e["ts"] and e["ts"] + e["dur"] <= outer["ts"] + outer["dur"]


@pytest.mark.slow
def test_low_cpu_fsdp_never_holds_the_full_model(tmp):
    """`small` is 0.5 GB in fp32: built on the meta device, each of 2 ranks grows by about its half,
    never by the whole model (the eager path would)."""
    args = ["--model_variant=small", "--vocab_size=32000", "--sharding_strategy=fsdp", "--low_cpu_fsdp=True"]
    for r in inspect(tmp, args, nproc=2, weights=False)[0]:
        full_mb = r["full_numel"] * 4 / 2**20
        growth = r["peak_rss_after_build_mb"] - r["peak_rss_before_build_mb"]
        # measured on 2 cores: 0.75 x the model here, 1.11 x with --low_cpu_fsdp=False
        assert 0.4 * full_mb < growth < 0.9 * full_mb, (growth, full_mb)


def test_progress_bar_in_a_terminal(tmp):
    """Under a pseudo-terminal rank 0 draws a tqdm bar; metric lines still print."""
    args = " ".join([*TINY, "--num_steps=6", "--batch_size=2", f"--ckpt_save_path={tmp}"])
    proc = launch_in_terminal(f"stty cols 120 rows 40; {sys.executable} main_training.py {args}")
    assert "6/6 [" in proc.stdout and ("step/s" in proc.stdout or "s/step" in proc.stdout), proc.stdout[-2000:]
    assert "step 6 | loss" in proc.stdout


def launch_in_terminal(command: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        ["script", "-qec", command, "/dev/null"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
