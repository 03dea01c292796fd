"""Two runs compared step by step (`fms-compare-runs`): their loss and gradient norm at every step both
recorded, the largest gap, and whether every gap is within a tolerance, as numpy.isclose judges it:
|a - b| <= atol + rtol x |b|, B the reference. Runs are read from their metrics.jsonl (a run folder,
the file, or either in object storage); a step logged twice (before a stop and after the resume)
keeps its last values."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from fms_fsdp.errors import ConfigError
from fms_fsdp.metrics.plot import read_metrics
from fms_fsdp.storage import location

KEYS = ("loss", "grad_norm")  # compared at each step both runs recorded


@dataclass(frozen=True, kw_only=True)
class Gap:
    """The difference of one key at one step."""

    step: int
    key: str
    a: float
    b: float

    @property
    def absolute(self) -> float:
        return abs(self.a - self.b) if math.isfinite(self.a) and math.isfinite(self.b) else math.inf

    @property
    def relative(self) -> float:
        if math.isinf(self.absolute):
            return math.inf
        return self.absolute / abs(self.b) if self.b else (0.0 if self.absolute == 0 else math.inf)

    def within(self, rtol: float, atol: float) -> bool:
        if not (math.isfinite(self.a) and math.isfinite(self.b)):  # inf or nan: only the very same value
            return self.a == self.b
        return self.absolute <= atol + rtol * abs(self.b)


def paired(a: list[dict[str, Any]], b: list[dict[str, Any]], steps: Optional[int]) -> list[tuple[dict, dict]]:
    """The records of the steps both runs have (a training record: with a loss), the first `steps` of them."""
    by_step = {r["step"]: r for r in b if "loss" in r}
    pairs = [(r, by_step[r["step"]]) for r in a if "loss" in r and r["step"] in by_step]
    return pairs[:steps] if steps is not None else pairs


def gaps(pairs: list[tuple[dict, dict]]) -> list[Gap]:
    """Every key's gap at every paired step where both runs recorded it."""
    return [
        Gap(step=ra["step"], key=key, a=float(ra[key]), b=float(rb[key]))
        for ra, rb in pairs
        for key in KEYS
        if ra.get(key) is not None and rb.get(key) is not None
    ]


def table(pairs: list[tuple[dict, dict]]) -> list[str]:
    """One line per paired step: each key in both runs and their difference."""
    header = f"{'step':>7}" + "".join(f" | {key + ' A':>12} {key + ' B':>12} {'A - B':>10}" for key in KEYS)
    lines = [header]
    for ra, rb in pairs:
        line = f"{ra['step']:>7}"
        for key in KEYS:
            a, b = ra.get(key), rb.get(key)
            gap = f"{a - b:>10.2e}" if a is not None and b is not None else f"{'-':>10}"
            line += f" | {_number(a):>12} {_number(b):>12} {gap}"
        lines.append(line)
    return lines


def _number(value: Any) -> str:
    return "-" if value is None else f"{value:.6g}"


def compare_runs(a: str, b: str, steps: Optional[int] = None, rtol: float = 1e-3, atol: float = 1e-6) -> bool:
    """Print the step-by-step table of runs `a` and `b` (b the reference), the largest gap and the
    verdict; whether every gap is within the tolerance. ConfigError when they share no step."""
    if rtol < 0 or atol < 0:
        raise ConfigError(f"--rtol={rtol} --atol={atol}: tolerances are >= 0")
    if steps is not None and steps < 1:
        raise ConfigError(f"--steps={steps}: expected an integer >= 1 (or none: every step both runs have)")
    pairs = paired(read_metrics(location(a, "run")), read_metrics(location(b, "run")), steps)
    if not pairs:
        raise ConfigError(f"{a} and {b} have no training step in common: nothing to compare")
    found = gaps(pairs)
    for line in table(pairs):
        print(line)
    worst = max(found, key=lambda g: (g.relative, g.absolute))
    print(
        f"largest gap: {worst.key} at step {worst.step}: {worst.a:.6g} vs {worst.b:.6g} "
        f"(|A - B| {worst.absolute:.2e}, relative {worst.relative:.2e})"
    )
    beyond = [g for g in found if not g.within(rtol, atol)]
    tolerance = f"rtol {rtol:g}, atol {atol:g}"
    if beyond:
        first = beyond[0]
        print(
            f"beyond the tolerance ({tolerance}) at {len({g.step for g in beyond})} of {len(pairs)} steps, "
            f"first at step {first.step} ({first.key})"
        )
        return False
    print(f"within the tolerance ({tolerance}) over {len(pairs)} steps")
    return True
