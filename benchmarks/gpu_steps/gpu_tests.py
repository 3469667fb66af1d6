"""Step 2: the suite's GPU half (pytest -m gpu), each test bounded."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

from gpu_steps._check import Check

TESTS = Path(__file__).resolve().parents[2] / "tests"
PER_TEST_TIMEOUT_S = 90
SUMMARY = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected)")


def run(check: Check) -> None:
    bounded = ["--timeout", str(PER_TEST_TIMEOUT_S)] if timeout_plugin() else []
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
               "-rfEs", *bounded, *gpu_test_files()]
    done = subprocess.run(command, capture_output=True, text=True)
    print(done.stdout[-20_000:], done.stderr[-5_000:], sep="\n")
    if done.returncode not in (0, 1):  # 1: tests failed (counted below); else pytest itself could not run them
        raise RuntimeError(f"pytest -m gpu exited {done.returncode}: "
                           f"{(done.stderr.strip() or done.stdout.strip()).splitlines()[-1:]}")
    counts = {("errors" if kind.startswith("error") else kind): int(n) for n, kind in SUMMARY.findall(done.stdout)}
    check.figure("counts", counts)
    failures = [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    check.figure("failures", failures)
    check.figure("per_test_timeout_s", PER_TEST_TIMEOUT_S if timeout_plugin() else None)
    if not check.gpu:
        # Without CUDA every gpu test is skipped by the conftest: the step says so, it passes nothing.
        check.skip(f"no GPU: {counts.get('skipped', 0)} gpu tests skipped")
    check.expect(done.returncode == 0, f"pytest -m gpu exited {done.returncode}: {len(failures)} failed or errored")
    check.expect(counts.get("passed", 0) > 0, "no gpu test passed")


def gpu_test_files() -> list[str]:
    """The test files that hold gpu tests: collecting the other 50 would cost a minute on a small CPU."""
    return sorted(str(f) for f in TESTS.glob("test_*.py") if "pytest.mark.gpu" in f.read_text())


def timeout_plugin() -> bool:
    """pytest-timeout is in the test extra and on the GPU machine; without it a hang is the step's timeout."""
    return importlib.util.find_spec("pytest_timeout") is not None
