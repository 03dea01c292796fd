"""benchmarks/throughput.py: settings of a sweep, and a sweep run whose failing setting is one line;
benchmarks/gpu_check.py's table of goals from real BENCH lines, and its one line without a GPU;
benchmarks/hf_io.py and benchmarks/moe.py run and print their figures."""

import importlib.util
import re
import subprocess
import sys

import pytest
import torch

from fms_fsdp.errors import ConfigError

from conftest import ROOT, TINY, launch


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


throughput, gpu_check = load("throughput"), load("gpu_check")


def test_sweep_settings_are_every_combination_with_checkpointing_switched_by_its_fraction():
    settings = throughput.sweep_settings("batch_size:1,2,4; selective_checkpointing:0,1/2,1")
    assert len(settings) == 9
    assert settings[0] == ["--batch_size=1", "--fsdp_activation_checkpointing=False"]
    assert settings[1] == ["--batch_size=1", "--fsdp_activation_checkpointing=True", "--selective_checkpointing=1/2"]
    assert settings[-1] == ["--batch_size=4", "--fsdp_activation_checkpointing=True", "--selective_checkpointing=1"]
    for bad, message in [("batch_size", "not name:value"), ("batch:1,2", "unknown flag 'batch'"), (";", "no settings")]:
        with pytest.raises(ConfigError, match=message):
            throughput.sweep_settings(bad)


@pytest.mark.slow
def test_a_sweep_prints_a_line_per_setting_and_the_best_and_writes_no_checkpoint(tmp_path, capsys):
    """--sharding_group_size=3 cannot divide one rank: that setting fails at start-up, in its line.
    The sweep's own process is this one; each setting runs in a process of its own."""
    out = tmp_path / "bench"
    throughput.main(
        [
            "--sweep=sharding_group_size:1,3",
            *TINY,
            "--num_steps=3",
            "--bench_skip=1",
            "--report_interval=2",
            f"--ckpt_save_path={out}",
        ]
    )
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3, lines
    assert (
        lines[0].startswith("BENCH setting=sharding_group_size=1 variant=tiny")
        and "tokens_per_sec_per_gpu=" in lines[0]
    )
    assert lines[1].startswith("BENCH setting=sharding_group_size=3 status=failed")
    assert "--sharding_group_size=3 does not divide the world size 1" in lines[1]
    assert lines[2] == "BEST " + lines[0].split(" ", 1)[1]
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    # gpu_check's table of this BENCH line as each of its settings: a figure per goal, met or not
    bench = gpu_check.parse_bench(lines[0])
    assert gpu_check.parse_bench("BENCH device=NVIDIA H100 80GB HBM3 tokens_per_sec_per_gpu=41.5 mfu=n/a") == {
        "device": "NVIDIA H100 80GB HBM3",
        "tokens_per_sec_per_gpu": "41.5",
        "mfu": "n/a",
    }
    tps = float(bench["tokens_per_sec_per_gpu"])
    results = {b.name: {**bench, "mfu": "0.6"} for b in gpu_check.BENCHES}
    results[gpu_check.BENCHES[3].name]["tokens_per_sec_per_gpu"] = str(1.3 * tps)  # float8 1.3x
    log = (
        "memory plan ['--ac']: planned 10.5 GiB, measured 10.0 GiB\nmemory plan ['--x']: planned 9 GiB, measured 10 GiB"
    )
    text = gpu_check.table(results, {}, gpu_check.plan_errors(log), "cpu")
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert rows["tokens/s/GPU, llama3_1.8b_4k bs 2 compile (torchtitan 0.2.2: 38,592; before: 30,553)"].endswith(
        f"| {gpu_check.figure_text(tps)} | >= 41,000 | NO |"  # a loaded machine's tokens/s can be under 100
    )
    assert rows["best llama3_1.8b_4k MFU"].endswith("| 0.600 | >= 0.55 | yes |")
    assert rows["float8 / bf16 tokens/s, llama3_3.2b_4k op AC"].endswith("| 1.300 | >= 1.25 | yes |")
    assert rows["memory plan's error vs torch.cuda.max_memory_allocated, worst of 3"].endswith(
        "| 0.100 | <= 0.1 | yes |"
    )
    missing = gpu_check.table({}, {gpu_check.BENCHES[0].name: "error: out of memory"}, [], "cpu")
    assert f"| {gpu_check.BENCHES[0].name} | error: out of memory |" in missing and "| no figure |" in missing


