"""Steps for tests/test_gpu_check.py: one that raises, one that hangs with a child, and so on."""

from __future__ import annotations

import os
import subprocess
import sys
import time


def raises(check):
    check.figure("before_the_error", 1)
    raise ValueError("a planted failure")


def hangs(check):
    """Records a figure and the pid of a child it starts in its group, then never returns."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    check.figure("child_pid", child.pid)
    check.figure("step_pid", os.getpid())
    while True:
        time.sleep(1)


def misses_a_target(check):
    check.figure("samples_per_s", 10.0)
    check.expect(False, "10 samples/s is under the target")
    check.figure("after_the_miss", True)


def breaks_one_part(check):
    with check.part("first"):
        raise RuntimeError("the first part broke")
    check.figure("second_part_ran", True)


def skips(check):
    check.skip("no GPU")


def misses_then_skips(check):
    check.expect(False, "the suite could not run")
    check.skip("no GPU")


def passes(check):
    check.figure("answer", 42)
    check.expect(True, "never shown")
