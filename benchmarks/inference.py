"""Serving throughput and latency: ParallelInference batched and sequential against a plain loop.

    python benchmarks/inference.py [--device auto|cpu|gpu] [--quick] [--requests 4000] [--clients 16]
                                   [--workers 1] [--batch-limit 32] [--note "what else ran"]

The seed's LeNet (examples/lenet_mnist.yaml) answers single-image requests (MNIST test
images). Each contestant answers the same ``--requests`` requests:

- ``model.output loop``: one thread calling ``model.output`` on one example at a time,
  what a caller without ParallelInference writes;
- ``ParallelInference batched`` / ``sequential`` / ``inplace``, per runtime (``torch``, and
  ``onnx`` where ONNX Runtime is installed and the device is the CPU): ``--clients`` threads
  (16 by default) share the requests, each sending its next as soon as the last is
  answered, to a ParallelInference with ``--workers`` replicas;
- ``ParallelInference batched, <runtime>, 1 client``: the loop's one caller asking a
  ParallelInference instead of ``model.output``; with ``--workers`` above 1, as many callers
  as replicas (``N clients``), each keeping one replica busy;
- with ``--then REV`` (a git revision of this repository), ``model.output loop at REV``: the same
  loop run by dl4py as it was at REV, in a process of its own (its ``src`` from ``git archive``)
  that runs a round when told, so that it takes its turn with the others. ``--then 9e9a5ad``
  is dl4py before issue 33's inference changes: the loop that issue measured its targets by.

requests/s is requests over the wall time from the first request to the last answer;
latency is each request's time from call to answer (p50, p99). Contestants run in turn,
``--repeats`` rounds (A, B, C, D, A, ...); the figures are the median round's.

First, at one thread (``torch.set_num_threads(1)``), what ``model.output`` adds to the
network's own module on one image: ``model.output(image)`` against ``model.module(x)`` under
``torch.no_grad`` (``x`` the prepared input, the module in eval mode; no output activation),
and the same module call under ``torch.inference_mode``. Each of ``OVERHEAD_ROUNDS`` rounds
runs ``OVERHEAD_BLOCKS`` cycles, a block of ``OVERHEAD_BLOCK`` calls of each contestant per
cycle in alternating order; a round's ratio is the median over its cycles of a contestant's
block time over the raw ``no_grad`` block's, so a burst of other load spoils a cycle, not the
round. The figure is the median round's (target for ``model.output``: at most 1.1).
Writes inference-<cpu|gpu>[-N-workers].json and .md to --out.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from _common import ROOT, device_of, heading, label, machine, parser, seed_lenet, sync, write
from dl4py import MnistDataSetIterator, MultiLayerNetwork, ParallelInference

LOOP = "model.output loop"
RAW = "module forward, no_grad"
OVERHEAD_ROUNDS, OVERHEAD_BLOCKS, OVERHEAD_BLOCK = 5, 100, 5


def single_image_overhead(model, image, device):
    """Median over rounds of each contestant's time per call, and of output's ratio to the raw
    module under no_grad, at one thread. Blocks alternate within a round (A B C, C B A, ...), so
    load that comes and goes on a shared machine falls on all of them."""
    module, x = model.module, model.prepare_input(image.to(device))
    module.eval()

    def raw_no_grad():
        with torch.no_grad():
            module(x)

    def raw_inference_mode():
        with torch.inference_mode():
            module(x)

    contestants = {RAW: raw_no_grad, "module forward, inference_mode": raw_inference_mode,
                   "model.output": lambda: model.output(image)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for call in contestants.values():  # warm-up
            for _ in range(OVERHEAD_BLOCK):
                call()
        rounds = []  # per round, per cycle: each contestant's block time
        for _ in range(OVERHEAD_ROUNDS):
            cycles, order = [], list(contestants)
            for _ in range(OVERHEAD_BLOCKS):
                spent = {}
                for name in order:
                    call = contestants[name]
                    began = time.perf_counter()
                    for _ in range(OVERHEAD_BLOCK):
                        call()
                    sync(device)
                    spent[name] = time.perf_counter() - began
                cycles.append(spent)
                order.reverse()
            rounds.append(cycles)
    finally:
        torch.set_num_threads(threads)
    calls = OVERHEAD_BLOCKS * OVERHEAD_BLOCK
    ratios = {name: [statistics.median(c[name] / c[RAW] for c in cycles) for cycles in rounds]
              for name in contestants}
    return {
        "threads": 1, "rounds": OVERHEAD_ROUNDS, "calls_per_round": calls,
        "us_per_call": {name: statistics.median(sum(c[name] for c in cycles) for cycles in rounds) / calls * 1e6
                        for name in contestants},
        "ratio_to_raw": {name: statistics.median(v) for name, v in ratios.items()},
        "round_ratios": ratios,
    }


def plain_loop(model, x, device):
    """One thread, one example per ``model.output`` call."""
    def run():
        latencies = []
        start = time.perf_counter()
        for i in range(len(x)):
            began = time.perf_counter()
            model.output(x[i:i + 1])
            sync(device)
            latencies.append(time.perf_counter() - began)
        return time.perf_counter() - start, latencies, None
    return run


class LoopAtRevision:
    """``plain_loop`` run by dl4py as it was at a git revision, in a child process (this
    script with ``--loop-child``, its ``src`` first on the path) that runs one round per line
    it reads and answers with the round's figures as one JSON line."""

    def __init__(self, revision: str, requests: int, device: str):
        self._folder = tempfile.TemporaryDirectory()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision, "src"], capture_output=True, check=True)
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(self._folder.name, filter="data")
        environment = {**os.environ, "PYTHONPATH": str(Path(self._folder.name) / "src")}
        self._child = subprocess.Popen(
            [sys.executable, __file__, "--loop-child", "--requests", str(requests), "--device", device],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=environment, cwd=ROOT / "benchmarks")
        self.version = self._ask("version")["version"]

    def _ask(self, line: str) -> dict:
        self._child.stdin.write(line + "\n")
        self._child.stdin.flush()
        answer = self._child.stdout.readline()
        if not answer:
            raise RuntimeError(f"the loop at the old revision ended (exit code {self._child.wait()})")
        return json.loads(answer)

    def __call__(self):
        figures = self._ask("run")
        return figures["seconds"], figures["latencies"], None

    def close(self) -> None:
        self._child.stdin.close()
        try:
            self._child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._child.kill()
            self._child.wait()
        self._folder.cleanup()


