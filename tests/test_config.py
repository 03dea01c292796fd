"""Flags and config files: coercion, errors naming the flag, file + override precedence."""

import json
import subprocess
import sys
import time
from fractions import Fraction

import pytest
import torch
import yaml

from fms_fsdp.atomic import write_text_keeping_old
from fms_fsdp.config import FIELDS, is_object_storage, to_yaml
from fms_fsdp.errors import ConfigError
from fms_fsdp.flags import parse_args
from fms_fsdp.startup import facts
from fms_fsdp.storage import is_remote

from conftest import ROOT

BASE = ["--use_dummy_dataset=True", "--num_steps=10"]


def parse(*flags: str):
    return parse_args([*BASE, *flags])


def test_values_are_coerced_to_field_types():
    cfg = parse(
        "--mixed_precision=False",
        "--learning_rate=1e-4",
        "--selective_checkpointing=1/3",
        "--datasets=a,b",
        "--weights=1,1/3",
        "--strip_tokens=0,1",
        "--batch_size=8",
        "--seq_length=1e3",
        "--vocab_size=None",
    )
    assert cfg.mixed_precision is False
    assert cfg.learning_rate == 1e-4
    assert cfg.selective_checkpointing == "1/3"
    assert cfg.datasets == ["a", "b"]
    assert cfg.weights == [1.0, pytest.approx(1 / 3)]
    assert cfg.strip_tokens == [0, 1]
    assert cfg.batch_size == 8 and cfg.seq_length == 1000
    assert cfg.vocab_size is None


def test_fire_style_flag_forms():
    cfg = parse("--low_cpu_fsdp", "--nouse_torch_compile", "--num_steps", "7", "--model-variant=7b")
    assert cfg.low_cpu_fsdp is True
    assert cfg.use_torch_compile is False
    assert cfg.num_steps == 7
    assert cfg.model_variant == "7b"


def test_every_field_has_help_and_round_trips_through_a_file(tmp_path):
    cfg = parse()
    assert all(f.metadata["help"] for f in FIELDS.values())
    # and says whether fault-tolerance replica groups must share it (settings.SHARED_FLAGS is made of those)
    undecided = [name for name, f in FIELDS.items() if not isinstance(f.metadata.get("shared"), bool)]
    assert not undecided, f"say shared=True or shared=False for {undecided} (config._f)"
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    assert parse(f"--config={tmp_path / 'config.yaml'}") == cfg


def test_unknown_flag_names_it_and_suggests_the_nearest():
    with pytest.raises(ConfigError, match=r"unknown flag --lerning_rate; did you mean --learning_rate\?"):
        parse("--lerning_rate=1e-3")
    with pytest.raises(ConfigError, match="unknown flag --zzz"):
        parse("--zzz=1")


