"""benchmarks/throughput.py: settings of a sweep, and a sweep run whose failing setting is one line."""

import importlib.util

import pytest

from fms_fsdp.errors import ConfigError

from conftest import ROOT, TINY

spec = importlib.util.spec_from_file_location("throughput", ROOT / "benchmarks" / "throughput.py")
throughput = importlib.util.module_from_spec(spec)
spec.loader.exec_module(throughput)


def test_sweep_settings_are_every_combination_with_checkpointing_switched_by_its_fraction():
    settings = throughput.sweep_settings("batch_size:1,2,4; selective_checkpointing:0,1/2,1")
    assert len(settings) == 9
    assert settings[0] == ["--batch_size=1", "--fsdp_activation_checkpointing=False"]
    assert settings[1] == ["--batch_size=1", "--fsdp_activation_checkpointing=True", "--selective_checkpointing=1/2"]
    assert settings[-1] == ["--batch_size=4", "--fsdp_activation_checkpointing=True", "--selective_checkpointing=1"]
    for bad, message in [("batch_size", "not name:value"), ("batch:1,2", "unknown flag 'batch'"), (";", "no settings")]:
        with pytest.raises(ConfigError, match=message):
            throughput.sweep_settings(bad)


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
