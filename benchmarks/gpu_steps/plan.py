"""Step "plan": issue 34's GPU line, `dl4py plan` on the device at hand.

This device's profile is measured as ``dl4py plan --profile --device cuda`` measures it
(matrix products and convolutions per precision, the memory bandwidth, a dispatch; no links
on one GPU), and recorded whole, so that a session can save it as a profile file. Where the
device is one of the built-in GPUs (h100, h200, a100, l4, rtx4090, t4), that built-in profile
is calibrated with it (``calibrate``: the fraction of each published peak reached). Then the
networks of benchmarks/plan.py train on this one device, and each one's measured step is set
beside the ``single`` plan's prediction from the measured profile, from the published one and
from the calibrated one, and from the network timed on this device (``--measure-layers``):
the predicted-against-measured table of one device, the target 30% as on the CPU
(docs/plan.md). Plans over several devices need a second GPU.
"""

from __future__ import annotations

import statistics
import time

import torch

import plan as plan_benchmark  # benchmarks/plan.py, on the path; this module is gpu_steps.plan
from dl4py.config.graph import example_shape
from dl4py.nn.loading import network_model
from dl4py.plan import builtin_profile, calibrate, measure_profile, predict
from dl4py.plan.builtin_profiles import PUBLISHED
from dl4py.plan.layer_times import measure_layers
from gpu_steps._check import Check

BATCH = 128
NEAR = 0.30  # what benchmarks/plan.py holds a prediction to
PROFILE_BUDGET_S = {"full": 40.0, "quick": 8.0}


def run(check: Check) -> None:
    kind = "cuda" if check.gpu else "cpu"
    measured = measure_profile(kind, budget_s=PROFILE_BUDGET_S["quick" if check.quick else "full"],
                               quick=check.quick)
    check.figure("profile", measured.to_dict())
    profiles = {"measured": measured}
    name = _builtin_name(check)
    if name is not None:
        profiles["published"] = builtin_profile(name)
        profiles["calibrated"] = calibrate(profiles["published"], measured)
        check.figure("calibrated", {"builtin": name, "efficiency": profiles["calibrated"].source.efficiency})
    rows = []
    for network, config in plan_benchmark.networks().items():
        row = None
        with check.part(network):
            seconds = _measured_step(check, config)
            row = {"network": network, "batch": BATCH, "measured_ms": seconds * 1e3}
            for source, profile in profiles.items():
                predicted = predict(config, profile, 1, batch_size=BATCH)[0].step_s
                row[f"predicted_{source}_ms"], row[f"predicted_{source}_ratio"] = predicted * 1e3, predicted / seconds
            rows.append(row)
            check.figure("single_step", rows)
            _expect_near(check, row, "calibrated" if "calibrated" in profiles else "measured")
        if row is None or (check.quick and network != "lenet"):  # the rehearsal times one network
            continue
        with check.part(f"{network}, timed here"):  # dl4py plan --measure-layers on this device
            timed = measure_layers(config, BATCH, device=str(check.device))
            predicted = predict(config, measured, 1, batch_size=BATCH, layer_times=timed)[0].step_s
            row["predicted_timed_ms"], row["predicted_timed_ratio"] = predicted * 1e3, predicted / seconds
            check.figure("single_step", rows)
            _expect_near(check, row, "timed")


def _expect_near(check: Check, row: dict, source: str) -> None:
    if check.quick:  # the rehearsal's profile is a quick one (float, two sizes): figures, no target
        return
    ratio = row[f"predicted_{source}_ratio"]
    check.expect(abs(ratio - 1) <= NEAR,
                 f"{row['network']}: one device's step predicted {row[f'predicted_{source}_ms']:.2f} ms from the "
                 f"{source} profile, measured {row['measured_ms']:.2f} ms ({ratio:.2f}x; within {NEAR:.0%} is "
                 "the target)")


def _builtin_name(check: Check) -> str | None:
    if not check.gpu:
        return None
    hardware = torch.cuda.get_device_name(check.device).lower().replace(" ", "")
    return next((key for key in PUBLISHED if key in hardware), None)


def _measured_step(check: Check, config) -> float:
    """Median seconds of a training step of ``config`` on this device at BATCH, after warming up."""
    model = network_model(config, backend=check.backend).init()
    generator = torch.Generator().manual_seed(0)
    features = torch.rand(BATCH, *example_shape(config), generator=generator).to(check.device)
    labels = torch.randint(0, 10, (BATCH,), generator=generator).to(check.device)
    for _ in range(check.steps(5, 2)):
        model.train_step(features, labels)
    samples = []
    for _ in range(check.steps(15, 3)):
        _sync(check)
        start = time.perf_counter()
        model.train_step(features, labels)
        _sync(check)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _sync(check: Check) -> None:
    if check.gpu:
        torch.cuda.synchronize(check.device)
