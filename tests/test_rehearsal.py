"""--dry_run's rehearsal (memory/rehearsal.py): the start's own parallelisation under torch's fake process
group of --plan_world_size ranks, one rank per pipeline stage. Its shards' parameters, gradients and
optimizer state against the analytic plan (memory/plan.py) on FSDP, HSDP, TP, PP and CP meshes; a config
error that only the wrapping meets, in one line as at a real start; and (slow) llama3.1_405b on 1,024
ranks, PP 8 x TP 8, in under 5 minutes, and mixtral_8x22b on 256."""

import os
import re
import time
from dataclasses import replace

import pytest

from fms_fsdp.errors import ConfigError
from fms_fsdp.flags import make_config
from fms_fsdp.memory.plan import Planner, State
from fms_fsdp.memory.rehearsal import rehearse
from fms_fsdp.memory.report import report
from fms_fsdp.model.variants import count_params, get_model_config
from fms_fsdp.startup import facts, model_build

from conftest import ROOT, launch

# the analytic plan within 1% of the real shards' bytes: this test's own bound, not the package's AGREEMENT (which
# only decides when the report warns)
AGREE = 0.01

MESHES = {
    "fsdp": dict(plan_world_size=8),
    "hsdp, muon": dict(plan_world_size=16, sharding_strategy="hsdp", sharding_group_size=4, optimizer="muon"),
    "fsdp x tp": dict(plan_world_size=8, tensor_parallel_size=2),
    "pp x fsdp": dict(plan_world_size=8, pipeline_parallel_size=2, batch_size=4),
    "fsdp x cp": dict(plan_world_size=8, context_parallel_size=2),
    "moe, fsdp": dict(plan_world_size=8, model_variant="tiny_moe"),
    "small_moe, fsdp": dict(plan_world_size=8, model_variant="small_moe"),
    "mixtral_8x7b, ep x fsdp": dict(plan_world_size=64, model_variant="mixtral_8x7b", expert_parallel_size=8),
    "moe, pp x hsdp": dict(
        plan_world_size=16,
        model_variant="tiny_moe",
        pipeline_parallel_size=2,
        sharding_strategy="hsdp",
        sharding_group_size=4,
        batch_size=4,
    ),
    "moe, ep x hsdp": dict(
        plan_world_size=16,
        model_variant="tiny_moe",
        sharding_strategy="hsdp",
        sharding_group_size=4,
        expert_parallel_size=2,
    ),
}


def rehearsed(**flags):
    cfg = make_config(
        **{
            "dry_run": True,
            "model_variant": "tiny",
            "seq_length": 256,
            "use_torch_compile": False,
            "sharding_strategy": "fsdp",
            **flags,
        }
    )
    run = facts(cfg)
    return cfg, run, rehearse_run(run)


def rehearse_run(run):
    return rehearse(model_build(run), optimizer=run.settings.optimizer, world_size=run.info.world_size, log=print)


@pytest.mark.parametrize("mesh", MESHES)
def test_the_real_shards_agree_with_the_analytic_plan(mesh):
    cfg, run, states = rehearsed(**MESHES[mesh])
    assert len(states) == run.shape.pp
    for pp_rank, state in enumerate(states):
        analytic = Planner(run.settings.memory, run.shape, run.model_config, run.pipeline, 1 << 40, pp_rank).state
        assert state.gap(analytic) <= AGREE, (state, analytic)
        assert state.grads == state.params  # every parameter trained, its gradient shard fp32 like it
        if cfg.optimizer == "adamw":
            assert state.optimizer == 2 * state.params
        else:  # Muon keeps one buffer for the blocks' matrices
            assert state.params < state.optimizer < 2 * state.params
    # the shards split the fp32 model over shard x cp x tp (the norms, whole on every TP rank, a little more)
    sharing = run.shape.shard * run.shape.cp * run.shape.tp
    whole = 4 * count_params(run.model_config)
    assert whole / sharing <= sum(s.params for s in states) < 1.02 * whole / sharing
    if run.shape.pp > 1:  # the embedding on the first stage, the head on the last: not alike
        assert states[0] != states[1]


def test_the_plan_counts_the_real_shards_and_warns_where_the_analytic_figures_stray():
    cfg, run, (state,) = rehearsed(plan_world_size=8, plan_device_memory_gib=80)
    text = report(run.settings.memory, run.shape, run.model_config, run.pipeline, 8, [state]).text
    fields = dict(item.split("=") for item in text.splitlines()[-1].split()[1:])
    assert (int(fields["params_bytes"]), int(fields["grads_bytes"]), int(fields["optimizer_bytes"])) == (
        state.params,
        state.grads,
        state.optimizer,
    )
    assert "the rehearsal's real shards; the analytic plan within 0.00% of them" in text
    assert "warning" not in text
    strayed = State(2 * state.params, state.grads, state.optimizer)
    text = report(run.settings.memory, run.shape, run.model_config, run.pipeline, 8, [strayed]).text
    assert f"params_bytes={strayed.params} " in text.splitlines()[-1]
    assert (
        f"warning: pipeline rank 0's real shards hold {strayed.params}, {state.grads} and {state.optimizer} bytes "
        f"of parameters, gradients and optimizer state; the analytic plan {state.params}, {state.grads} and "
        f"{state.optimizer} (50.0% apart): the plan uses the real ones; please report this"
    ) in text.splitlines()


