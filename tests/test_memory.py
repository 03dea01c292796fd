"""The memory plan (--dry_run): its activations against what autograd really saves in whole models
(tiny and small, every checkpointing mode, a micro-batch it did not trace), the dry run's output, its
suggestions and the start-up warning."""

import re
from fractions import Fraction

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker, _ModState

from fms_fsdp.cli import PLAN_DOES_NOT_FIT
from fms_fsdp.cli import train as main
from fms_fsdp.flags import make_config
from fms_fsdp.memory.plan import HEADROOM, Planner
from fms_fsdp.memory.report import fits_or_warning, report
from fms_fsdp.memory.settings import MemorySettings, Setting
from fms_fsdp.model.variants import build_model, get_model_config
from fms_fsdp.parallel.activation_checkpointing import apply_activation_checkpointing
from fms_fsdp.parallel.mesh import mesh_shape
from fms_fsdp.parallel.parallelize import apply_autocast
from fms_fsdp.parallel.pipeline import PipelinePlan
from fms_fsdp.settings import lora_of, memory_of, mesh_of, parallel_of, pipeline_of

from conftest import launch

BATCH, SEQ = 3, 128  # the plan traces micro-batches 1 and 2 only


def measured(variant: str, setting: Setting, bf16: bool = False) -> tuple[int, int]:
    """Whole real model on the CPU, fp32 (or bf16 through autocast, as one rank trains it):
    (activation bytes alive after forward outside the loss, bytes autograd's saved-tensor hooks see,
    loss included, without checkpointing)."""
    model = build_model(get_model_config(variant, None, SEQ), torch.device("cpu"))
    if setting.checkpointing:
        apply_activation_checkpointing(model, setting.fraction, setting.mode)
    if bf16:
        apply_autocast(model)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    tokens = torch.zeros(setting.batch, SEQ, dtype=torch.long)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        before = tracker.get_tracker_snapshot("current")
        loss = model(tokens, labels=tokens)
        after = tracker.get_tracker_snapshot("current")
    head = tracker.memory_tracking[model.head].snapshots
    (device,) = after
    loss_saved = head[_ModState.POST_FW][-1][device]["Total"] - head[_ModState.PRE_FW][-1][device]["Total"]
    del loss
    return after[device]["Activation"] - before[device]["Activation"] - loss_saved, sum(saved.values())


NONE, HALF_BLOCKS, ALL_OPS = (
    Setting(batch=BATCH, checkpointing=False, fraction=Fraction(0), mode="block"),
    Setting(batch=BATCH, checkpointing=True, fraction=Fraction(1, 2), mode="block"),
    Setting(batch=BATCH, checkpointing=True, fraction=Fraction(1), mode="op"),
)


def memory_settings(cfg) -> MemorySettings:
    """The plan's settings as startup.facts builds them."""
    return memory_of(cfg, parallel_of(cfg), lora_of(cfg))


def plan_for(cfg, world_size: int, ranks_per_node: int, device_bytes: int) -> Planner:
    """The plan of `cfg` on `world_size` ranks, nodes of `ranks_per_node`, devices of `device_bytes`."""
    shape = mesh_shape(mesh_of(cfg), world_size, ranks_per_node)
    model_config = get_model_config(cfg.model_variant, cfg.vocab_size, cfg.seq_length, shape.tp)
    return Planner(memory_settings(cfg), shape, model_config, None, device_bytes)


def warning_of(cfg, world_size: int, ranks_per_node: int):
    shape = mesh_shape(mesh_of(cfg), world_size, ranks_per_node)
    model_config = get_model_config(cfg.model_variant, cfg.vocab_size, cfg.seq_length, shape.tp)
    return fits_or_warning(memory_settings(cfg), shape, model_config, None, ranks_per_node)


@pytest.mark.parametrize(
    "variant, settings, bf16",
    [("tiny", [NONE, HALF_BLOCKS, ALL_OPS], False), ("small", [NONE], False), ("tiny", [NONE, HALF_BLOCKS], True)],
)
def test_planned_activations_are_within_10_percent_of_what_autograd_saves(variant, settings, bf16):
    cfg = make_config(model_variant=variant, seq_length=SEQ, batch_size=BATCH, mixed_precision=bf16, device="cpu")
    planner = plan_for(cfg, 1, 1, 1 << 40)
    for setting in settings:
        plan = planner.plan(setting)
        activations, hooked = measured(variant, setting, bf16)
        assert abs(plan.activations - activations) <= 0.1 * activations, (setting, plan.activations, activations)
        if not setting.checkpointing:  # the hooks see inside no checkpointed block
            assert abs(plan.activations + plan.loss_saved - hooked) <= 0.1 * hooked, (plan, hooked)


