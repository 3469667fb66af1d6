"""Step 2: the suite's GPU half (pytest -m gpu), each test bounded.

pytest runs verbose and its lines are read as they come: each test's outcome is recorded at
once (``check.figure``), so a step killed at its budget still reports what passed and what
failed up to then, and why each failure failed (``failure_lines`` prints each reason at once).
Without a GPU the cases are only collected and counted: every one of them would be skipped,
and running pytest for that costs a CPU rehearsal its budget.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import time
from pathlib import Path

from gpu_steps._check import Check
from gpu_steps.failure_lines import PREFIX

TESTS = Path(__file__).resolve().parents[2] / "tests"
PER_TEST_TIMEOUT_S = 90
SAVE_EVERY_S = 5.0  # how often the running counts are written (a failure is written at once)
# "tests/test_x.py::test_y[cuda] PASSED   [ 12%]", as pytest -v prints each test.
OUTCOME = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
# "gpu-check-reason: tests/test_x.py::test_y[cuda] (call): RuntimeError: ...", from failure_lines.
REASON = re.compile(rf"^{re.escape(PREFIX)} (\S+::\S+) \((\w+)\): (.*)$")
NAMES = {"PASSED": "passed", "FAILED": "failed", "ERROR": "errors", "SKIPPED": "skipped",
         "XFAIL": "xfailed", "XPASS": "xpassed"}


def run(check: Check) -> None:
    base = [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-p", "gpu_steps.failure_lines",
            "-o", "addopts=",
            *gpu_test_files()]
    if not check.gpu:
        cases = collected_cases(base)
        check.figure("cases", cases)
        # Without CUDA every gpu test is skipped by the conftest: the step says so, it passes nothing.
        check.skip(f"no GPU: {cases} gpu test cases collected, none run")
    bounded = ["--timeout", str(PER_TEST_TIMEOUT_S)] if timeout_plugin() else []
    check.figure("per_test_timeout_s", PER_TEST_TIMEOUT_S if timeout_plugin() else None)
    counts, failures = run_streamed([*base, "-v", "-rfE", *bounded], check)
    check.expect(not failures, f"{len(failures)} gpu tests failed or errored: {', '.join(failures[:5])}")
    check.expect(counts.get("passed", 0) > 0, "no gpu test passed")


def run_streamed(command: list[str], check: Check) -> tuple[dict, list[str]]:
    """Run pytest, echoing its output and recording each outcome as it is printed."""
    counts: dict[str, int] = {}
    failures: list[str] = []
    reasons: dict[str, str] = {}
    saved = time.monotonic()
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as pytest:
        for line in pytest.stdout:
            print(line, end="", flush=True)
            explained = REASON.match(line.rstrip("\n"))
            if explained:
                test, when, why = explained.groups()
                reasons[test] = why if when == "call" else f"in {when}: {why}"
                check.figure("reasons", reasons)
                continue
            found = OUTCOME.match(line)
            if not found:
                continue
            test, outcome = found.groups()
            counts[NAMES[outcome]] = counts.get(NAMES[outcome], 0) + 1
            if outcome in ("FAILED", "ERROR"):
                failures.append(test)
                check.figure("failures", failures)
            if outcome in ("FAILED", "ERROR") or time.monotonic() - saved > SAVE_EVERY_S:
                check.figure("counts", counts)
                saved = time.monotonic()
    check.figure("counts", counts)
    check.figure("failures", failures)
    if pytest.returncode not in (0, 1):  # 1: tests failed (counted above); else pytest itself could not run them
        raise RuntimeError(f"pytest -m gpu exited {pytest.returncode}: see the step's log")
    return counts, failures


def collected_cases(base: list[str]) -> int:
    """How many gpu test cases pytest collects (``--collect-only -q`` prints one line each)."""
    done = subprocess.run([*base, "--collect-only", "-q"], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"pytest -m gpu --collect-only exited {done.returncode}: "
                           f"{(done.stderr.strip() or done.stdout.strip()).splitlines()[-1:]}")
    return sum(1 for line in done.stdout.splitlines() if "::" in line)


def gpu_test_files() -> list[str]:
    """The test files that hold gpu tests: collecting the other 50 would cost a minute on a small CPU."""
    return sorted(str(f) for f in TESTS.glob("test_*.py") if uses_gpu_marker(f.read_text()))


def uses_gpu_marker(source: str) -> bool:
    # Directly, or through tests/devices.py (whose cuda cases carry the marker).
    return "pytest.mark.gpu" in source or "from devices import" in source


def timeout_plugin() -> bool:
    """pytest-timeout is in the test extra and on the GPU machine; without it a hang is the step's timeout."""
    return importlib.util.find_spec("pytest_timeout") is not None