@pytest.mark.slow
def test_a_dry_run_without_torchao_fails_in_one_line_where_float8_wraps_the_model(tmp_path):
    """--float8 needs torchao: a real start checks for it up front; a dry run, which may be planned on
    another machine, meets it only when the rehearsal converts the Linear layers, and ends in the same
    line and status. (A torchao that cannot be imported shadows the installed one here.)"""
    shadow = tmp_path / "shadow" / "torchao"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('no torchao here', name='torchao')\n")
    flags = ["--dry_run=True", "--model_variant=tiny", "--plan_world_size=8", "--float8=True"]
    proc = launch(
        "main_training.py",
        [*flags, "--use_torch_compile=False", "--device=cpu"],
        None,
        extra_env={"PYTHONPATH": os.pathsep.join([str(tmp_path / "shadow"), str(ROOT)])},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.endswith("error: --float8=True needs torchao: pip install 'fms-fsdp[float8]' (or torchao)\n")


def test_what_torch_raises_while_wrapping_is_one_line_naming_the_rank():
    """A pipeline split for more blocks than the model has (which the start-up checks refuse; here
    forced past them): the second pipeline rank's last stage names block 3 of a model of 3, and its
    wrapping fails there: one line, no traceback."""
    cfg = make_config(dry_run=True, model_variant="tiny", plan_world_size=2, pipeline_parallel_size=2, batch_size=4)
    run = facts(cfg)
    assert run.pipeline is not None and run.pipeline.blocks == ((0, 1), (1, 2), (2, 3), (3, 4))
    with pytest.raises(ConfigError) as e:
        rehearse_run(replace(run, model_config=replace(run.model_config, nlayers=3)))
    message = str(e.value)
    assert message == (
        "--dry_run: these flags fail at the start of rank 1 of 2, where the model is parallelised: "
        "IndexError: index 3 is out of range"
    )


@pytest.mark.slow
def test_llama3_405b_on_1024_ranks_is_rehearsed_in_under_5_minutes():
    started = time.monotonic()
    proc = launch(
        "main_training.py",
        [
            "--dry_run=True",
            "--model_variant=llama3.1_405b",
            "--plan_world_size=1024",
            "--pipeline_parallel_size=8",
            "--tensor_parallel_size=8",
            "--sharding_strategy=fsdp",
            "--seq_length=8192",
            "--batch_size=16",
            "--fsdp_activation_checkpointing=True",
            "--plan_device_memory_gib=80",
        ],
        None,
        timeout=300,
    )
    seconds = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert seconds < 300
    out = proc.stdout
    assert (
        "mesh (pp, replicate, shard, tp) = (8, 1, 16, 8): ranks 0, 128, 256, 384, 512, 640, 768, 896 (one per pipeline rank)"
        in out
    )
    assert re.search(r"the rehearsal's real shards; the analytic plan within 0\.\d\d% of them", out), out
    fields = dict(item.split("=") for item in out.splitlines()[-1].split()[1:])
    # pipeline rank 7's fp32 shards: its 15 blocks and the head, over 16 x 8 ranks
    model = get_model_config("llama3.1_405b")
    assert int(fields["params_bytes"]) == pytest.approx(4 * count_params(model) / 1024, rel=0.1)
    assert fields["fits"] == "true"


@pytest.mark.slow
@pytest.mark.parametrize("ep", [1, 8])
def test_mixtral_8x22b_on_256_ranks_is_rehearsed_and_agrees_with_the_plan(ep):
    proc = launch(
        "main_training.py",
        [
            f"--expert_parallel_size={ep}",
            "--dry_run=True",
            "--model_variant=mixtral_8x22b",
            "--plan_world_size=256",
            "--sharding_strategy=fsdp",
            "--seq_length=4096",
            "--batch_size=1",
            "--fsdp_activation_checkpointing=True",
            "--plan_device_memory_gib=80",
        ],
        None,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the rehearsal's real shards; the analytic plan within 0.00% of them" in proc.stdout, proc.stdout
    fields = dict(item.split("=") for item in proc.stdout.splitlines()[-1].split()[1:])
    # every expert's rows sharded over the 256 ranks (with ep 8: over the 32 ranks holding the same experts),
    # a 256th of the fp32 model each, not whole experts
    whole = 4 * count_params(get_model_config("mixtral_8x22b"))
    assert int(fields["params_bytes"]) == pytest.approx(whole / 256, rel=0.01)
