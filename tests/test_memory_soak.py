"""Memory stays flat when the same work is done again and again: short versions of the soak
benchmark's scenarios (benchmarks/soak.py, ``make soak``), the same code run for seconds.

Each bound is about half of what a leak of each iteration's data would add up to over the
measured iterations (the toy data is 4 MiB a fit or an epoch, 2 MiB a run; a request, its
features and its future, about 5 kB), and several times the growth measured on a busy 2-core
machine (0.1 to 2 MB): a leak that keeps each iteration's batches, data, model or requests
fails, the allocator settling in does not."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "benchmarks"))  # after the installed packages: it holds memory.py, sweep.py, ...

pytest.importorskip("psutil")

import soak_scenarios as scenarios  # noqa: E402
from soak_memory import Bound, judge  # noqa: E402


def assert_flat(trace, floor_mb: float) -> None:
    verdict = judge(trace, Bound(floor_mb=floor_mb, percent=0))
    assert verdict.passed, verdict.line() + f"; samples: {[(s.label, s.rss >> 20) for s in trace.samples]}"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_consecutive_fits_on_the_persistent_pool_keep_memory_flat():
    # Fits 3 to 6 on the same two workers: 4 x 4 MiB of data went through the pool.
    trace = scenarios.repeated_fits(fits=6, warmup=2)
    assert trace.notes["pool_starts"] == 1  # the same workers throughout: no restart hides a leak
    assert_flat(trace, floor_mb=8)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_epochs_of_one_fit_keep_memory_flat():
    # Epochs 3 to 6 of one fit: 4 x 4 MiB (a sample may come up to an epoch late).
    assert_flat(scenarios.long_fit(epochs=6, warmup=2), floor_mb=6)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_sweeps_runs_in_one_process_keep_memory_flat():
    # Runs 3 to 6, each its own CSV data (2 MiB of features), model (2.4 MB with its gradients)
    # and run directory.
    assert_flat(scenarios.sweep_runs(runs=6, warmup=2), floor_mb=4)


@pytest.mark.soak  # long for make test's budget: make soak runs it (DEVELOPERS.md)
@pytest.mark.timeout(180)
def test_dl4py_serve_keeps_memory_flat_under_load():
    # 600 to 2,000 requests after the warm-up on 2 busy cores: 4 MB is 7 to 2 kB a request.
    pytest.importorskip("uvicorn")
    pytest.importorskip("starlette")
    trace = scenarios.serve_load(seconds=10, warmup_seconds=3, interval=0.5)
    assert trace.notes["answered"] > 0 and trace.notes["failures"] == 0, trace.notes
    assert_flat(trace, floor_mb=4)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_parallel_inference_keeps_memory_flat_under_load():
    # ~3,000 requests or more after the warm-up: 4 MB is ~1,400 B a request.
    trace = scenarios.inference_load(seconds=5, warmup_seconds=1.5, interval=0.25)
    assert trace.notes["answered"] > 0 and trace.notes["failures"] == 0, trace.notes
    assert_flat(trace, floor_mb=4)