@pytest.mark.parametrize(
    "flag, message",
    [
        ("--batch_size=two", "--batch_size: expected int"),
        ("--batch_size=2.5", "--batch_size: expected int"),
        ("--batch_size=0", "--batch_size: must be >= 1"),
        ("--learning_rate=-1", "--learning_rate: must be >= 0"),
        ("--mixed_precision=maybe", "--mixed_precision: expected bool"),
        ("--sharding_strategy=zero3", "--sharding_strategy: 'zero3' is not one of fsdp, hsdp, ddp"),
        ("--selective_checkpointing=1/0", "--selective_checkpointing"),
        ("--selective_checkpointing=__import__('os').system('true')", "--selective_checkpointing"),
        ("--learning_rate=__import__('os')", "--learning_rate: expected float"),
        ("--adam_beta2=1", "--adam_beta2: must be < 1"),
        ("--weights=1,-1", "--weights: every weight must be > 0"),
        ("--num_steps=0", "--num_steps: must be >= 1"),
        ("--strip_tokens=a,b", "--strip_tokens: expected comma list of int"),
        ("--learning_rate=nan", "--learning_rate: expected float"),
        ("--decay_steps=50", "--decay_steps=50 is more than --num_steps=10"),
        ("--checkpoint_interval=0 --checkpoint_minutes=30", "--checkpoint_minutes needs checkpoints"),
        ("--optimizer_impl=adamw", "--optimizer_impl: 'adamw' is not one of auto, fused, foreach"),
    ],
)
def test_bad_values_name_the_flag(flag, message):
    with pytest.raises(ConfigError) as e:
        parse(*flag.split())
    assert message in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "flag, message",
    [
        (
            "--model_variant=llama9",
            "--model_variant: unknown variant 'llama9'; valid: micro, tiny, tiny_llama3, tiny_tied, tiny_mha, small, llama2_1.4b",
        ),
        ("--checkpoint_keep_policy=each 10", "--checkpoint_keep_policy: cannot read 'each 10'"),
    ],
)
def test_flags_judged_by_their_modules_fail_at_start_up(flag, message):
    """config.py imports nothing of the package: the modules that use these flags check them, through
    startup.facts, before any process group starts."""
    cfg = parse(flag)
    with pytest.raises(ConfigError) as e:
        facts(cfg)
    assert message in str(e.value)


def test_fms_fsdp_flags_without_a_meaning_here_are_accepted_with_a_note(capsys, tmp_path):
    assert parse("--resuming_dataset=True") == parse()
    assert "note: --resuming_dataset is accepted for fms-fsdp scripts and ignored" in capsys.readouterr().err
    (tmp_path / "run.yaml").write_text("training: {resuming_dataset: true, batch_size: 3}\n")  # in a file too
    assert parse(f"--config={tmp_path / 'run.yaml'}") == parse("--batch_size=3")
    assert f"note: --resuming_dataset (in {tmp_path / 'run.yaml'}) is accepted" in capsys.readouterr().err


def test_weights_and_datasets_lengths_must_agree():
    with pytest.raises(ConfigError, match="--weights has 1 values but --datasets names 2"):
        parse("--datasets=a,b", "--weights=1")


def test_a_brace_list_cut_at_its_comma_is_named_with_what_to_write_instead(tmp_path):
    with pytest.raises(ConfigError) as e:
        parse("--datasets=web=/d/web/*.jsonl,code=/d/{code,heldout}/*.jsonl", "--weights=1,1")
    assert str(e.value) == (
        "--datasets: code=/d/{code,heldout}/*.jsonl holds a brace list cut at its commas (commas separate datasets "
        "on the command line): join its patterns with '|' (code=/d/code/*.jsonl|/d/heldout/*.jsonl), or give "
        "--datasets as a list in a --config file"
    )
    # what it says to write works; so does the list in a config file, and a brace range has no comma
    assert parse("--datasets=web=/d/web/*.jsonl,code=/d/code/*.jsonl|/d/heldout/*.jsonl", "--weights=1,1")
    (tmp_path / "run.yaml").write_text("datasets: ['web=/d/web/*.jsonl', 'code=/d/{code,heldout}/*.jsonl']\n")
    assert parse(f"--config={tmp_path / 'run.yaml'}", "--weights=1,1").datasets[1] == "code=/d/{code,heldout}/*.jsonl"
    assert parse("--eval_datasets=a=/e/{000..003}.jsonl", "--eval_data_path=/e", "--eval_interval=5")


def test_keeping_the_best_checkpoints_needs_an_evaluation_at_their_steps():
    for flags in (
        ["--checkpoint_keep_best=2"],
        ["--checkpoint_keep_best=2", "--eval_data_path=x", "--eval_interval=150", "--checkpoint_interval=100"],
    ):
        with pytest.raises(
            ConfigError, match=r"--checkpoint_keep_best=2 ranks checkpoints by eval_loss .*--eval_data_path"
        ):
            parse(*flags)
    with pytest.raises(ConfigError, match=r"--checkpoint_monitor='loss': name an evaluation metric"):
        parse("--checkpoint_keep_best=1", "--checkpoint_monitor=loss")
    parse("--checkpoint_keep_best=2", "--eval_data_path=x", "--eval_interval=200", "--checkpoint_interval=100")


