"""Training throughput of the seed LeNet with 1, 2 (and 4) ParallelWrapper workers, and
the cost of DL4J's one-fit-per-epoch loop.

    python benchmarks/parallel.py [--device auto|cpu|gpu] [--examples 25600] [--epochs 2]
                                  [--workers 1,2] [--rows throughput,repeated-fits]
                                  [--repeats 3] [--out benchmarks/results]

``throughput``: for each worker count, samples/s over the timed epochs (the first epoch is
a warm-up and not counted; the workers' start-up is reported apart), against the
single-device trainer in the same run. On one GPU, several workers share it (the seed's
"workers >= GPUs"). Writes parallel-<device>-avg<K>.json and .md to --out.

``repeated-fits``: three ``wrapper.fit(epochs=1)`` on one wrapper against one
``fit(epochs=3)``, 2 workers, each timed whole (wall clock, worker start-up and close
included), in turn ``--repeats`` times so that drifts in machine load hit both alike; the
figure is the ratio of the medians (1.00: repeated fits cost nothing). Writes
parallel-repeated-fits-<device>.json and .md to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import dl4py  # noqa: E402
from dl4py import MnistDataSetIterator, MultiLayerNetwork, RunConfig  # noqa: E402
from dl4py.parallel import ParallelWrapper  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "gpu"])
    parser.add_argument("--examples", type=int, default=25_600)
    parser.add_argument("--epochs", type=int, default=3, help="including one warm-up epoch")
    parser.add_argument("--workers", default=None, help="comma-separated counts (default 1,2 on CPU; 1,2,4 on GPU)")
    parser.add_argument("--averaging-frequency", type=int, default=3, help="rounds between averages (the seed uses 3)")
    parser.add_argument("--rows", default="throughput,repeated-fits", help="which tables: throughput, repeated-fits")
    parser.add_argument("--repeats", type=int, default=3, help="repeated-fits: timings of each way, interleaved")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()

    config = RunConfig.from_file(ROOT / "examples" / "lenet_mnist.yaml").network
    backend = dl4py.resolve_backend(args.device)
    kind = backend.device.type
    data = MnistDataSetIterator(128, train=True, seed=12345, limit=args.examples)
    device_name = torch.cuda.get_device_name(backend.device) if kind == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    rows = args.rows.split(",")
    if "throughput" in rows:
        throughput(args, config, kind, data, device_name)
    if "repeated-fits" in rows:
        repeated_fits(args, config, kind, data, device_name)


def throughput(args, config, kind: str, data, device_name: str) -> None:
    counts = [int(c) for c in (args.workers or ("1,2,4" if kind == "cuda" else "1,2")).split(",")]
    timed = args.epochs - 1

    def rate(summaries) -> float:
        rest = summaries[1:]
        return sum(s.examples for s in rest) / sum(s.seconds for s in rest)

    rows = []
    single = MultiLayerNetwork(config, backend=args.device)
    rows.append({"trainer": "single device (no wrapper)", "workers": 1,
                 "samples_per_second": rate(single.fit(data, epochs=args.epochs, verbose=0)), "startup_seconds": 0.0})
    for workers in counts:
        model = MultiLayerNetwork(config, backend=args.device)
        wrapper = ParallelWrapper(model, workers=workers, averaging_frequency=args.averaging_frequency,
                                  prefetch_buffer=16)
        started = time.perf_counter()
        summaries = wrapper.fit(data, epochs=args.epochs, verbose=0)
        wall = time.perf_counter() - started
        rows.append({"trainer": "ParallelWrapper", "workers": workers, "samples_per_second": rate(summaries),
                     "startup_seconds": wall - sum(s.seconds for s in summaries)})
    base = rows[0]["samples_per_second"]
    for row in rows:
        row["vs_single_device"] = row["samples_per_second"] / base

    result = {"device": device_name, "torch": torch.__version__, "examples_per_epoch": data.total_examples(),
              "timed_epochs": timed, "batch_size": 128, "averaging_frequency": args.averaging_frequency, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"parallel-{kind}-avg{args.averaging_frequency}"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# Seed LeNet, ParallelWrapper throughput: {device_name}, torch {torch.__version__}",
        "",
        f"{data.total_examples()} examples/epoch, batch 128, averaging every {args.averaging_frequency} rounds, "
        f"{timed} timed epochs after one warm-up.",
        "",
        "| trainer | workers | samples/s | vs single device | worker start-up (s) |",
        "|---|---|---|---|---|",
        *(f"| {r['trainer']} | {r['workers']} | {r['samples_per_second']:,.0f} | {r['vs_single_device']:.2f}x | "
          f"{r['startup_seconds']:.1f} |" for r in rows),
    ]
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def repeated_fits(args, config, kind: str, data, device_name: str, workers: int = 2, epochs: int = 3) -> None:
    """DL4J's loop (one ``fit`` per epoch) against one ``fit`` of all the epochs."""
    def one_fit_per_epoch() -> float:
        model = MultiLayerNetwork(config, backend=args.device)
        started = time.perf_counter()
        with ParallelWrapper(model, workers=workers, averaging_frequency=args.averaging_frequency) as wrapper:
            for _ in range(epochs):
                wrapper.fit(data, epochs=1, verbose=0)
        assert wrapper._pool.starts == 1, "the workers were started more than once"
        return time.perf_counter() - started

    def one_fit() -> float:
        model = MultiLayerNetwork(config, backend=args.device)
        started = time.perf_counter()
        with ParallelWrapper(model, workers=workers, averaging_frequency=args.averaging_frequency) as wrapper:
            wrapper.fit(data, epochs=epochs, verbose=0)
        return time.perf_counter() - started

    contestants = {f"{epochs} x fit(epochs=1)": one_fit_per_epoch, f"1 x fit(epochs={epochs})": one_fit}
    seconds = {name: [] for name in contestants}
    for _ in range(args.repeats):
        for name, run in contestants.items():
            seconds[name].append(run())
    median = {name: statistics.median(times) for name, times in seconds.items()}
    repeated, single = median.values()
    result = {"device": device_name, "torch": torch.__version__, "examples_per_epoch": data.total_examples(),
              "batch_size": 128, "workers": workers, "epochs": epochs, "averaging_frequency": args.averaging_frequency,
              "repeats": args.repeats, "wall_seconds": seconds, "median_wall_seconds": median,
              "ratio": repeated / single}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"parallel-repeated-fits-{kind}"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# Seed LeNet, ParallelWrapper: one fit per epoch against one fit: {device_name}, torch {torch.__version__}",
        "",
        f"{data.total_examples()} examples/epoch, batch 128, {workers} workers, averaging every "
        f"{args.averaging_frequency} rounds; wall clock of the whole, worker start-up included; median of "
        f"{args.repeats} interleaved runs each.",
        "",
        "| way | median wall (s) | runs (s) |",
        "|---|---|---|",
        *(f"| {name} | {median[name]:.1f} | {', '.join(f'{t:.1f}' for t in seconds[name])} |" for name in seconds),
        "",
        f"Ratio, {epochs} fits / 1 fit: **{result['ratio']:.2f}** (target <= 1.2).",
    ]
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
