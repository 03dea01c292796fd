"""Every command's entry point, and what each kind of error ends in.

| command (console script)      | script                    | what runs                                  |
|-------------------------------|---------------------------|--------------------------------------------|
| fms-train                     | main_training.py          | train/loop.run_training (train/dry_run)    |
| fms-evaluate                  | scripts/evaluate.py       | cli._evaluate_checkpoint                   |
| fms-prepare-data              | scripts/prepare_data.py   | data/prepare/build.prepare_data            |
| fms-inspect-data              | scripts/inspect_data.py   | data/inspection.inspect_data, ledger.show_ledger (--ledger) |
| fms-plot-metrics              | scripts/plot_metrics.py   | metrics/plot.plot_runs                     |
| fms-export-model              | scripts/export_model.py   | checkpoint/export.export_checkpoint        |
| fms-compare-runs              | scripts/compare_runs.py   | metrics/compare.compare_runs               |
| fms-to-hf                     | fms_to_hf.py              | weights/hf.convert                         |
| fms-average-checkpoints       | scripts/average_checkpoints.py | checkpoint/average.average_checkpoints |
| fms-torchrun                  | scripts/train.sh          | launch.launch (torchrun)                   |

Every command reads its command line alike (flags.py: `--name=value`, typo suggestions, `--help`),
imports the heavy modules (torch, fms) only once its flags are read, and ends an error a user can act
on in one line, `error: <message>`, with the exit status of its kind (EXIT_STATUS, also in
docs/troubleshooting.md). Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import json
import os
import re
import select
import sys
import time
from functools import partial
from typing import Any, Callable, NoReturn, Optional, Sequence

from fms_fsdp.console import file_torchft_log, label_groups, quiet_library_noise
from fms_fsdp.errors import CheckpointError, ConfigError, DataError, HFError, TrackerError, TrainingError, first_line
from fms_fsdp.flags import format_help, parse_args, parse_call

# 2: the input is wrong (a flag, a file, the data, a tracker's setup): fix it and run again; 1: the
# work could not be done (a checkpoint or file that cannot be written or read, a diverged or lost run)
EXIT_STATUS: dict[type[Exception], int] = {
    ConfigError: 2,
    DataError: 2,
    HFError: 2,
    TrackerError: 2,
    CheckpointError: 1,
    TrainingError: 1,
}
USER_ERRORS = tuple(EXIT_STATUS)
PLAN_DOES_NOT_FIT = 3  # --dry_run: the plan's peak is beyond the device (its PLAN line says fits=false)
INTERRUPTED = 130  # Ctrl-C, as a shell reports it (128 + SIGINT)
PIPE_CLOSED = 141  # stdout's reader went away, as a shell reports a tool ended by SIGPIPE (128 + 13)
STORAGE_STATUS = 1  # a file or bucket that cannot be read or written (an OSError, an object-storage client's error)


def exit_status(error: Exception) -> int:
    return next(status for kind, status in EXIT_STATUS.items() if isinstance(error, kind))


def fail(error: Exception) -> NoReturn:
    """End the command on a user error: one line from rank 0 (or from the rank that alone found it)."""
    say(f"error: {error}", alone=getattr(error, "every_rank", True) is False)
    raise SystemExit(exit_status(error)) from None


def say(line: str, alone: bool = False) -> None:
    """Print a command's one error line on rank 0 (`alone`: on the rank that alone found it), and give
    it to torchrun on every failing rank, whose summary then shows it as the root cause."""
    rank = os.environ.get("RANK", "0")
    if rank == "0":
        print(line, file=sys.stderr, flush=True)
    elif alone:
        line = line.replace("error: ", f"error (rank {rank}): ", 1)
        print(line, file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")  # torch.distributed.elastic's error-file format
    if error_file:
        with open(error_file, "w") as f:
            said = {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}
            json.dump({"message": said}, f)


def stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader went away (poll says POLLERR); if so, stdout goes to
    /dev/null, so that the flush at exit raises no second error."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        closed = any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no file descriptor, or no poll on this platform
        return False
    if closed:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return closed


def guarded(work: Callable[[], Any]) -> None:
    """Run a command's work; its user errors, a lost peer and a storage failure end in one line."""
    try:
        work()
    except USER_ERRORS as e:
        fail(e)
    except KeyboardInterrupt:  # before the run handles Ctrl-C itself (resilience/triggers.py), or a tool's
        say("error: interrupted (Ctrl-C)")
        raise SystemExit(INTERRUPTED) from None
    except Exception as e:
        if isinstance(e, BrokenPipeError) and stdout_closed():  # `fms-inspect-data ... | head`: end quietly
            raise SystemExit(PIPE_CLOSED) from None
        if "torch" in sys.modules:
            from fms_fsdp.parallel.process_group import lost_peer

            if lost_peer(e):
                cause = re.sub(r"^\[[^\]]*\]\s*", "", first_line(e)).split(". This is typically")[0]  # gloo's path
                fail(
                    TrainingError(
                        f"lost contact with another rank ({cause}): a process or node of this run died "
                        "or hung, its log has the cause; run the same command again to resume from the "
                        "last checkpoint",
                        every_rank=False,
                    )
                )
        from fms_fsdp.storage import storage_error

        if not storage_error(e):
            raise
        say(f"error: {type(e).__name__}: {first_line(e)}")
        raise SystemExit(STORAGE_STATUS) from None


