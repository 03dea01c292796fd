"""Learning-rate schedules: fms-fsdp's values, WSD, and short runs."""

import math

import pytest
import torch

from fms_fsdp.errors import ConfigError
from fms_fsdp.flags import parse_args
from fms_fsdp.schedule import build_scheduler, lr_multiplier
from fms_fsdp.settings import schedule_of


def schedule(*flags):
    return lr_multiplier(schedule_of(parse_args(["--use_dummy_dataset", *flags])))


def fms_fsdp_initial(x, n):
    w = min(2000, n // 20)
    return min(1 - (1 - min(x, w) / w) ** 2, 0.1 + 0.5 * (1 - 0.1) * (1 + math.cos(min(x, n) * math.pi / n)))


@pytest.mark.parametrize("x", [0, 1, 50, 999, 1000, 1001, 5000, 12345, 19999, 20000])
def test_initial_stage_equals_fms_fsdp(x):
    assert schedule("--num_steps=20000")(x) == pytest.approx(fms_fsdp_initial(x, 20000), abs=1e-12)


def test_chosen_values():
    f = schedule("--num_steps=100000")
    assert f(0) == 0.0
    assert f(1000) == pytest.approx(0.75)  # quadratic warmup, half way
    assert f(2000) == pytest.approx(1.0, abs=1e-3)
    assert f(50000) == pytest.approx(0.55)
    assert f(100000) == pytest.approx(0.1)
    g = schedule("--num_steps=100", "--training_stage=annealing")
    assert [g(0), g(25), g(99)] == [1.0, 0.75, pytest.approx(0.01)]


def test_wsd():
    f = schedule("--num_steps=100", "--lr_schedule=wsd", "--warmup_steps=10", "--decay_steps=20", "--min_lr_ratio=0.2")
    assert f(5) == pytest.approx(0.75)
    assert f(10) == f(50) == f(80) == 1.0
    assert f(90) == pytest.approx(0.6)
    assert f(100) == pytest.approx(0.2)
    c = schedule("--num_steps=100", "--lr_schedule=constant", "--warmup_steps=0")
    assert c(0) == c(99) == 1.0


SCHEDULES = [
    (),
    ("--lr_schedule=wsd",),
    ("--training_stage=annealing",),
    ("--lr_schedule=constant",),
    ("--lr_schedule=linear",),
    ("--lr_schedule=inv_sqrt",),
    ("--lr_schedule=inv",),
    ("--lr_cycles=2",),
]


@pytest.mark.parametrize(
    "n, flags", [(n, f) for n in (1, 5, 19) for f in SCHEDULES if n >= 2 or "--lr_cycles=2" not in f]
)
def test_short_runs_work(n, flags):
    cfg = parse_args(["--use_dummy_dataset", f"--num_steps={n}", *flags])
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_scheduler(opt, schedule_of(cfg))
    lrs = []
    for _ in range(n):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert all(math.isfinite(v) and 0 <= v <= 1 for v in lrs)
    assert lrs[0] > 0  # no warmup below 20 steps: the first step learns


def test_linear_inverse_square_root_and_cycles():
    lin = schedule("--num_steps=100", "--lr_schedule=linear", "--warmup_steps=0", "--min_lr_ratio=0.2")
    assert [lin(0), lin(50), lin(100)] == [1.0, pytest.approx(0.6), pytest.approx(0.2)]
    warm = schedule("--num_steps=100", "--lr_schedule=linear", "--warmup_steps=20", "--min_lr_ratio=0")
    assert [warm(10), warm(20), warm(60), warm(100)] == [0.75, 1.0, pytest.approx(0.5), 0.0]  # decays after warmup
    inv = schedule("--num_steps=1000", "--lr_schedule=inv_sqrt", "--warmup_steps=100", "--min_lr_ratio=0.1")
    assert inv(50) == pytest.approx(0.75) and inv(100) == 1.0
    assert inv(400) == pytest.approx(0.5) and inv(999) == pytest.approx(math.sqrt(100 / 999))
    assert schedule("--num_steps=100000", "--lr_schedule=inv_sqrt", "--warmup_steps=100")(99999) == 0.1  # the floor
    one = schedule("--num_steps=100", "--warmup_steps=10")
    three = schedule("--num_steps=300", "--lr_cycles=3", "--warmup_steps=10")
    assert all(three(c * 100 + x) == pytest.approx(one(x)) for c in range(3) for x in range(100))  # re-warmup
    assert three(100) == 0.0 and three(299) == pytest.approx(one(99))
    uneven = schedule("--num_steps=10", "--lr_cycles=3", "--lr_schedule=linear", "--warmup_steps=0")
    assert [uneven(x) for x in (0, 3, 6)] == [1.0, 1.0, 1.0]  # cycles start at 0, 3 and 6
    with pytest.raises(ConfigError, match="--lr_cycles=20 is more than --num_steps=10"):
        schedule("--num_steps=10", "--lr_cycles=20")
    with pytest.raises(ConfigError, match="--decay_steps=40 is more than the 33 steps of a cycle"):
        schedule("--num_steps=100", "--lr_cycles=3", "--decay_steps=40")


def test_levanter_forms_inv_fractions_cycle_lengths_and_ends_and_rewarmup():
    inv = schedule("--num_steps=100", "--lr_schedule=inv", "--warmup_steps=0", "--min_lr_ratio=0.1")
    assert inv(0) == 1.0 and inv(50) == pytest.approx(1 / 5.5) and inv(100) == pytest.approx(0.1)  # 1/(1 + 9t/100)
    half = schedule(
        "--num_steps=100", "--lr_schedule=inv", "--warmup_steps=10", "--decay_steps=0.5", "--min_lr_ratio=0.5"
    )
    assert half(10) == 1.0 and half(35) == pytest.approx(1 / 1.5) and half(60) == half(99) == 0.5  # decay: 50 steps
    steps, fraction = (
        schedule("--num_steps=1000", "--warmup_steps=100"),
        schedule("--num_steps=1000", "--warmup_steps=0.1"),
    )
    assert all(steps(x) == fraction(x) for x in range(0, 1001, 7))
    # four cycles of 100 steps, written five ways
    forms = [
        ["--lr_cycles=4"],
        ["--lr_cycle_length=100"],
        ["--lr_cycle_length=0.25"],
        ["--lr_cycle_length=100,100,100"],
        ["--lr_cycle_ends=100,200,300,400"],
    ]
    curves = [[schedule("--num_steps=400", "--warmup_steps=10", *f)(x) for x in range(400)] for f in forms]
    assert all(c == curves[0] for c in curves) and curves[0][100] == curves[0][300] == 0.0
    one_long = schedule("--num_steps=300", "--warmup_steps=10", "--lr_cycle_ends=100")  # then 200 steps to the end
    long = schedule("--num_steps=200", "--warmup_steps=10")
    assert all(one_long(100 + x) == pytest.approx(long(x)) for x in range(200))
    leftover = schedule("--num_steps=450", "--warmup_steps=10", "--lr_cycle_length=100")  # the last cycle: 150
    last = schedule("--num_steps=150", "--warmup_steps=10")
    assert leftover(300) == 0.0 and all(leftover(300 + x) == pytest.approx(last(x)) for x in range(150))
    rewarm = schedule("--num_steps=300", "--lr_cycles=3", "--warmup_steps=10", "--lr_rewarmup=0")
    assert rewarm(0) == 0.0 and rewarm(100) == rewarm(200) == 1.0  # later cycles start at the peak
    for flags, message in [
        (["--lr_cycles=2", "--lr_cycle_length=10"], "--lr_cycles and --lr_cycle_length both set the cycles"),
        (["--lr_cycle_length=often"], "--lr_cycle_length=often: give steps"),
        (["--lr_cycle_ends=50,20"], "--lr_cycle_ends=50,20: give increasing steps from 1 to --num_steps=100"),
        (["--warmup_steps=1.5"], r"--warmup_steps=1.5: give a number of steps \(an integer\) or a fraction"),
        (["--lr_schedule=inv", "--min_lr_ratio=0"], "--lr_schedule=inv decays towards --min_lr_ratio"),
    ]:
        with pytest.raises(ConfigError, match=message):
            schedule("--num_steps=100", *flags)
