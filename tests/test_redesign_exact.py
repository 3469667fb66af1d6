"""Exactness across issue 30's redesign: each scenario of ``redesign_scenarios.py`` trained by
the code installed now ends with the same bits as the code before the redesign did.

``fixtures/redesign/<scenario>.npz`` holds the old code's result (made by
``fixtures/redesign/make_fixtures.py`` from commit 0b0d295; never from the code under test):
every parameter and buffer, a 16-bit model's float32 masters, the updater's state and learning
rates, the four counters and the last score. Each is compared bit for bit, dtype and shape
included. Bits depend on the CPU kernels too (a vectorized sum adds in another order on AVX-512
than on AVX2), so where torch's version or the CPU capability differs from the fixture's the
test skips, naming both; a parallel scenario skips where the number of cores differs too (each
CPU worker runs cores / workers threads, and the tensor and hybrid modes' bits depend on it).
The CPU only, no cuda cases: CUDA kernels give other bits than the fixtures' CPU ones.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from redesign_scenarios import PARALLEL, SCENARIOS, SINGLE, difference

FIXTURES = Path(__file__).parent / "fixtures" / "redesign"
MADE_WITH = "__made_with__/"


def fixture(name: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The old code's result for ``name``, and what it was made with (torch, CPU, commit)."""
    with np.load(FIXTURES / f"{name}.npz", allow_pickle=False) as saved:
        entries = {key: saved[key] for key in saved.files}
    stamp = {key[len(MADE_WITH):]: str(entries.pop(key)) for key in list(entries) if key.startswith(MADE_WITH)}
    return entries, stamp


def skip_on_other_kernels(stamp: dict[str, str], parallel: bool) -> None:
    here = {"torch": torch.__version__.split("+")[0], "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if parallel:  # each CPU worker runs cores / workers threads (docs/parallel.md)
        here["cpu_count"] = str(os.cpu_count() or 1)
    other = {key: (stamp[key], value) for key, value in here.items() if stamp[key] != value}
    if other:
        pytest.skip("bit-exact only with the torch, CPU kernels and (parallel) cores the fixtures were made with: "
                    + ", ".join(f"{key} {made} there, {now} here" for key, (made, now) in other.items()))


def assert_ends_as_the_old_code(name: str, folder: Path) -> None:
    expected, stamp = fixture(name)
    skip_on_other_kernels(stamp, parallel=name in PARALLEL)
    problem = difference(expected, SCENARIOS[name](folder))
    if problem is not None:
        pytest.fail(f"scenario {name} does not end as the code before the redesign ({stamp['commit']}): {problem}")


def test_every_scenario_has_its_fixture():
    assert sorted(p.stem for p in FIXTURES.glob("*.npz")) == sorted(SCENARIOS)


@pytest.mark.parametrize("name", SINGLE)
def test_single_device_training_ends_as_the_old_code(name, tmp_path):
    assert_ends_as_the_old_code(name, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", PARALLEL)
def test_parallel_training_ends_as_the_old_code(name, tmp_path):
    assert_ends_as_the_old_code(name, tmp_path)
