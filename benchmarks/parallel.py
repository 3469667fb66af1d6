"""Training throughput of the seed LeNet with 1, 2 (and 4) ParallelWrapper workers.

    python benchmarks/parallel.py [--device auto|cpu|gpu] [--examples 25600] [--epochs 2]
                                  [--workers 1,2] [--out benchmarks/results]

For each worker count: samples/s over the timed epochs (the first epoch is a warm-up and
not counted; the workers' start-up is reported apart), against the single-device trainer
in the same run. On one GPU, several workers share it (the seed's "workers >= GPUs").
Writes parallel-<device>-avg<K>.json and .md to --out.
"""

from __future__ import annotations

import argparse
import json
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
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()

    config = RunConfig.from_file(ROOT / "examples" / "lenet_mnist.yaml").network
    backend = dl4py.resolve_backend(args.device)
    kind = backend.device.type
    counts = [int(c) for c in (args.workers or ("1,2,4" if kind == "cuda" else "1,2")).split(",")]
    data = MnistDataSetIterator(128, train=True, seed=12345, limit=args.examples)
    timed = args.epochs - 1

    def rate(summaries) -> float:
        rest = summaries[1:]
        return sum(s.examples for s in rest) / sum(s.seconds for s in rest)

    rows = []
    single = MultiLayerNetwork(config, backend=args.device)
    rows.append({"trainer": "single device (no wrapper)", "workers": 1,
                 "samples_per_second": rate(single.fit(data, epochs=args.epochs)), "startup_seconds": 0.0})
    for workers in counts:
        model = MultiLayerNetwork(config, backend=args.device)
        wrapper = ParallelWrapper(model, workers=workers, averaging_frequency=args.averaging_frequency,
                                  prefetch_buffer=16)
        started = time.perf_counter()
        summaries = wrapper.fit(data, epochs=args.epochs)
        wall = time.perf_counter() - started
        rows.append({"trainer": "ParallelWrapper", "workers": workers, "samples_per_second": rate(summaries),
                     "startup_seconds": wall - sum(s.seconds for s in summaries)})
    base = rows[0]["samples_per_second"]
    for row in rows:
        row["vs_single_device"] = row["samples_per_second"] / base

    device_name = torch.cuda.get_device_name(backend.device) if kind == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
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


if __name__ == "__main__":
    main()