def _args(argv: Optional[Sequence[str]]) -> list[str]:
    return list(sys.argv[1:] if argv is None else argv)


def training_config(argv: Optional[Sequence[str]] = None, help_of: Callable[[], str] = format_help) -> Any:
    """The train_config of a training command line: --help prints the flags (`help_of`: the command's own
    help; status 0); a bad flag is one line and status 2 on every rank."""
    args = _args(argv)
    if any(a in ("-h", "--help") for a in args):
        print(help_of())
        raise SystemExit(0)
    try:
        return parse_args(args)
    except ConfigError as e:
        fail(e)


def check_flags(argv: Optional[Sequence[str]] = None) -> None:
    """The launch scripts' check before torchrun starts any rank: the training flags, read as fms-train
    reads them (no torch import). A bad one ends in its one line and status 2, with nothing after it
    (under torchrun every rank would print it, then torchrun its failure summary and status 1)."""
    training_config(argv)


# ------------------------------------------------------------------------------------ training


def train(argv: Optional[Sequence[str]] = None) -> None:
    """`fms-train`, main_training.py: flags -> config -> the run (or --dry_run's memory plan). A rank
    started by torchrun stops (saving, as on a preemption, then failing) if torchrun dies."""
    cfg = training_config(argv)

    def work() -> None:  # imported here: an unsupported torch is one line (compat.check_torch)
        quiet_library_noise()
        from fms_fsdp.context import Paths
        from fms_fsdp.lifetime import LAUNCHER_DIED, exit_with_parent
        from fms_fsdp.settings import ft_of
        from fms_fsdp.startup import facts
        from fms_fsdp.train.dry_run import dry_run
        from fms_fsdp.train.loop import run_training

        if "TORCHELASTIC_RUN_ID" in os.environ:
            exit_with_parent(LAUNCHER_DIED)
        ft = ft_of(cfg)  # built once, here: every line is labelled with the replica group from the start
        label_groups(ft)
        if ft is not None and not cfg.dry_run:
            file_torchft_log(Paths.of(cfg.ckpt_save_path, ft.index).torchft_log)
        if cfg.dry_run:
            if not dry_run(facts(cfg, ft=ft)):
                raise SystemExit(PLAN_DOES_NOT_FIT)
        else:
            run_training(lambda: facts(cfg, ft=ft))

    guarded(work)


