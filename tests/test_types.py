"""mypy on the package, against mypy-baseline.txt (type errors per file): no file may gain one, and a
file that lost some must have its count lowered there, so the baseline only shrinks."""

import re
import subprocess
import sys
from collections import Counter

import pytest

from conftest import ROOT

BASELINE = ROOT / "mypy-baseline.txt"


@pytest.mark.slow  # mypy on the whole package: the slow tier (CI runs both)
def test_type_errors_only_shrink():
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "fms_fsdp"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    found = Counter(m.group(1) for m in re.finditer(r"^(\S+\.py):\d+: error:", proc.stdout, re.MULTILINE))
    allowed = {
        path: int(n)
        for path, n in (
            line.split() for line in BASELINE.read_text().splitlines() if line.strip() and not line.startswith("#")
        )
    }
    grown = {path: (n, allowed.get(path, 0)) for path, n in found.items() if n > allowed.get(path, 0)}
    assert not grown, "new type errors (found, allowed):\n" + proc.stdout
    shrunk = {path: (found.get(path, 0), n) for path, n in allowed.items() if found.get(path, 0) < n}
    assert not shrunk, f"fewer type errors than mypy-baseline.txt allows: lower it to {shrunk} (found, allowed)"
