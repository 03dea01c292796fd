"""CI's guards: under CI=true a skip fails (tests/no_silent_skip.py) unless it is the CUDA tier's, a test
filter that selects nothing fails, and .ci/run's system packages failing to install fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SKIPPING = """
import pytest

def test_needs_slurm():
    pytest.skip("needs slurm-wlm (apt-get install slurm-wlm munge)")

@pytest.mark.cuda
def test_needs_a_gpu():
    pytest.skip("needs CUDA")

def test_runs():
    assert True
"""


def run_inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: str, *args: str) -> pytest.RunResult:
    monkeypatch.setenv("CI", ci)
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    return pytester.runpytest_subprocess("-p", "no_silent_skip", "-p", "no:cacheprovider", *args)


def test_a_skip_fails_under_ci_naming_what_is_missing_but_the_cuda_tier_may_skip(pytester, monkeypatch):
    pytester.makepyfile(test_inner=SKIPPING)
    result = run_inner(pytester, monkeypatch, "true")
    result.assert_outcomes(passed=1, failed=1, skipped=1)
    result.stdout.fnmatch_lines(["*skipped under CI=true, which must run every test: *needs slurm-wlm*"])


def test_outside_ci_a_skip_stays_a_skip(pytester, monkeypatch):
    pytester.makepyfile(test_inner=SKIPPING)
    run_inner(pytester, monkeypatch, "").assert_outcomes(passed=1, skipped=2)


def test_a_missing_optional_package_fails_the_module_under_ci(pytester, monkeypatch):
    pytester.makepyfile(test_inner="import pytest\npytest.importorskip('no_such_package')\ndef test_x(): pass\n")
    result = run_inner(pytester, monkeypatch, "true")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*skipped under CI=true*no_such_package*"])
    run_inner(pytester, monkeypatch, "").assert_outcomes(skipped=1)


def test_a_filter_that_selects_nothing_fails(pytester, monkeypatch):
    pytester.makepyfile(test_inner=SKIPPING)
    assert run_inner(pytester, monkeypatch, "true", "-k", "no_such_test").ret == pytest.ExitCode.NO_TESTS_COLLECTED


def test_the_fault_matrix_refuses_a_filter_that_matches_no_case(monkeypatch):
    from test_faults import chosen_faults

    monkeypatch.setenv("FMS_FAULTS", "SIGTERM during a save")
    assert chosen_faults()
    monkeypatch.setenv("FMS_FAULTS", "no such fault")
    with pytest.raises(pytest.UsageError, match="FMS_FAULTS='no such fault' matches none of the"):
        chosen_faults()


def test_a_tmpfs_that_cannot_be_mounted_fails_its_fault_case_instead_of_skipping_the_matrix(tmp_path):
    """Bench.mount runs in the matrix's worker threads, whose handler catches Exception: a pytest.skip there
    would skip every case at once."""
    from test_faults import Bench, MountError

    bench = Bench(tmp_path, {}, {})
    with pytest.raises(MountError, match="cannot mount a tmpfs"):
        bench.mount("disk", "not-a-size")
    assert issubclass(MountError, Exception)


def system_packages(tmp_path: Path, ci: str) -> subprocess.CompletedProcess:
    """.ci/system_packages.sh where nothing it needs is on PATH and apt-get fails (as without a network)."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "apt-get").write_text("#!/bin/sh\necho 'E: Unable to locate package' >&2\nexit 100\n")
    (fake / "apt-get").chmod(0o755)
    env = {**os.environ, "CI": ci, "PATH": f"{fake}:/usr/bin:/bin", "FMS_CI_SBIN": str(tmp_path / "no-sbin")}
    return subprocess.run(["bash", ".ci/system_packages.sh"], cwd=ROOT, env=env, capture_output=True, text=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="the script installs only as root")
def test_system_packages_that_cannot_be_installed_fail_ci_and_warn_outside_it(tmp_path):
    failed = system_packages(tmp_path, "true")
    assert failed.returncode != 0 and "could not install slurm-wlm munge" in failed.stderr, failed.stderr
    warned = system_packages(tmp_path, "")
    assert warned.returncode == 0 and "warning: could not install" in warned.stderr, warned.stderr


TORCH_RUNS = "torch_api and not composition and not pinned_torch"  # what scripts/test_torch.sh selects


@pytest.mark.slow  # 9 s: collects the whole suite
def test_every_torch_release_runs_the_fault_matrix_and_a_checkpoint_resume():
    """scripts/test_torch.sh runs `-m torch_api` on the oldest and newest torch: that subset must hold them."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", TORCH_RUNS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    chosen = set(proc.stdout.split())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for test in (
        "tests/test_faults.py::test_every_fault_ends_in_its_one_line_and_status_and_keeps_every_checkpoint",
        "tests/test_checkpoint.py::test_killed_and_resumed_run_equals_the_uninterrupted_one",
        "tests/test_checkpoint.py::test_resume_on_another_world_size_and_strategy",
        "tests/test_ft.py::test_a_killed_group_is_dropped_and_catches_up_live_on_return",
        "tests/test_compat.py::test_every_private_torch_api_is_where_compat_takes_it_from",
    ):
        assert test in chosen, f"{test} is not in scripts/test_torch.sh's selection ({TORCH_RUNS})"
    assert "bash scripts/test_torch.sh 2.11.0" in (ROOT / ".ci" / "run").read_text()
    assert f'-m "{TORCH_RUNS}" "$@"' in (ROOT / "scripts" / "test_torch.sh").read_text()