def test_file_then_flags_override(tmp_path):
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"batch_size": 3, "learning_rate": "1/1000", "seq_length": 128}))
    (tmp_path / "run.json").write_text(json.dumps({"batch_size": 5, "use_dummy_dataset": True}))
    cfg = parse(f"--config={tmp_path / 'run.yaml'}", "--batch_size=4")
    assert (cfg.batch_size, cfg.learning_rate, cfg.seq_length) == (4, 0.001, 128)
    cfg = parse_args([f"--config={tmp_path / 'run.json'}"])
    assert cfg.batch_size == 5 and cfg.use_dummy_dataset


def test_bad_config_files(tmp_path):
    (tmp_path / "typo.yaml").write_text("batch_sise: 3\n")
    (tmp_path / "broken.yaml").write_text("batch_size: [1,\n")
    with pytest.raises(ConfigError, match=r"unknown flag --batch_sise in .*typo.yaml; did you mean --batch_size"):
        parse(f"--config={tmp_path / 'typo.yaml'}")
    with pytest.raises(ConfigError, match="--config: cannot parse"):
        parse(f"--config={tmp_path / 'broken.yaml'}")
    with pytest.raises(ConfigError, match="--config: file not found"):
        parse(f"--config={tmp_path / 'none.yaml'}")


def test_config_files_include_others(tmp_path):
    """Levanter-style: sections and `!include` (relative to the including file, nested); a cycle or a
    missing file is one line naming it; flags still override; what is saved is the resolved config."""
    (tmp_path / "conf" / "data").mkdir(parents=True)
    (tmp_path / "conf" / "data" / "mix.yaml").write_text("datasets: web,code\nweights: 3,1\n")
    (tmp_path / "conf" / "data.yaml").write_text("data_path: /data\nmix: !include data/mix.yaml\n")
    (tmp_path / "conf" / "run.yaml").write_text(
        "model: {model_variant: tiny, seq_length: 128}\ndata: !include data.yaml\nbatch_size: 3\n"
    )
    cfg = parse(f"--config={tmp_path / 'conf' / 'run.yaml'}", "--batch_size=4")
    assert (cfg.model_variant, cfg.seq_length, cfg.data_path, cfg.datasets, cfg.weights, cfg.batch_size) == (
        "tiny",
        128,
        "/data",
        ["web", "code"],
        [3.0, 1.0],
        4,
    )
    saved = yaml.safe_load(to_yaml(cfg))
    assert saved["data_path"] == "/data" and saved["weights"] == [3.0, 1.0] and "!include" not in to_yaml(cfg)
    (tmp_path / "a.yaml").write_text("x: !include b.yaml\n")
    (tmp_path / "b.yaml").write_text("y: !include a.yaml\n")
    with pytest.raises(ConfigError, match=r"a.yaml includes itself: .*a.yaml -> .*b.yaml -> .*a.yaml$"):
        parse(f"--config={tmp_path / 'a.yaml'}")
    (tmp_path / "c.yaml").write_text("data: !include missing.yaml\n")
    with pytest.raises(ConfigError, match=r"file not found: .*missing.yaml \(included from .*c.yaml\)"):
        parse(f"--config={tmp_path / 'c.yaml'}")
    (tmp_path / "d.yaml").write_text("data: {batch_sise: 3}\n")
    with pytest.raises(ConfigError, match=r"unknown flag --batch_sise in .*d.yaml"):
        parse(f"--config={tmp_path / 'd.yaml'}")