def evaluate_help() -> str:
    """fms-evaluate's --help: its usage, and the flags of training it reads."""
    usage = (
        "usage: [torchrun [...]] scripts/evaluate.py --ckpt_load_path=<model> (--eval_data_path=<data> and/or "
        "--eval_harness_tasks=<tasks>) [--field=value ...]\n\n"
        "Evaluates a checkpoint folder, .safetensors/.pth file or Hugging Face folder (--ckpt_load_path) on\n"
        "held-out data and lm-eval tasks, and prints the figures. It reads training's flags; these are the ones\n"
        "it uses:"
    )
    return format_help(
        usage,
        sections=("model", "data", "parallelism", "evaluation", "LoRA"),
        names=("ckpt_load_path", "tokenizer_path"),
    )


def evaluate(argv: Optional[Sequence[str]] = None) -> None:
    """`fms-evaluate`, scripts/evaluate.py: training's flags (--eval_interval not needed; lm-eval's tasks by
    --eval_harness_tasks)."""
    args = _args(argv)
    if any(a.startswith("--eval_data_path") for a in args):
        args = ["--eval_interval=1", *args]  # evaluating is the point; a given --eval_interval still wins
    cfg = training_config(args, help_of=evaluate_help)

    def work() -> None:
        quiet_library_noise()
        from fms_fsdp.evaluation.evaluate import check_checkpoint_evaluation
        from fms_fsdp.settings import checkpoint_evaluation_of
        from fms_fsdp.startup import facts

        check_checkpoint_evaluation(checkpoint_evaluation_of(cfg))
        _evaluate_checkpoint(facts(cfg, run_cache=False))  # no data cache kept under --ckpt_save_path

    guarded(work)


def _evaluate_checkpoint(run: Any) -> None:
    """The model of --ckpt_load_path (a checkpoint folder, a safetensors/.pth file or a Hugging Face
    folder), built as training builds it, evaluated by every rank of the launch; rank 0 prints the lines
    of evaluation.evaluate.evaluation_lines."""
    from fms_fsdp.evaluation.evaluate import Evaluator, evaluate_once, evaluation_lines
    from fms_fsdp.evaluation.harness import HarnessEvaluator
    from fms_fsdp.startup import sharded_model, started
    from fms_fsdp.weights.load import load_weights

    load_path = run.settings.checkpoint.load_path
    assert load_path is not None, "check_checkpoint_evaluation: --ckpt_load_path is given"
    with started(run) as run:
        evaluator = Evaluator(run.settings.evaluation, run.info)
        harness = HarnessEvaluator(run.settings.harness, run.info)
        model = sharded_model(run)
        load_weights(model, load_path, run.variant)
        record = evaluate_once(model, evaluator, harness)
    for line in evaluation_lines(record):
        run.log(line)


# ------------------------------------------------------------------------------------ tools
# Each tool's flags are the keyword parameters of its function below (flags.parse_call); --help
# prints its docstring.


def tool(func: Callable[..., Any], argv: Optional[Sequence[str]] = None) -> None:
    """Run a tool function with its command line."""
    args = _args(argv)
    if any(a in ("-h", "--help") for a in args):
        print(f"usage: {func.__doc__}")
        raise SystemExit(0)
    try:
        positional, keywords = parse_call(func, args)
    except ConfigError as e:
        fail(e)
    guarded(lambda: func(*positional, **keywords))


