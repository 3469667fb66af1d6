"""Step "parallel": the ParallelWrapper with 2 workers sharing the one device.

For each data-parallel mode (parameter averaging every 3 rounds, shared gradients) the seed
LeNet trains an MNIST slice: one fit of 3 epochs, then 3 fits of one epoch on the same wrapper
(DL4J's loop: the workers are started once). Figures: samples/s (the epochs after the first),
the workers' start-up, each epoch's loss, the process group's backend as worker 0 sees it,
worker 0's memory at each epoch's end (read in worker 0: torch's allocated and reserved bytes,
its RSS), and after each fit both workers' RSS and the device's used memory (all processes).
Targets: finite losses that fall, one start of the workers, gloo (two ranks on one device),
and memory flat: from the first reading to the last it grows less than the bounds below.
Then worker 1 is killed (SIGKILL) in its third batch: the fit must fail naming worker 1,
within NAMED_WITHIN_S of the kill.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from _common import seed_lenet
from dl4py import (
    ArrayDataSetIterator,
    DenseLayer,
    InputType,
    MnistDataSetIterator,
    MultiLayerNetwork,
    NetworkConfig,
    OutputLayer,
    Sgd,
)
from dl4py.errors import WorkerError
from dl4py.parallel import ParallelPlan, ParallelWrapper
from gpu_steps._check import Check
from gpu_steps._workers import EXPECTED_BACKEND, WorkerProbe, mib, part, rss_mib, toy_examples

WORKERS = 2
# Any wait on another process: a hang fails its part well inside the step's budget.
TIMEOUT_S = 30.0
REPEATED_FITS = 3
# Flatness bounds, growth from the first reading to the last. Worker 0's allocated bytes are
# its live tensors: a tensor kept per step or per epoch shows at once. The device's used
# memory holds three processes' contexts and caches, and RSS malloc's arenas: they move a little.
ALLOCATED_GROWTH_MIB = 4.0
DEVICE_USED_GROWTH_MIB = 64.0
RSS_GROWTH_MIB = 64.0
NAMED_WITHIN_S = 30.0


def run(check: Check) -> None:
    check.figure("device", str(check.device))
    for mode, options in (("averaging", {"averaging_frequency": 3}), ("shared_gradients", {})):
        with part(check, mode):
            train_mode(check, mode, options)
    with check.part("killed worker"):
        killed_worker(check)
    check.expect(multiprocessing.active_children() == [], "worker processes were left behind")


def train_mode(check: Check, mode: str, options: dict) -> None:
    # Quick: 8 batches, 4 rounds an epoch: an average mid-epoch (after round 3) and one at its end.
    data = MnistDataSetIterator(check.steps(128, 32), train=True, seed=12345, limit=check.steps(12_800, 256))
    model = MultiLayerNetwork(seed_lenet(), backend=check.backend)
    probe = WorkerProbe()
    after_fits = []
    began = time.perf_counter()
    plan = ParallelPlan.from_training_mode(mode)
    with ParallelWrapper(model, workers=WORKERS, devices=[str(check.device)], parallelism=plan,
                         timeout=TIMEOUT_S, **options) as wrapper:
        started = time.perf_counter()
        history = wrapper.fit(data, epochs=3, listeners=[probe], verbose=0)
        first_wall = time.perf_counter() - started
        after_fits.append(after_fit(check, wrapper, probe, epochs=3))
        for _ in range(REPEATED_FITS):
            history.extend(wrapper.fit(data, epochs=1, listeners=[probe], verbose=0))
            after_fits.append(after_fit(check, wrapper, probe, epochs=1))
        starts = wrapper._pool.starts  # the pool's count, as benchmarks/parallel.py reads it
    check.figure(f"{mode}_wall_seconds", round(time.perf_counter() - began, 2))  # all its fits, start to close
    timed = history.summaries[1:3]  # the first fit's epochs after its first
    losses = [s.mean_loss for s in history.summaries]
    check.figure(f"{mode}_samples_per_second", round(sum(s.examples for s in timed) / sum(s.seconds for s in timed)))
    check.figure(f"{mode}_startup_seconds", round(first_wall - sum(s.seconds for s in history.summaries[:3]), 2))
    check.figure(f"{mode}_loss_by_epoch", [round(v, 4) for v in losses])
    check.figure(f"{mode}_worker0_by_epoch", probe.rows)
    check.figure(f"{mode}_after_each_fit", after_fits)
    backends = sorted({row["backend"] for row in probe.rows})
    check.figure(f"{mode}_backend", ", ".join(map(str, backends)))
    check.expect(backends == [EXPECTED_BACKEND],
                 f"{mode}: process group backend {backends}, expected {EXPECTED_BACKEND}")
    check.expect(all(math.isfinite(v) for v in losses), f"{mode}: a loss is not finite: {losses}")
    check.expect(losses[-1] < losses[0], f"{mode}: the loss did not fall ({losses[0]:.4f} -> {losses[-1]:.4f})")
    check.expect(starts == 1, f"{mode}: the workers were started {starts} times for {1 + REPEATED_FITS} fits")
    expect_memory_flat(check, mode, probe.rows, after_fits)


def expect_memory_flat(check: Check, mode: str, epochs: list[dict], after_fits: list[dict]) -> None:
    """Over the first fit's 3 epochs, and over the fits (each fit's last epoch, and between fits)."""
    first_fit = epochs[:3]
    fit_ends = [row for row in epochs if row["last_of_fit"]]
    fits = f"{1 + REPEATED_FITS} fits"
    expect_flat(check, f"{mode}: worker 0's RSS over 3 epochs", [r["rss_mib"] for r in first_fit], RSS_GROWTH_MIB)
    for worker in range(WORKERS):
        expect_flat(check, f"{mode}: worker {worker}'s RSS over {fits}",
                    [r["worker_rss_mib"][worker] for r in after_fits], RSS_GROWTH_MIB)
    if check.gpu:
        expect_flat(check, f"{mode}: worker 0's allocated device memory over 3 epochs",
                    [r["allocated_mib"] for r in first_fit], ALLOCATED_GROWTH_MIB)
        expect_flat(check, f"{mode}: worker 0's allocated device memory over {fits}",
                    [r["allocated_mib"] for r in fit_ends], ALLOCATED_GROWTH_MIB)
        expect_flat(check, f"{mode}: the device's used memory over {fits}",
                    [r["device_used_mib"] for r in after_fits], DEVICE_USED_GROWTH_MIB)


def after_fit(check: Check, wrapper: ParallelWrapper, probe: "WorkerProbe", epochs: int) -> dict:
    """Read between fits, the workers idle: both workers' RSS, the device's used memory."""
    probe.rows[-1]["last_of_fit"] = True
    used = None
    if check.gpu:
        free, total = torch.cuda.mem_get_info(check.device)
        used = mib(total - free)
    pids = wrapper._pool.pids  # the workers, alive until the wrapper closes
    return {"epochs": epochs, "worker_rss_mib": [rss_mib(pid) for pid in pids], "device_used_mib": used}


def expect_flat(check: Check, what: str, readings: list, bound_mib: float) -> None:
    readings = [r for r in readings if r is not None]
    if not check.expect(len(readings) >= 2, f"{what}: {len(readings)} readings, too few to tell"):
        return
    growth = readings[-1] - readings[0]
    check.expect(growth <= bound_mib, f"{what} grew {growth:.1f} MiB ({readings[0]:.1f} -> {readings[-1]:.1f}), "
                                      f"more than {bound_mib:g} MiB")


def killed_worker(check: Check) -> None:
    x, y = toy_examples(256, seed=0)
    stamp = check.work_dir / "killed-at"
    model = MultiLayerNetwork(toy_network(), backend=check.backend)
    wrapper = ParallelWrapper(model, workers=WORKERS, devices=[str(check.device)], prefetch_buffer=0,
                              timeout=TIMEOUT_S)
    started = time.time()
    try:
        wrapper.fit(DiesInItsThirdBatch(x, y, batch_size=16, stamp=str(stamp)), epochs=5, verbose=0)
    except WorkerError as exc:
        raised = time.time()
        error = exc
    else:
        check.expect(False, "killed worker: the fit ended without an error")
        return
    finally:
        wrapper.close()
    killed = float(stamp.read_text()) if stamp.exists() else None
    check.figure("killed_error", str(error).splitlines()[0][:300])
    check.figure("killed_fit_to_error_seconds", round(raised - started, 2))
    check.figure("killed_named_after_seconds", None if killed is None else round(raised - killed, 2))
    check.expect(killed is not None, "killed worker: worker 1 did not record its kill (it was never killed)")
    check.expect(error.rank == 1 and "worker 1" in str(error), f"killed worker: the error names worker {error.rank}")
    if killed is not None:
        check.expect(raised - killed < NAMED_WITHIN_S,
                     f"killed worker: named {raised - killed:.1f} s after the kill, not within {NAMED_WITHIN_S:g} s")


def toy_network() -> NetworkConfig:
    return NetworkConfig(layers=[DenseLayer(n_out=12, activation="tanh"), OutputLayer(n_out=3)],
                         input_type=InputType.feed_forward(5), updater=Sgd(0.1), seed=11)


class DiesInItsThirdBatch(ArrayDataSetIterator):
    """Worker 1 writes the time and kills itself (SIGKILL) as it reads its third batch, in the
    middle of the ranks' collectives (tests/toy.py's iterator, timed)."""

    def __init__(self, features, labels, batch_size: int, stamp: str):
        super().__init__(features, labels, batch_size=batch_size, shuffle=False)
        self.stamp = stamp

    def _batch(self, indices):
        if dist.is_initialized() and dist.get_rank() == 1:
            self._served = getattr(self, "_served", 0) + 1
            if self._served == 3:
                Path(self.stamp).write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
        return super()._batch(indices)