@pytest.mark.slow
def test_dry_run_prints_the_plan_and_one_plan_line_without_a_process_group(capsys):
    flags = [
        "--dry_run=True",
        "--model_variant=llama3_70b",
        "--plan_world_size=512",
        "--seq_length=8192",
        "--batch_size=1",
        "--fsdp_activation_checkpointing=True",
        "--plan_device_memory_gib=80",
    ]
    main([*flags, "--sharding_strategy=fsdp", "--ckpt_load_path=/on/the/cluster/only"])  # a plan needs no weights
    out = capsys.readouterr().out.splitlines()
    plan_lines = [line for line in out if line.startswith("PLAN ")]
    assert len(plan_lines) == 1 and out[-1] == plan_lines[0]
    fields = dict(item.split("=") for item in plan_lines[0].split()[1:])
    assert list(fields) == [
        "params_bytes",
        "grads_bytes",
        "optimizer_bytes",
        "gathered_bytes",
        "activations_bytes",
        "loss_bytes",
        "peak_bytes",
        "device_bytes",
        "fits",
    ]
    assert fields["fits"] == "true" and int(fields["device_bytes"]) == 80 * 2**30
    assert int(fields["params_bytes"]) == pytest.approx(70.6e9 * 4 / 512, rel=0.01)  # fp32 shards of 70.6B
    assert int(fields["optimizer_bytes"]) == 2 * int(fields["params_bytes"])
    assert any(line.strip().startswith("activations saved for backward") for line in out)
    # sharded over a node of 8 only: 16 bytes x 70B / 8 > 80 GiB, whatever the batch
    with pytest.raises(SystemExit) as status:
        main([*flags, "--sharding_strategy=hsdp", "--batch_size=4"])
    assert status.value.code == PLAN_DOES_NOT_FIT
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("PLAN ") and out.splitlines()[-1].endswith("fits=false")
    assert "fits=false" in out and "does NOT fit" in out and "lower --batch_size" not in out
    assert re.search(r"the model's state alone takes [\d.]+ GiB per rank; shard it over at least (\d+) ranks", out)
    assert int(re.search(r"at least (\d+) ranks", out).group(1)) in range(16, 25)  # 1.1 TB / (72 GiB - gathered)


def test_suggestions_are_the_edge_of_what_fits():
    cfg = make_config(model_variant="small", seq_length=512, batch_size=16, plan_device_memory_gib=5.0)
    planner = plan_for(cfg, 1, 1, 5 << 30)
    plain = Setting(batch=16, checkpointing=False, fraction=Fraction(0), mode="block")
    assert not planner.plan(plain).fits
    largest = planner.largest_batch(plain)
    assert planner.plan(Setting(batch=largest, checkpointing=False, fraction=Fraction(0), mode="block")).fits
    assert not planner.plan(Setting(batch=largest + 1, checkpointing=False, fraction=Fraction(0), mode="block")).fits
    least = planner.least_checkpointing(16)
    assert least is not None and planner.plan(least).fits and least.checkpointing
    assert "--batch_size=16 --fsdp_activation_checkpointing=True" in least.flags()


def test_lora_plans_gradients_and_optimizer_state_of_the_adapters_only():
    full = plan_for(make_config(model_variant="small", seq_length=512), 1, 1, 1 << 40)
    lora = plan_for(make_config(model_variant="small", seq_length=512, lora_rank=8, ckpt_load_path="x"), 1, 1, 1 << 40)
    assert lora.params >= full.params and lora.grads < 0.05 * full.grads and lora.optimizer == 2 * lora.grads


def test_a_run_that_will_not_fit_is_warned_about():
    tight = make_config(model_variant="small", seq_length=512, plan_device_memory_gib=0.5)  # traced above
    warning = warning_of(tight, 2, 2)
    assert warning.startswith("warning: the memory plan predicts a peak of") and "--dry_run=True" in warning
    assert warning_of(make_config(model_variant="small", seq_length=512, plan_device_memory_gib=100), 2, 2) is None