def _prepare_data(
    input: str = "",
    output: str = "",
    tokenizer: str = "",
    text_field: str = "text",
    shard_tokens: int = 100_000_000,
    workers: Optional[int] = None,
    piece_bytes: int = 128 << 20,
    engine: str = "local",
    ray_address: Optional[str] = None,
    num_tasks: Optional[int] = None,
    task_index: Optional[int] = None,
    finalize: bool = False,
) -> None:
    """fms-prepare-data --input=raw/ --output=<data_path>/<dataset> --tokenizer=<folder or byte>

    --input         a file, a folder (searched recursively) or a glob of .jsonl, .jsonl.gz, .json (JSON lines),
                    .parquet (the --text_field column) and .txt/.md files (one document each); types can be mixed;
                    local or in object storage (s3://...)
    --output        <data_path>/<dataset>: the shards; <data_path>/meta/counts_<dataset>.csv lists them (local or
                    object storage)
    --tokenizer     a folder holding tokenizer.json (loaded offline; special tokens are not added), or byte:
                    token id = byte value of the UTF-8 text (vocabulary 256)
    --text_field    the JSON key / Parquet column holding the text
    --shard_tokens  a shard is closed once it holds this many tokens
    --piece_bytes   the unit of work: a larger uncompressed .jsonl or Parquet file is cut into pieces of about this
                    many bytes (the output depends on it, never on the engine or the number of workers or tasks)
    --workers       pieces tokenized in parallel on this machine (default: the number of CPUs); with --engine=ray
                    and no --ray_address, the CPUs of the local Ray
    --engine        local (this machine's process pool) or ray (tasks on a Ray cluster: pip install 'fms-fsdp[ray]')
    --ray_address   HOST:PORT of a running Ray cluster (ray start --head); none: a local Ray, started and stopped
    --num_tasks     this run is one of a job array's tasks (default: $SLURM_ARRAY_TASK_COUNT, else 1) ...
    --task_index    ... and does every num_tasks-th piece from this one (default: $SLURM_ARRAY_TASK_ID, else 0);
                    the task that finishes the last piece writes the counts
    --finalize      tokenize nothing: write the counts once every piece is finished (or say what is left)
    """
    from fms_fsdp.data.prepare.build import prepare_data

    prepare_data(
        input,
        output,
        tokenizer,
        text_field,
        shard_tokens,
        workers,
        piece_bytes=piece_bytes,
        engine=engine,
        ray_address=ray_address,
        num_tasks=num_tasks,
        task_index=task_index,
        finalize=finalize,
    )


def _inspect_data(
    data_path: str = "",
    datasets: Optional[list[str]] = None,
    vocab_size: Optional[int] = None,
    eos_token: Optional[int] = 0,
    bos_token: Optional[int] = None,
    col_name: str = "tokens",
    token_dtype: str = "auto",
    ledger: Optional[str] = None,
    compare: Optional[str] = None,
    list_documents: bool = False,
) -> None:
    """fms-inspect-data --data_path=<folder> [--datasets=a,b] [--vocab_size=N]
       fms-inspect-data --ledger=<checkpoint>[,<group's checkpoint>...] [--compare=<checkpoint>] [--list_documents]

    --data_path   the folder holding one sub-folder per dataset (and meta/)
    --datasets    comma list of dataset folders (default: all but meta)
    --vocab_size  flag ids >= this (not checked when not given)
    --eos_token   the separator the loader adds after each document (None: none)
    --bos_token   the token the loader puts before each document (None: none)
    --col_name    the column holding the token ids (Arrow, Parquet)
    --token_dtype the dtype of headerless .npy token arrays (auto: uint16 when --vocab_size <= 65536, else uint32)
    --ledger      the documents a checkpoint's run has consumed, per dataset (its data read from --data_path
                  when given, else where the run read it); --compare: against another checkpoint's;
                  --list_documents: every document seen (file:index, times, tokens)
    """
    if (compare or list_documents) and not ledger:
        raise ConfigError("--compare and --list_documents read a checkpoint's ledger: give --ledger=<checkpoint>")
    if ledger:
        from fms_fsdp.ledger import show_ledger

        return show_ledger(ledger, compare, list_documents, data_path or None)
    from fms_fsdp.data.inspection import inspect_data

    inspect_data(data_path, datasets, vocab_size, eos_token, bos_token, col_name, token_dtype)


def _plot_metrics(*paths: str, o: str = "curves.png", x: str = "step") -> None:
    """fms-plot-metrics RUN1/metrics.jsonl [RUN2 ...] -o curves.png [--x=tokens]

    RUN         a run's metrics.jsonl or its --ckpt_save_path folder (a path or an object-storage URL)
    -o          the image to write
    --x         step or tokens
    """
    from fms_fsdp.metrics.plot import plot_runs

    print(f"wrote {plot_runs(list(paths), o, x)}")


