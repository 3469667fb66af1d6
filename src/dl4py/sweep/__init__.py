"""Experiments across devices: ``dl4py.sweep.run(config, grid=..., devices=..., per_device=...)``.

Each grid point (or random point, or trial of an Optuna study: ``sampler="tpe"``) is an
ordinary ``dl4py train`` run in its own process, pinned to a device slot; the sweep ranks
them in ``results.csv`` / ``results.md`` and saves the best config as ``best.yaml``.
See docs/sweep.md.
"""

from dl4py.sweep.plan import Experiment, Plan, Range, expand, parse_grid, parse_range
from dl4py.sweep.results import METRICS
from dl4py.sweep.runner import SweepInterrupted, SweepResult, run
from dl4py.sweep.slots import Slot, make_slots

__all__ = [
    "METRICS", "Experiment", "Plan", "Range", "Slot", "SweepInterrupted", "SweepResult", "expand",
    "make_slots", "parse_grid", "parse_range", "run",
]
