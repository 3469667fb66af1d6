"""CPU time of a 1-worker ParallelWrapper epoch against a plain fit's, under OMP_NUM_THREADS=1.

    python benchmarks/parallel_threads.py [--quick] [--examples 4096] [--epochs 2] [--rounds 3]

The issue (dl4py issue 33): the user sets a thread budget, and a wrapper's worker must keep
to it; under ``OMP_NUM_THREADS=1`` a 1-worker wrapper used 6x the CPU of a plain fit for the
same epoch. Each contestant runs in a child process of its own, launched with
``OMP_NUM_THREADS=1``, in turn (plain, wrapper, plain, wrapper, ...) so that drifts in machine
load hit both alike. A child trains the seed LeNet (batch 128) on the first ``--examples``
MNIST images (``$DL4PY_DATA/mnist``): one warm-up epoch (the wrapper's starts its worker),
then ``--epochs`` measured epochs in one fit. CPU time is user + system:

- ``per epoch``: the measured fit's, this process (``getrusage(RUSAGE_SELF)``) plus every live
  descendant (the worker and its forkserver, read with psutil), over the epochs: the figure
  the issue's bar (within 10%) is about;
- ``start-up``: the wrapper's warm-up fit less one steady epoch: its worker's start (the
  forkserver's imports, the process group) and the worker's own copy of the data;
- ``whole child``: the child process and all it started, from its start to its end (the
  driver's ``getrusage(RUSAGE_CHILDREN)``; the child stops its forkserver and so reaps it).

``wrapper, old default`` (``threads_per_worker`` = the machine's cores, what a worker took
before it honoured the budget) shows the cost the issue reported. Writes
parallel-threads-cpu.json and .md to --out.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing.forkserver
import os
import resource
import statistics
import subprocess
import sys

import torch

from _common import ROOT, heading, machine, parser, seed_lenet, write
from dl4py import MnistDataSetIterator, MultiLayerNetwork
from dl4py.parallel import ParallelWrapper

CONTESTANTS = ("plain", "wrapper", "wrapper, old default")


def cpu_seconds(usage) -> float:
    return usage.ru_utime + usage.ru_stime


def tree_cpu() -> float:
    """CPU seconds of this process and of its live descendants (the pool's worker, the forkserver)."""
    import psutil  # optional: psutil (the test extra); only a measuring child needs it

    total = cpu_seconds(resource.getrusage(resource.RUSAGE_SELF))
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:  # gone since listed
            pass
    return total


def child(contestant: str, examples: int, epochs: int) -> dict:
    """One contestant's fits in this process: warm-up epoch, then ``epochs`` measured ones."""
    data = MnistDataSetIterator(128, train=True, seed=12345, limit=examples)
    model = MultiLayerNetwork(seed_lenet(), backend="cpu").init()
    if contestant == "plain":
        fit, wrapper = model.fit, None
    else:
        given = os.cpu_count() if contestant == "wrapper, old default" else None
        wrapper = ParallelWrapper(model, workers=1, threads_per_worker=given)
        fit = wrapper.fit
    before = tree_cpu()
    fit(data, epochs=1, verbose=0)
    warm_up = tree_cpu() - before
    before = tree_cpu()
    fit(data, epochs=epochs, verbose=0)
    per_epoch = (tree_cpu() - before) / epochs
    worker_threads = None
    if wrapper is not None:
        worker_threads = wrapper.last_threads[0]
        wrapper.close()
        # Reaped here, its CPU (and its reaped workers') reaches the driver's RUSAGE_CHILDREN.
        multiprocessing.forkserver._forkserver._stop()
    return {"per_epoch": per_epoch, "start_up": warm_up - per_epoch, "threads": torch.get_num_threads(),
            "worker_threads": worker_threads}


def run_child(contestant: str, examples: int, epochs: int) -> dict:
    """``child`` in a process of its own under OMP_NUM_THREADS=1; adds its whole CPU time."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    before = cpu_seconds(resource.getrusage(resource.RUSAGE_CHILDREN))
    proc = subprocess.run([sys.executable, __file__, "--child", contestant, "--examples", str(examples),
                           "--epochs", str(epochs)], env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{contestant} child failed:\n{proc.stderr}")
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    figures["whole_child"] = cpu_seconds(resource.getrusage(resource.RUSAGE_CHILDREN)) - before
    return figures


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--examples", type=int, default=4096)
    p.add_argument("--epochs", type=int, default=2, help="measured epochs after the warm-up one")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--child", choices=CONTESTANTS, help=argparse.SUPPRESS)  # the driver's own call of this script
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.examples, args.epochs)))
        return
    examples, epochs, rounds = (1024, 1, 1) if args.quick else (args.examples, args.epochs, args.rounds)

    runs = {name: [] for name in CONTESTANTS}
    for _ in range(rounds):
        for name in CONTESTANTS:
            runs[name].append(run_child(name, examples, epochs))
            print(f"{name}: {runs[name][-1]}", file=sys.stderr)

    def median(name, key):
        return statistics.median(r[key] for r in runs[name])

    # Each round's pair, run one after the other: the machine's drifts cancel in the ratio.
    ratios = {name: statistics.median(w["per_epoch"] / plain["per_epoch"] for w, plain in zip(runs[name], runs["plain"]))
              for name in CONTESTANTS[1:]}
    record = machine(torch.device("cpu"))
    result = {"machine": record, "child_env": {"OMP_NUM_THREADS": "1"}, "examples": examples, "batch": 128,
              "measured_epochs": epochs, "rounds": rounds, "quick": args.quick, "runs": runs,
              "ratio_per_epoch": ratios, "bar": 1.10}
    lines = heading("ParallelWrapper CPU time under OMP_NUM_THREADS=1 (1 worker vs plain fit)", record, args.quick)
    lines += [f"Children run with OMP_NUM_THREADS=1; seed LeNet, batch 128, {examples} MNIST examples, "
              f"{epochs} measured epoch(s) after a warm-up one, {rounds} interleaved round(s); the machine has "
              f"{os.cpu_count()} cores. CPU seconds (user + system), medians over rounds.", "",
              "| | intra-op threads | CPU per epoch | / plain (per round, median) | start-up | whole child |",
              "|---|---|---|---|---|---|"]
    for name in CONTESTANTS:
        threads = runs[name][0]["worker_threads"] or runs[name][0]["threads"]  # the worker's, or the plain fit's
        ratio = "1.00" if name == "plain" else f"{ratios[name]:.2f}"
        start = "" if name == "plain" else f"{median(name, 'start_up'):.2f} s"
        lines.append(f"| {name} | {threads} | {median(name, 'per_epoch'):.2f} s | "
                     f"{ratio} | {start} | {median(name, 'whole_child'):.2f} s |")
    verdict = "within" if ratios["wrapper"] <= 1.10 else "above"
    lines += ["", f"Wrapper / plain CPU per epoch: {ratios['wrapper']:.2f} ({verdict} the issue's bar of 1.10)."]
    write(args.out, "parallel-threads-cpu", result, lines)


if __name__ == "__main__":
    main()
