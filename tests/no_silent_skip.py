"""Under CI=true a skip is a failure, unless the test is one CI is expected to skip (the CUDA tier without a
GPU; a test of the CPU-only path with one). A test that cannot run in CI (Slurm or iproute2 not installed,
an optional package missing, a tmpfs that cannot be mounted) would otherwise be green without having run. Outside CI skips stay skips,
each saying what is missing. Loaded by tests/conftest.py."""

from __future__ import annotations

import os
from typing import Iterator, Optional

import pytest

EXPECTED_IN_CI = ("cuda", "cpu_only")  # markers of the tests CI skips by design (on a machine with or without a GPU)


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1")


def failed_skip(report: pytest.CollectReport | pytest.TestReport, item: Optional[pytest.Item]) -> None:
    """Turn a skip report into a failure naming what was missing, where CI must not skip."""
    if not (in_ci() and report.skipped) or getattr(report, "wasxfail", None) is not None:  # xfail: not a skip
        return
    if item is not None and any(item.get_closest_marker(m) for m in EXPECTED_IN_CI):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"skipped under CI=true, which must run every test: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    failed_skip(outcome.get_result(), item)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    """A module skipped as a whole (pytest.importorskip at its top)."""
    outcome = yield
    failed_skip(outcome.get_result(), None)