def test_a_saved_config_never_overwrites_a_different_one(tmp_path):
    for batch_size in (3, 4, 4):
        write_text_keeping_old(tmp_path / "config.yaml", to_yaml(parse(f"--batch_size={batch_size}")))
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["batch_size"] == 4
    assert yaml.safe_load((tmp_path / "config.1.yaml").read_text())["batch_size"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.1.yaml", "config.yaml"]


def test_cli_error_is_one_line_before_any_process_group_starts():
    start = time.time()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "main_training.py"), "--use_dummy_dataset", "--lerning_rate=1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: unknown flag --lerning_rate; did you mean --learning_rate?"
    assert proc.stdout == ""
    assert time.time() - start < 60


def test_memory_snapshot_without_a_gpu_is_refused_before_training():
    from fms_fsdp.profiling import check_profiler
    from fms_fsdp.settings import settings_of

    with pytest.raises(ConfigError, match="add --use_profiler=True"):
        parse("--profiler_memory_snapshot", "--device=cuda")
    cfg = parse("--use_profiler", "--profiler_memory_snapshot")  # the device is known once resolved
    with pytest.raises(ConfigError, match="--profiler_memory_snapshot records the CUDA allocator: this run has no GPU"):
        check_profiler(settings_of(cfg, vocab_size=256).profiler, torch.device("cpu"))


def test_a_repeated_flag_takes_the_later_value():
    assert parse("--batch_size=3", "--batch_size=5").batch_size == 5


def test_one_rule_says_which_paths_are_object_storage():
    """config's checks of path flags and storage's reads and writes go by the same rule."""
    for path, remote in [("s3://b/run", True), ("gs://b", True), ("file:///tmp/run", False), ("/tmp/run", False)]:
        assert is_object_storage(path) is remote and is_remote(path) is remote, path
    with pytest.raises(ConfigError, match="--profiler_dir: set a local folder: --ckpt_save_path=s3://b/run"):
        parse("--ckpt_save_path=s3://b/run", "--use_profiler=True")
    parse("--ckpt_save_path=file:///tmp/run", "--use_profiler=True")


def test_the_run_parses_each_fact_of_the_flags_once(monkeypatch):
    """startup.facts builds every component's settings once: the checkpointed fraction of blocks (the
    parallelism's and the memory plan's), the keep policy, the schedule's cycles and the lm-eval tasks
    are each parsed by one call, and --fault_tolerance's settings are built once, by the command line
    where it gives them."""
    import fms_fsdp.settings as settings
    import fms_fsdp.startup as run_module
    from fms_fsdp.checkpoint.policy import KeepPolicy

    calls: dict[str, int] = {}

    def counted(name: str, real):
        def call(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return real(*args, **kwargs)

        return call

    for name in ("parse_fraction", "cycle_starts", "task_names"):
        monkeypatch.setattr(settings, name, counted(name, getattr(settings, name)))
    monkeypatch.setattr(KeepPolicy, "parse", counted("KeepPolicy.parse", KeepPolicy.parse))
    monkeypatch.setattr(run_module, "ft_of", counted("ft_of", settings.ft_of))
    cfg = parse("--selective_checkpointing=1/2", "--fsdp_activation_checkpointing=True", "--lr_cycles=2")
    run = facts(cfg)
    assert calls == {"parse_fraction": 1, "cycle_starts": 1, "task_names": 1, "KeepPolicy.parse": 1, "ft_of": 1}
    assert run.settings.parallel.checkpointing == run.settings.memory.setting.fraction == Fraction(1, 2)
    calls.clear()
    ft_flags = ["--fault_tolerance=True", "--ft_replica_groups=2", "--ft_group_index=1", "--ft_lighthouse=head:29510"]
    cfg = parse("--dry_run=True", *ft_flags)  # a plan: torchft and a lighthouse are not needed
    given = settings.ft_of(cfg)  # as the command line builds them, to label each line with the group
    assert facts(cfg, ft=given).ft is given and "ft_of" not in calls
    assert given is not None and given.index == 1 and given.lighthouse == "http://head:29510"
