"""``dl4py bench``: run the speed benchmarks of a source checkout, one process each.

The benchmarks are scripts in the repository's ``benchmarks/`` folder, not part of the
installed package (they compare against PyTorch Lightning and hand-written loops, and
write their results beside themselves). Each writes JSON and a markdown table into
``benchmarks/results/``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dl4py.errors import DL4PyError

BENCHMARKS = {
    "overhead": "overhead.py",
    "throughput": "throughput.py",
    "time-to-accuracy": "time_to_accuracy.py",
}


class BenchmarkError(DL4PyError):
    """The benchmark scripts are missing, or one of them failed."""


def find_benchmarks(folder: str | Path | None = None) -> Path:
    """The ``benchmarks/`` folder: ``folder``, else the checkout dl4py runs from, else ./benchmarks."""
    candidates = [Path(folder)] if folder is not None else [
        Path(__file__).resolve().parents[2] / "benchmarks",  # src/dl4py/bench.py in a checkout
        Path.cwd() / "benchmarks",
    ]
    for candidate in candidates:
        if all((candidate / script).is_file() for script in BENCHMARKS.values()):
            return candidate
    raise BenchmarkError(
        "the benchmark scripts (benchmarks/overhead.py, throughput.py, time_to_accuracy.py) are not "
        f"here: looked in {', '.join(str(c) for c in candidates)}. They ship with the source, not with "
        "an installed wheel: run `dl4py bench` from a checkout of the dl4py repository (pip install -e .), "
        "or pass --benchmarks DIR"
    )


def run(names: list[str], device: str, quick: bool, out: Path | None = None,
        folder: str | Path | None = None) -> list[tuple[str, int]]:
    """Run each named benchmark in its own process; (name, exit status) for each, in order."""
    where = find_benchmarks(folder)
    statuses = []
    for name in names:
        command = [sys.executable, str(where / BENCHMARKS[name]), "--device", device]
        if quick:
            command.append("--quick")
        if out is not None:
            command += ["--out", str(out)]
        print(f"dl4py bench: {' '.join(command[1:])}", file=sys.stderr, flush=True)
        statuses.append((name, subprocess.call(command, env=dict(os.environ))))
    return statuses