def _compare_runs(*runs: str, steps: Optional[int] = None, rtol: float = 1e-3, atol: float = 1e-6) -> None:
    """fms-compare-runs A B [--steps=N] [--rtol=1e-3] [--atol=1e-6]

    A, B        two runs' metrics.jsonl or --ckpt_save_path folders (paths or object-storage URLs); B the
                reference
    --steps     compare the first N steps both runs have (default: every one)
    --rtol      the tolerance, as numpy.isclose: |A - B| <= atol + rtol x |B|, for the loss and the
    --atol      gradient norm; status 0 within it, 1 beyond
    """
    from fms_fsdp.metrics.compare import compare_runs

    if len(runs) != 2:
        raise ConfigError(f"give two runs, A and B (got {len(runs)}): their metrics.jsonl or --ckpt_save_path folders")
    if not compare_runs(*runs, steps=steps, rtol=rtol, atol=atol):
        raise SystemExit(1)


def _export_model(load_path: str = "", save_path: str = "", ema: bool = False) -> None:
    """fms-export-model --load_path=<ckpt_save_path>/checkpoints/step_N_ckp --save_path=model.safetensors

    --load_path   a checkpoint folder (this package's or fms-fsdp's; a path or an object-storage URL)
    --save_path   the safetensors file to write
    --ema         export the checkpoint's weight average (a run with --ema_decay) instead of its weights
    """
    from fms_fsdp.checkpoint.export import export_checkpoint

    print(export_checkpoint(load_path, save_path, ema))


def _to_hf(
    load_path: str = "",
    save_path: str = "",
    model_variant: Optional[str] = None,
    vocab_size: Optional[int] = None,
    tokenizer_name_or_path: Optional[str] = None,
    dtype: str = "bf16",
) -> None:
    """fms-to-hf --load_path=<checkpoint folder or model file> --save_path=<new folder>

    --load_path               a checkpoint folder, or a .safetensors/.pth model file
    --save_path               the Hugging Face folder to write (new, or empty)
    --model_variant           the variant (default: the one the checkpoint records)
    --vocab_size              the vocabulary size (default: the one the checkpoint records)
    --tokenizer_name_or_path  a local tokenizer folder, copied in; its bos/eos ids go to the config
    --dtype                   bf16, fp32 or fp16
    """
    from fms_fsdp.weights.hf import convert

    print(f"wrote {convert(load_path, save_path, model_variant, vocab_size, tokenizer_name_or_path, dtype)}")


def _average_checkpoints(*checkpoints: str, out: str = "", weights: str = "") -> None:
    """fms-average-checkpoints CKPT CKPT [...] --out=<new checkpoint folder> [--weights=1,1,...]

    CKPT       step_N_ckp folders of one run; under torchrun every rank averages its own slices
    --out      the checkpoint folder to write: the average with the rest of the last CKPT's state
    --weights  one weight per CKPT, in their order (default: equal); they are scaled to sum to 1
    """
    from fms_fsdp.checkpoint.average import average_command

    average_command(list(checkpoints), out, weights)


# the console scripts (pyproject.toml) and scripts/*.py: each tool with its command line (argv: sys.argv's)
prepare_data, inspect_data = partial(tool, _prepare_data), partial(tool, _inspect_data)
plot_metrics, compare_runs = partial(tool, _plot_metrics), partial(tool, _compare_runs)
export_model, to_hf = partial(tool, _export_model), partial(tool, _to_hf)
average_checkpoints = partial(tool, _average_checkpoints)


def torchrun(argv: Optional[Sequence[str]] = None) -> None:
    """`fms-torchrun`: torchrun's own command line, ending in the ranks' one line and status (launch.py)."""

    def work() -> None:
        from fms_fsdp.launch import launch

        raise SystemExit(launch(_args(argv)))

    guarded(work)
