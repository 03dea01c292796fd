"""Every console script (fms_fsdp/cli.py), run as the installed command, ends bad input in one line and
the exit status of its kind: a bad flag (with a suggestion), bad data, a damaged checkpoint. They run a
few at a time to keep the suite short; tests/test_faults.py drives the faults of runs and checkpoints."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import ROOT, TINY

BIN = Path(sys.executable).parent
COMMANDS = (
    "fms-train",
    "fms-evaluate",
    "fms-prepare-data",
    "fms-inspect-data",
    "fms-plot-metrics",
    "fms-export-model",
    "fms-to-hf",
    "fms-compare-runs",
)


def run(command: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    return subprocess.run([str(BIN / command), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def damaged(uninterrupted, tmp_path_factory) -> Path:
    """A copy of a complete checkpoint whose shards lost their last three quarters (the model's tensors
    among them: a shard holds them first)."""
    folder = tmp_path_factory.mktemp("damaged") / "step_12_ckp"
    shutil.copytree(uninterrupted / "checkpoints" / "step_12_ckp", folder)
    for shard in folder.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 4])
    return folder


def test_every_command_ends_bad_input_in_one_line_and_its_status(data, uninterrupted, damaged, tmp_path):
    assert {p.name for p in BIN.iterdir()} >= set(COMMANDS), "the package's commands are installed (scripts/setup.sh)"
    bad_data = tmp_path / "bad_data"
    for name in ("code", "web"):
        (bad_data / name).mkdir(parents=True)
        (bad_data / name / "part0.arrow").write_bytes(b"ARROW1 but not really")
    no_records = tmp_path / "metrics.jsonl"
    no_records.write_text("not json\n")
    model = TINY + ["--vocab_size=1024", "--num_steps=2"]
    cases = {  # command and flags -> (status, what the one line says)
        ("fms-train", "--lerning_rate=1"): (2, "error: unknown flag --lerning_rate; did you mean --learning_rate?"),
        ("fms-evaluate", "--eval_data_pth=x"): (
            2,
            "error: unknown flag --eval_data_pth; did you mean --eval_data_path?",
        ),
        ("fms-prepare-data", "--inptu=x"): (2, "error: unknown flag --inptu; did you mean --input?"),
        ("fms-inspect-data", "--data_pth=x"): (2, "error: unknown flag --data_pth; did you mean --data_path?"),
        ("fms-plot-metrics", str(no_records), "--xx=tokens"): (2, "error: unknown flag --xx; did you mean --x?"),
        ("fms-export-model", "--load_pth=x"): (2, "error: unknown flag --load_pth; did you mean --load_path?"),
        ("fms-to-hf", "--save_pth=x"): (2, "error: unknown flag --save_pth; did you mean --save_path?"),
        ("fms-compare-runs", "a", "b", "--rtoll=1"): (2, "error: unknown flag --rtoll; did you mean --rtol?"),
        ("fms-prepare-data", f"--input={bad_data}", f"--output={tmp_path / 'prepared' / 'web'}", "--tokenizer=byte"): (
            2,
            f"error: --input={bad_data}: no ",
        ),
        ("fms-inspect-data", f"--data_path={tmp_path / 'missing'}"): (
            2,
            f"--data_path={tmp_path / 'missing'}: folder not found",
        ),
        ("fms-plot-metrics", str(no_records)): (2, f"error: {no_records}: no metric records in it"),
        # a damaged checkpoint
        (
            "fms-evaluate",
            *model,
            f"--ckpt_load_path={damaged}",
            f"--eval_data_path={data}",
            "--file_type=auto",
            f"--ckpt_save_path={tmp_path / 'eval_damaged'}",
        ): (1, f"error: --ckpt_load_path: {damaged}: {damaged}/__0_0.distcp is truncated"),
    }
    with ThreadPoolExecutor(3) as pool:
        done = {case: pool.submit(run, *case) for case in cases}
    for case, (status, line) in cases.items():
        proc = done[case].result()
        errors = [x for x in proc.stderr.splitlines() if x.strip()]
        assert (proc.returncode, len(errors)) == (status, 1), (case, proc.returncode, proc.stderr[-3000:])
        assert errors[0].startswith("error: ") and line in errors[0], (case, errors[0])
    assert {case[0] for case in cases} == set(COMMANDS)


def test_the_launch_script_ends_a_bad_flag_in_its_one_line_before_torchrun(tmp_path):
    """scripts/train.sh (and scripts/quickstart.sh, which runs it) reads the flags before torchrun starts:
    a typo is its one line and status 2, with no rank started and no torchrun summary after it."""
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "NPROC_PER_NODE": "2"}
    for flags in (["--config=scripts/quickstart.yaml"], []):  # a config file, or train.sh's own flags
        proc = subprocess.run(
            ["bash", "scripts/train.sh", *flags, "--lerning_rate=1e-3", f"--ckpt_save_path={tmp_path / 'run'}"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
        assert proc.stderr == "error: unknown flag --lerning_rate; did you mean --learning_rate?\n"
    assert "scripts/train.sh --config=scripts/quickstart.yaml" in (ROOT / "scripts" / "quickstart.sh").read_text()


def test_only_rank_0_shows_library_warnings_and_progress_bars():
    """A training rank other than 0 ignores warnings and draws no progress bar (tqdm reads TQDM_DISABLE
    once, at its import: the command sets it before importing anything that imports tqdm)."""
    code = (
        "import warnings, sys; from fms_fsdp.cli import quiet_library_noise; quiet_library_noise(); "
        "from tqdm import tqdm; warnings.warn('a library warning'); "
        "bar = tqdm(range(3)); print(bar.disable); list(bar)"
    )
    for rank, quiet in (("0", False), ("1", True)):
        env = {**os.environ, "RANK": rank, "PYTHONPATH": str(ROOT)}
        env.pop("TQDM_DISABLE", None)
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert proc.stdout == f"{quiet}\n", proc.stderr
        assert ("a library warning" in proc.stderr) != quiet and ("3/3" in proc.stderr) != quiet, proc.stderr


def test_each_command_has_its_own_help_and_a_closed_pipe_ends_quietly(tmp_path):
    """--help says the command's own usage (fms-evaluate: its flags, not all of training's); a reader that
    stops early (`| head`) ends the command with SIGPIPE's status and nothing on stderr."""
    helps = dict(zip(COMMANDS, ThreadPoolExecutor(4).map(lambda c: run(c, "--help"), COMMANDS)))
    for command, proc in helps.items():
        assert proc.returncode == 0 and proc.stdout.startswith("usage: "), (command, proc.stderr)
    train, evaluate = helps["fms-train"].stdout, helps["fms-evaluate"].stdout
    assert "main_training.py" in train.splitlines()[0] and "scripts/evaluate.py" in evaluate.splitlines()[0]
    flags = [line for line in evaluate.splitlines() if line.startswith("  --")]
    assert any(f.startswith("  --ckpt_load_path ") for f in flags) and any(
        f.startswith("  --eval_data_path ") for f in flags
    )
    assert not any(f.startswith(("  --learning_rate ", "  --checkpoint_interval ")) for f in flags)
    assert len(flags) < train.count("\n  --") * 2 / 3
    data = tmp_path / "data" / "ds"
    data.mkdir(parents=True)
    for f in range(2000):  # a table (110 KB) longer than a pipe's buffer (64 KiB) and Python's own (8 KiB)
        (data / f"part-{f:04d}.npy").write_bytes(bytes(range(1, 101)) * 2)  # uint16 ids 513 to 25957
    reader = subprocess.Popen(
        [str(BIN / "fms-inspect-data"), f"--data_path={data.parent}", "--vocab_size=32000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert reader.stdout is not None
    reader.stdout.readline()
    reader.stdout.close()  # as `head -1` does
    _, err = reader.communicate(timeout=120)
    assert reader.returncode == 141 and err == b"", err.decode()[-2000:]