def test_tensor_parallel_plans_the_split_weights_and_activations():
    """8 ranks as FSDP 8, and as FSDP 4 x TP 2: the weights split 8 ways either way (the norms, whole
    on both ranks of a TP pair, a little more); activations and the loss's working set about halve."""
    fsdp = plan_for(make_config(model_variant="small", seq_length=512, sharding_strategy="fsdp"), 8, 8, 1 << 40)
    tp = plan_for(
        make_config(model_variant="small", seq_length=512, sharding_strategy="fsdp", tensor_parallel_size=2),
        8,
        8,
        1 << 40,
    )
    assert tp.mesh == (1, 4, 2, 1, 1, 1) and fsdp.params <= tp.params < 1.01 * fsdp.params and tp.grads == tp.params
    assert tp.gathered < 0.51 * fsdp.gathered  # a block gathered over the data-parallel ranks is half of it
    setting = Setting(batch=4, checkpointing=False, fraction=Fraction(0), mode="block")
    one, two = fsdp.plan(setting), tp.plan(setting)
    assert 0.5 * one.activations < two.activations < 0.75 * one.activations  # + the gathered inputs of the matmuls
    assert two.loss < one.loss


def test_muon_plans_one_buffer_for_the_blocks_matrices():
    adamw = plan_for(make_config(model_variant="small", seq_length=512), 1, 1, 1 << 40)
    muon = plan_for(make_config(model_variant="small", seq_length=512, optimizer="muon"), 1, 1, 1 << 40)
    model = build_model(get_model_config("small", None, 512), torch.device("meta"))
    matrices = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n and p.dim() == 2)
    assert adamw.optimizer - muon.optimizer == 4 * matrices > 0


def test_offloaded_activations_leave_the_device_and_are_suggested_where_recomputing_is_needed():
    """--ac_mode=offload: the chosen blocks' activations are counted on the host, not in the device's peak
    (one block's come back for its backward, as a recomputed block's would); where only whole-block
    recomputation fits, the report offers offloading the same blocks, with its host memory."""
    planner = plan_for(make_config(model_variant="small", seq_length=512), 1, 1, 1 << 40)
    plain, block, offload = (
        planner.plan(Setting(batch=4, checkpointing=m != "none", fraction=Fraction(1), mode=m))
        for m in ("none", "block", "offload")
    )
    assert offload.host > 0 == block.host == plain.host
    assert offload.activations < block.activations < plain.activations
    assert offload.host + offload.activations == pytest.approx(plain.activations, rel=0.05)  # the same bytes, elsewhere
    needed = (
        planner.plan(Setting(batch=16, checkpointing=True, fraction=Fraction(1), mode="block")).peak / HEADROOM * 1.01
    )  # only whole blocks fit
    cfg = make_config(model_variant="small", seq_length=512, batch_size=16, plan_device_memory_gib=needed / 2**30)
    shape = mesh_shape(mesh_of(cfg), 1, 1)
    text = report(memory_settings(cfg), shape, get_model_config("small", None, 512), None, 1).text
    assert (
        "fits --batch_size=16: --fsdp_activation_checkpointing=True --selective_checkpointing=1 --ac_mode=block" in text
    )
    assert re.search(r"or, recomputing nothing: .*--ac_mode=offload \(.*: [\d.]+ GiB of host memory per rank\)", text)


def test_the_weight_average_is_planned_beside_the_optimizers_state_of_what_trains():
    """--ema_decay: one more fp32 copy of the trained shards (with LoRA, of the adapters), none on the device
    with --ema_on_host."""
    for lora in ({}, {"lora_rank": 8, "ckpt_load_path": "x"}):
        small = dict(model_variant="small", seq_length=512, **lora)
        plain = plan_for(make_config(**small), 4, 4, 1 << 40)
        averaged = plan_for(make_config(**small, ema_decay=0.999), 4, 4, 1 << 40)
        assert averaged.optimizer - plain.optimizer == plain.grads > 0  # fp32 gradients: the trained shards
        assert averaged.plan(NONE).peak - plain.plan(NONE).peak == plain.grads
        on_host = plan_for(make_config(**small, ema_decay=0.999, ema_on_host=True), 4, 4, 1 << 40)
        assert on_host.plan(NONE).peak == plain.plan(NONE).peak


