"""Step 3: the seed LeNet in every precision policy, eager, compiled and with CUDA graphs.

Per row: samples/s of a timed epoch (after an epoch that compiles, captures and warms the
allocator), the peak allocated device memory of that epoch, the final loss (finite) and the
skipped steps: updates GradScaler dropped for an fp16 overflow, counted as minibatches
trained on minus updates applied. Only the loss-scaled policies may skip.
"""

from __future__ import annotations

import math
import time

import torch

from _common import seed_lenet, settings, sync
from dl4py import MnistDataSetIterator, MultiLayerNetwork
from gpu_steps._check import Check
from throughput import MODES, PRECISIONS  # benchmarks/throughput.py: the same rows, timed longer there

# Eager first (cheap, every policy), then the modes that compile: a step cut short keeps the most rows.
MODE_ORDER = {"gpu": ["eager", "cuda-graphs", "compiled"], "cpu": ["eager"]}
LOSS_SCALED = {"half", "mixed-fp16"}  # half keeps float32 masters and scales its loss
BATCH = 128


def run(check: Check) -> None:
    steps = check.steps(50, 5)
    data = MnistDataSetIterator(BATCH, train=True, seed=12345, limit=steps * BATCH, drop_last=True)
    rows = []
    for mode in MODE_ORDER[check.backend]:
        for precision in PRECISIONS[check.backend]:
            with check.part(f"{precision} {mode}"):
                row = train_row(check, data, precision, mode)
                rows.append(row)
                check.figure("rows", rows)
                check.expect(row["loss_finite"], f"{precision} {mode}: final loss {row['final_loss']} is not finite")
                check.expect(row["skipped_steps"] == 0 or precision in LOSS_SCALED,
                             f"{precision} {mode}: {row['skipped_steps']} steps skipped without loss scaling")
                check.expect(row["skipped_steps"] < row["steps_trained"] // 2,
                             f"{precision} {mode}: {row['skipped_steps']} of {row['steps_trained']} steps skipped")
    check.figure("steps_per_row", steps)
    check.figure("batch", BATCH)


def train_row(check: Check, data, precision: str, mode: str) -> dict:
    if mode != "eager":
        torch._dynamo.reset()  # a fresh compile per row: dynamo stops recompiling after a few
    with settings(**MODES[mode]):  # read when the model builds its step
        net = MultiLayerNetwork(seed_lenet(), backend=check.backend, precision=precision).init()
        start = time.perf_counter()
        net.fit(data, epochs=1, verbose=0)  # compiles, captures the graphs, warms the allocator
        sync(check.device)
        first_epoch = time.perf_counter() - start
        if check.gpu:
            torch.cuda.reset_peak_memory_stats(check.device)
        start = time.perf_counter()
        history = net.fit(data, epochs=1, verbose=0)
        sync(check.device)
        seconds = time.perf_counter() - start
    loss = float(history.history["loss"][-1])
    trained = net.iteration_count
    return {"precision": precision, "mode": mode, "steps_trained": trained,
            "samples_per_s": round(data.total_examples() / seconds, 1),
            "first_epoch_s": round(first_epoch, 3),
            "peak_mib": round(torch.cuda.max_memory_allocated(check.device) / 2**20, 1) if check.gpu else None,
            "final_loss": round(loss, 5), "loss_finite": math.isfinite(loss),
            "skipped_steps": trained - net.update_count}