def loop_child(requests: int, device) -> None:
    """The child of ``LoopAtRevision``: dl4py from the path it was given."""
    import dl4py  # this process's dl4py: the old revision's src, first on its path

    model = MultiLayerNetwork(seed_lenet(), backend="gpu" if device.type == "cuda" else "cpu").init()
    x = MnistDataSetIterator(requests, train=False, shuffle=False, limit=requests).features
    run = plain_loop(model, x, device)
    model.output(x[:64])
    plain_loop(model, x[:256], device)()
    for line in sys.stdin:
        if line.strip() == "version":
            answer = {"version": str(Path(dl4py.__file__).resolve().parent.parent)}
        else:
            seconds, latencies, _ = run()
            answer = {"seconds": seconds, "latencies": latencies}
        print(json.dumps(answer), flush=True)


def served(model, x, mode, clients, workers, batch_limit, runtime):
    """``clients`` threads sharing the requests, against a fresh ParallelInference."""
    def run():
        latencies = [[] for _ in range(clients)]
        with ParallelInference(model, workers=workers, inference_mode=mode, batch_limit=batch_limit,
                               queue_limit=max(64, 2 * clients), runtime=runtime) as inference:
            inference.output(x[:1])  # the replicas' first pass outside the clock

            def client(c):
                for i in range(c, len(x), clients):
                    began = time.perf_counter()
                    inference.output(x[i:i + 1])
                    latencies[c].append(time.perf_counter() - began)

            threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
            start = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            seconds = time.perf_counter() - start
            stats = inference.stats()
        return seconds, [s for per_client in latencies for s in per_client], stats["mean_batch_size"]
    return run


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--requests", type=int, help="requests per contestant per round (default 4000; --quick 400)")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--batch-limit", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--note", default="", help="what the record should say about the machine (other load, ...)")
    p.add_argument("--then", metavar="REV", help="also the model.output loop of dl4py at this git revision")
    p.add_argument("--loop-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    device = device_of(args.device)
    requests = args.requests or (400 if args.quick else 4000)
    repeats = 1 if args.quick else args.repeats
    if args.loop_child:
        return loop_child(requests, device)

    model = MultiLayerNetwork(seed_lenet(), backend="gpu" if device.type == "cuda" else "cpu").init()
    x = MnistDataSetIterator(requests, train=False, shuffle=False, limit=requests).features
    contestants = {LOOP: plain_loop(model, x, device)}
    then = LoopAtRevision(args.then, requests, args.device) if args.then else None
    if then is not None:
        contestants[f"{LOOP} at {args.then}"] = then
    runtimes = ["torch"] + (["onnx"] if device.type == "cpu" and importlib.util.find_spec("onnxruntime") else [])
    for runtime in runtimes:
        for mode in ("batched", "sequential", "inplace") if runtime == "torch" else ("batched", "inplace"):
            contestants[f"ParallelInference {mode}, {runtime}"] = served(
                model, x, mode, args.clients, args.workers, args.batch_limit, runtime)
        # What the loop's caller gets by asking ParallelInference instead of model.output (with
        # several replicas, as many callers: one keeping each busy).
        callers = f"{args.workers} clients" if args.workers > 1 else "1 client"
        contestants[f"ParallelInference batched, {runtime}, {callers}"] = served(
            model, x, "batched", args.workers, args.workers, args.batch_limit, runtime)

    model.output(x[:64])  # warm-up: allocator, kernels
    load_before = list(os.getloadavg())  # other work on the machine shows in the tails
    overhead = single_image_overhead(model, x[:1], device)
    # The first calls after the thread count changes back wait for the intra-op pool's threads
    # (on a loaded machine up to 0.1 s each): warm the loop before any round is timed.
    plain_loop(model, x[:256], device)()
    rounds = {name: [] for name in contestants}
    try:
        for _ in range(repeats):
            for name, run in contestants.items():
                rounds[name].append(run())
    finally:
        if then is not None:
            then.close()

    figures = {}
    for name, runs in rounds.items():
        seconds, latencies, batch = sorted(runs, key=lambda r: r[0])[len(runs) // 2]  # the median round
        ms = np.asarray(latencies) * 1000
        figures[name] = {
            "requests_per_second": requests / seconds,
            "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "mean_batch_size": batch, "round_seconds": [r[0] for r in runs],
        }
    base = figures[LOOP]["requests_per_second"]
    record = machine(device)
    result = {
        "benchmark": "inference", **record, "quick": args.quick, "model": "seed LeNet (examples/lenet_mnist.yaml)",
        "requests": requests, "clients": args.clients, "workers": args.workers, "batch_limit": args.batch_limit,
        "repeats": repeats, "load_average_before": load_before, "load_average_after": list(os.getloadavg()),
        "note": args.note, "then": args.then, "single_image_overhead": overhead,
        "results": figures,
        "speedup_over_loop": {k: v["requests_per_second"] / base for k, v in figures.items()},
        "median_round_seconds": {k: statistics.median(v["round_seconds"]) for k, v in figures.items()},
    }
    lines = heading(
        f"Inference: seed LeNet, {requests} single-image requests, {args.clients} client threads, "
        f"{args.workers} replica(s), batch_limit {args.batch_limit}, {label(device).upper()}", record, args.quick,
    ) + ([f"Machine: {args.note}", ""] if args.note else []) + [
        "## One image at one thread: `model.output` over the module's own forward", "",
        "| call | µs per call (median round) | / module forward under no_grad (median round) |",
        "|---|---|---|",
        *(f"| {k} | {overhead['us_per_call'][k]:,.0f} | **{overhead['ratio_to_raw'][k]:.3f}** |"
          for k in overhead["us_per_call"]),
        "",
        f"{overhead['rounds']} rounds of {overhead['calls_per_round']} calls of each, in alternating blocks of "
        f"{OVERHEAD_BLOCK}; a round's ratio is the median over its cycles of block times. `model.output`'s "
        "ratios per round: "
        + ", ".join(f"{r:.3f}" for r in overhead["round_ratios"]["model.output"]) + ".",
        "",
        "## Serving", "",
        "| contestant | requests/s | p50 latency (ms) | p99 latency (ms) | mean batch | requests/s / loop |",
        "|---|---|---|---|---|---|",
        *(f"| {k} | {v['requests_per_second']:,.0f} | {v['p50_ms']:.2f} | {v['p99_ms']:.2f} | "
          f"{'-' if v['mean_batch_size'] is None else format(v['mean_batch_size'], '.1f')} | "
          f"**{result['speedup_over_loop'][k]:.2f}** |" for k, v in figures.items()),
        "",
        f"The loop is one thread calling `model.output` per example; the others are {args.clients} threads "
        "(1 where it says so) sharing the requests, against a ParallelInference of that runtime (`torch`: "
        "copies of the module; `onnx`: ONNX Runtime on the exported file, one intra-op thread per replica). "
        f"Median of {repeats} interleaved round(s); latency from call to answer. "
        f"Load average (1 min) before and after: {load_before[0]:.2f}, {result['load_average_after'][0]:.2f}.",
    ]
    name = f"inference-{label(device)}" + (f"-{args.workers}-workers" if args.workers > 1 else "")
    write(args.out, name, result, lines)


if __name__ == "__main__":
    main()
