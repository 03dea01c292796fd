"""Evaluation on held-out data: independent of world size and batch size, invisible to training."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from fms_fsdp.cli import evaluate as evaluate_main
from fms_fsdp.data.file_reader import Options
from fms_fsdp.data.shards import Dataset, Layout, scan
from fms_fsdp.data.sources import Source
from fms_fsdp.errors import ConfigError
from fms_fsdp.evaluation.evaluate import eval_lines
from fms_fsdp.flags import parse_args
from fms_fsdp.settings import packing_of

from conftest import TINY, here, records, run_here
from test_checkpoint import flags, losses, run


def evals(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "eval_loss" in r]


@pytest.mark.slow  # three runs of 1, 2 and 4 ranks (about 20 s): the slow tier
def test_evaluation_is_the_same_on_any_world_size_and_batch_size_and_leaves_training_alone(data, tmp_path, capsys):
    plain, evaluated, loaded = tmp_path / "plain", tmp_path / "evaluated", tmp_path / "loaded"
    run_here(flags(data, plain, "--num_steps=6"))
    output = run_here(flags(data, evaluated, "--num_steps=6", f"--eval_data_path={data}", "--eval_interval=4"))
    assert losses(evaluated) == losses(plain)  # the training loader, RNG and steps are untouched
    last = [r for r in records(plain) if "loss" in r][-1]  # and the tokens each dataset gave
    assert last["tokens/web"] > 0 and last["tokens/code"] > 0
    assert last["tokens/web"] + last["tokens/code"] == last["tokens_seen"]
    four, six = evals(evaluated)
    assert (four["step"], six["step"]) == (4, 6) and "eval step 6 | loss" in output
    # an evaluation's time is its own (eval_seconds), not in the step time of the interval it fell in
    steps = {r["step"]: r for r in records(evaluated) if "loss" in r}
    assert steps[4]["step_time"] < max(steps[s]["step_time"] for s in (2, 3, 5)) + 0.5 * four["eval_seconds"]
    assert six["eval_loss/web"] != six["eval_loss/code"] and six["eval_ppl"] == pytest.approx(
        math.exp(six["eval_loss"])
    )
    # the same weights (step 6, learning rate 0) evaluated by 2 ranks, 3 lines a forward pass instead of 4
    run(
        flags(
            data,
            loaded,
            f"--ckpt_load_path={plain / 'checkpoints' / 'step_6_ckp'}",
            "--learning_rate=0",
            "--num_steps=1",
            f"--eval_data_path={data}",
            "--eval_interval=1",
            "--eval_batch_size=3",
        )
    )
    (again,) = evals(loaded)
    assert again["eval_tokens"] == six["eval_tokens"]
    for key in ("eval_loss", "eval_loss/web", "eval_loss/code"):
        assert again[key] == pytest.approx(six[key], rel=1e-5), key
    # standalone (scripts/evaluate.py's entry point, in this process): the checkpoint's model, one line
    # per dataset and one for all
    with here() as out:
        evaluate_main(
            flags(
                data,
                tmp_path / "standalone",
                f"--eval_data_path={data}",
                f"--ckpt_load_path={plain / 'checkpoints' / 'step_6_ckp'}",
            )
        )
    found = dict(re.findall(r"^EVAL dataset=(\w+) loss=([\d.]+) ppl=[\d.]+ tokens=\d+$", out.getvalue(), re.M))
    assert not (tmp_path / "standalone" / "data_cache").exists()  # fms-evaluate caches only in --data_cache_dir
    assert found.keys() == {"web", "code", "all"}
    for name, key in (("web", "eval_loss/web"), ("code", "eval_loss/code"), ("all", "eval_loss")):
        assert float(found[name]) == pytest.approx(six[key], rel=1e-5), name
    with pytest.raises(SystemExit) as stopped:
        evaluate_main(flags(data, tmp_path / "none", f"--eval_data_path={data}"))
    assert stopped.value.code == 2
    assert "error: --ckpt_load_path and --eval_data_path or --eval_harness_tasks are needed" in capsys.readouterr().err


def test_eval_lines_and_flags(data):
    cfg = parse_args([*TINY, "--vocab_size=1024", "--seq_length=16"])
    layout = Layout("auto", Options(cfg.col_name))
    entries = scan([Source("web", str(data))], layout)
    web = Dataset("web", data, entries["web"], layout)
    lines = eval_lines(web, packing_of(cfg, 1024), None)
    assert lines.shape[1] == 17 and (lines[:-1] >= 0).all()  # only the last line is padded
    stream = lines.reshape(-1)
    first = int((stream != 10).argmax())
    assert first > 0 and stream[first] == 0 and stream[first + 1] == 11  # document 10, its eos, document 11
    assert eval_lines(web, packing_of(cfg, 1024), 3).shape == (3, 17)
    with pytest.raises(ConfigError, match="--eval_interval and --eval_data_path go together"):
        parse_args([*TINY, "--eval_interval=5"])