@pytest.mark.cpu_only
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what happens without a GPU")
def test_the_gpu_check_says_in_one_line_that_there_is_no_gpu():
    proc = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout == "", proc
    assert proc.stderr.startswith("gpu_check: no CUDA GPU is visible to torch") and proc.stderr.count("\n") == 1


def test_the_ledger_benchmark_counts_every_token_the_ranks_read(tmp_path):
    """benchmarks/ledger.py on 30 files, 2 ranks of 3 batches of 2 lines of 65 tokens: the ledger worked
    out from their states holds exactly the tokens they read."""
    flags = [f"--data_path={tmp_path / 'data'}", "--ranks=2", "--batches=3", "--seq_length=64", "--files=30"]
    ran = subprocess.run([sys.executable, "benchmarks/ledger.py", *flags], cwd=ROOT, capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr[-2000:]
    figures = dict(f.split("=") for f in ran.stdout.split())
    assert figures["tokens_read"] == f"{2 * 3 * 2 * 65}" and figures["documents_seen"].endswith("/1,500"), figures
    assert (
        0 < int(figures["documents_seen"].split("/")[0]) and int(figures["state_bytes_per_rank"].replace(",", "")) > 0
    )


@pytest.mark.slow
def test_the_hugging_face_io_benchmark_runs_and_prints_its_figures(tmp_path):
    """benchmarks/hf_io.py on `tiny`: a folder made, imported and exported by 2 ranks, converted offline."""
    folder, script = tmp_path / "hf", "benchmarks/hf_io.py"
    made = subprocess.run(
        [sys.executable, script, "make", "--model_variant=tiny", f"--folder={folder}"], cwd=ROOT, capture_output=True
    )
    assert made.returncode == 0, made.stderr[-2000:]
    flags = ["--device=cpu", "--mixed_precision=False", "--use_torch_compile=False"]
    ran = launch(script, ["run", "--model_variant=tiny", f"--folder={folder}", f"--out={tmp_path / 'out'}", *flags], 2)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    assert "BENCH variant=tiny world=2 import_s=" in ran.stdout
    offline = subprocess.run(
        [sys.executable, script, "offline", "--model_variant=tiny", f"--out={tmp_path / 'offline'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert offline.returncode == 0, offline.stderr[-2000:]
    assert "BENCH offline variant=tiny" in offline.stdout


@pytest.mark.slow  # about 19 s: the README's test command keeps within its budget
def test_the_checkpoint_benchmark_saves_exports_and_loads_and_prints_its_figures(tmp_path):
    """benchmarks/checkpoint.py on `tiny`, 2 ranks: sync and async saves, both exports, the load back."""
    flags = ["--model_variant=tiny", "--device=cpu", "--mixed_precision=False", "--use_torch_compile=False"]
    ran = launch("benchmarks/checkpoint.py", [*flags, "--vocab_size=256", f"--ckpt_save_path={tmp_path}"], 2)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    line = next(line for line in ran.stdout.splitlines() if line.startswith("BENCH "))
    figures = dict(item.split("=", 1) for item in line.split()[1:])
    for key in ("sync_stall_s", "async_stall_s", "export_fms_total_s", "export_hf_total_s", "load_s", "bytes"):
        assert float(figures[key]) > 0, (key, line)


@pytest.mark.slow  # 10 s of a model built four times
def test_the_moe_benchmark_times_the_dense_model_and_each_kernel_at_equal_flops():
    """benchmarks/moe.py at its smallest: the dense model first (1.00x), then each kernel of the sparse one,
    every row with the same FLOPs per token (the dense feed-forward is top_k experts wide)."""
    flags = ["--experts=2", "--batch_size=1", "--seq_length=16", "--steps=1", "--emb_dim=128", "--kernels=loop,grouped"]
    ran = subprocess.run([sys.executable, "benchmarks/moe.py", *flags], cwd=ROOT, capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr[-3000:]
    rows = [line for line in ran.stdout.splitlines() if " step " in line]
    assert [r.split("  ")[0].strip() for r in rows] == [
        "dense, ffn 2 experts wide",
        "2 experts, top-2, loop",
        "2 experts, top-2, grouped",
    ], ran.stdout
    assert " 1.00x " in rows[0]
    assert len({re.search(r"FLOPs/token +([\d.]+) M", r).group(1) for r in rows}) == 1, rows