def test_context_parallel_plans_the_shared_weights_and_a_part_of_each_line():
    """8 ranks as FSDP 8, and as FSDP 4 x CP 2 on lines of 8192 tokens: the weights still shard 8 ways;
    a rank keeps about half the activations, plus the whole line's keys and values, and with document
    masking its part of the mask."""
    long = dict(model_variant="small", seq_length=8192, sharding_strategy="fsdp", use_torch_compile=False)
    fsdp = plan_for(make_config(**long), 8, 8, 1 << 40)
    cp = plan_for(make_config(**long, context_parallel_size=2), 8, 8, 1 << 40)
    docs = plan_for(make_config(**long, context_parallel_size=2, document_masking=True), 8, 8, 1 << 40)
    assert cp.mesh == (1, 4, 1, 2, 1, 1) and cp.params == fsdp.params
    setting = Setting(batch=1, checkpointing=False, fraction=Fraction(0), mode="block")
    one, two = fsdp.plan(setting), cp.plan(setting)
    assert 0.5 * one.activations < two.activations < 0.75 * one.activations and two.loss < one.loss
    assert docs.plan(setting).activations - two.activations == 8192 * 4096
    # compiled on the GPU, FlexAttention's BlockMask replaces the boolean mask
    flex = plan_for(
        make_config(**{**long, "use_torch_compile": True}, context_parallel_size=2, document_masking=True),
        8,
        8,
        1 << 40,
    )
    assert flex.plan(setting).activations == two.activations
    # the CPU's unmasked path gathers the keys and values again in the backward: none kept
    on_cpu = plan_for(make_config(**long, context_parallel_size=2, device="cpu"), 8, 8, 1 << 40).plan(setting)
    assert two.activations - on_cpu.activations == 12 * 8192 * cp.kv_width * cp.compute
    # ring attention passes them round the ranks on every device: none kept either
    ring = plan_for(make_config(**long, context_parallel_size=2, cp_attention="ring"), 8, 8, 1 << 40).plan(setting)
    assert ring.activations == on_cpu.activations


def test_pipeline_plans_each_stage_and_the_microbatches_its_schedule_keeps():
    """8 ranks as FSDP 4 x PP 2: each pipeline rank holds about half the weights (the embedding on the
    first, the head on the last), a microbatch's activations times those in flight (GPipe: all 8; 1F1B:
    2 on the first rank, 1 on the last), the loss only on the last; --dry_run names the highest peak."""
    base = dict(model_variant="small", seq_length=1024, sharding_strategy="fsdp", batch_size=8, use_torch_compile=False)
    whole = plan_for(make_config(**base), 4, 4, 1 << 40)
    setting = Setting(batch=8, checkpointing=False, fraction=Fraction(0), mode="block")

    def stages(schedule: str) -> list[Planner]:
        cfg = make_config(**base, pipeline_parallel_size=2, pipeline_schedule=schedule, pipeline_microbatches=8)
        shape = mesh_shape(mesh_of(cfg), 8, 8)
        model_config = get_model_config("small")
        plan = PipelinePlan.of(pipeline_of(cfg), model_config)
        return [Planner(memory_settings(cfg), shape, model_config, plan, 1 << 40, r) for r in range(2)]

    first, last = stages("1F1B")
    assert first.mesh == (1, 4, 1, 1, 2, 1) and first.first and not first.last and last.last
    assert abs(first.params + last.params - whole.params) < 0.01 * whole.params
    one, gpipe = [p.plan(setting) for p in (first, last)], stages("GPipe")[0].plan(setting)
    micro = whole.plan(
        Setting(batch=1, checkpointing=False, fraction=Fraction(0), mode="block")
    )  # one line per microbatch
    assert one[1].loss == micro.loss and one[0].loss == 0
    assert gpipe.activations == 4 * one[0].activations  # 8 microbatches in flight against 2
    cfg = make_config(
        **base, pipeline_parallel_size=2, pipeline_schedule="GPipe", pipeline_microbatches=8, plan_device_memory_gib=80
    )
    model_config = get_model_config("small")
    text = report(
        memory_settings(cfg),
        mesh_shape(mesh_of(cfg), 8, 8),
        model_config,
        PipelinePlan.of(pipeline_of(cfg), model_config),
        8,
    ).text
    peaks = [p.plan(setting).peak for p in stages("GPipe")]
    highest = peaks.index(max(peaks))
    assert f"pipeline rank {highest} of 2 has the highest peak" in text, text
    assert "8 of 8 microbatches of 1 lines in flight" in text


@pytest.mark.slow  # 14 s: two launches that plan and stop
def test_a_plan_ends_in_status_0_if_it_fits_else_3_and_counts_the_blocks_the_model_line_counts():
    """--dry_run's status says whether the plan fits (0, else PLAN_DOES_NOT_FIT = 3), with the PLAN line last
    either way; under pipeline parallelism the start's model
    line and the plan both count the checkpointed blocks among the blocks a rank holds."""
    assert PLAN_DOES_NOT_FIT == 3  # documented in docs/troubleshooting.md
    flags = [
        "--dry_run=True",
        "--model_variant=tiny",
        "--plan_world_size=4",
        "--pipeline_parallel_size=2",
        "--fsdp_activation_checkpointing=True",
        "--selective_checkpointing=0.5",
        "--batch_size=4",
    ]
    proc = launch("main_training.py", [*flags, "--plan_device_memory_gib=0.1"], None)
    assert proc.returncode == PLAN_DOES_NOT_FIT, proc.stderr[-3000:]
    out = proc.stdout.splitlines()
    assert out[-1].startswith("PLAN ") and out[-1].endswith("fits=false")
    lines = [next(line for line in out if line.startswith(head)) for head in ("model tiny:", "memory plan, per rank")]
    counts = [re.search(r"activation checkpointing: (\d+/\d+) blocks", line).group(1) for line in lines]
    assert counts == ["1/2", "1/2"], lines  # 4 blocks, 2 on each pipeline rank
    fits = launch("main_training.py", [*flags, "--plan_device_memory_gib=80"], None)
    assert fits.returncode == 0 and fits.stdout.splitlines()[-1].endswith("fits=true"), fits.stderr[-3000:]


def test_cpu_offload_plans_the_state_on_the_host_and_is_suggested_where_it_fits():
    """--cpu_offload: the same shards, left out of the device's peak; a plan that does not fit suggests it
    with the peak it would have (the report's arithmetic against the offloaded plan's own)."""
    flags = dict(model_variant="small", seq_length=512, batch_size=2, fsdp_activation_checkpointing=True)
    device = int(0.6 * 2**30)
    on_device = plan_for(make_config(**flags), 4, 4, device)
    offloaded = plan_for(make_config(**flags, cpu_offload=True), 4, 4, device)
    setting = Setting(batch=2, checkpointing=True, fraction=Fraction(1), mode="block")
    a, b = on_device.plan(setting), offloaded.plan(setting)
    assert (a.params, a.grads, a.optimizer, a.gathered) == (b.params, b.grads, b.optimizer, b.gathered)
    assert b.peak == a.peak - a.params - a.optimizer - max(a.activations + a.loss, a.grads) + a.activations + a.loss
    assert not a.fits and b.fits  # 0.6 GiB: with the state it does not fit, without it it does
    cfg = make_config(**flags, plan_device_memory_gib=0.6)
    shape = mesh_shape(mesh_of(cfg), 4, 4)
    text = report(memory_settings(cfg), shape, get_model_config("small", None, 512), None, 4).text
    offload = "with --cpu_offload=True (the state on the host, slower steps) the device's peak is"
    assert f"{offload} {b.peak / 2**30:.2f} GiB: fits" in text, text


def test_eight_bit_optimizer_states_are_planned_and_suggested_where_they_fit():
    """--optimizer_state_dtype=int8: AdamW's two buffers at a byte an element and a scale per 256 elements;
    a plan that does not fit with fp32 states suggests them, with the peak they give."""
    flags = dict(model_variant="small", seq_length=512, batch_size=2, fsdp_activation_checkpointing=True)
    fp32 = plan_for(make_config(**flags), 4, 4, 1 << 40)
    int8 = plan_for(make_config(**flags, optimizer_state_dtype="int8"), 4, 4, 1 << 40)
    assert int8.optimizer == int(fp32.optimizer * (1 + 4 / 256) / 4) > 0
    setting = Setting(batch=2, checkpointing=True, fraction=Fraction(1), mode="block")
    a, b = fp32.plan(setting), int8.plan(setting)
    assert a.peak - b.peak == a.optimizer - b.optimizer > 0
    # a save holds the 8-bit states' fp32 copy: the peak of a large model's short lines on few ranks
    large = plan_for(make_config(**{**flags, "model_variant": "llama2_7b"}, optimizer_state_dtype="int8"), 4, 4, 1)
    light = large.plan(Setting(batch=1, checkpointing=True, fraction=Fraction(1), mode="block"))
    step = light.params + light.optimizer + light.gathered + max(light.activations + light.loss, light.grads)
    assert light.peak == light.params + light.optimizer + 2 * light.grads > step
    gib = (a.peak + b.peak) / 2 / HEADROOM / 2**30  # fp32 states do not fit, 8-bit ones do
    cfg = make_config(**flags, plan_device_memory_gib=gib)
    text = report(
        memory_settings(cfg), mesh_shape(mesh_of(cfg), 4, 4), get_model_config("small", None, 512), None, 4
    ).text
    assert (
        f"with --optimizer_state_dtype=int8 (torchao's 8-bit AdamW states) the peak is {b.peak / 2**30:.2f} GiB: fits"
        in text
    ), text
