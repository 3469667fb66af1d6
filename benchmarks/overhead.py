"""Overhead of dl4py's training loop against a hand-written PyTorch loop.

    python benchmarks/overhead.py [--examples 6400] [--repeats 7] [--out benchmarks/results]

Both train the seed's LeNet (batch 128, Nesterov SGD, L2 on weights) on the same MNIST
slice held in memory, with a fresh shuffle each epoch. One epoch of each is timed in
turn (A, B, A, B, ...) so that drifts in machine load hit both alike; the figure is the
ratio of the median epoch times, dl4py / hand-written (1.00 = no overhead).
Writes overhead.json and overhead.md to --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import dl4py  # noqa: E402
from dl4py import MnistDataSetIterator, MultiLayerNetwork, RunConfig  # noqa: E402


def hand_written_lenet() -> nn.Module:
    return nn.Sequential(
        nn.Unflatten(1, (1, 28, 28)),
        nn.Conv2d(1, 20, 5), nn.MaxPool2d(2, 2),
        nn.Conv2d(20, 50, 5), nn.MaxPool2d(2, 2),
        nn.Flatten(), nn.Linear(800, 500), nn.ReLU(), nn.Linear(500, 10),
    )


def hand_written_epoch(model, optimizer, features, labels, batch_size, generator) -> None:
    order = torch.randperm(features.shape[0], generator=generator)
    for idx in order.split(batch_size):
        x, y = features[idx], labels[idx]
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=6400)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()

    config = RunConfig.from_file(ROOT / "examples" / "lenet_mnist.yaml")
    lr, momentum, l2 = config.network.updater.learning_rate, config.network.updater.momentum, config.network.l2
    batch = config.training.batch_size
    data = MnistDataSetIterator(batch, train=True, seed=12345, limit=args.examples)

    net = MultiLayerNetwork(config.network, backend="cpu").init()
    hand = hand_written_lenet()
    weights = [p for n, p in hand.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in hand.named_parameters() if n.endswith("bias")]
    optimizer = torch.optim.SGD(
        [{"params": weights, "weight_decay": l2}, {"params": biases, "weight_decay": 0.0}],
        lr=lr, momentum=momentum, nesterov=True,
    )
    generator = torch.Generator().manual_seed(0)

    def run_dl4py():
        net.fit(data, epochs=1)

    def run_hand():
        hand_written_epoch(hand, optimizer, data.features, data.labels, batch, generator)

    run_dl4py(), run_hand()  # warm-up: allocator, kernels, caches
    times = {"dl4py": [], "hand_written": []}
    for _ in range(args.repeats):
        for name, fn in (("dl4py", run_dl4py), ("hand_written", run_hand)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)

    median = {k: statistics.median(v) for k, v in times.items()}
    ratio = median["dl4py"] / median["hand_written"]
    result = {
        "benchmark": "overhead",
        "device": "cpu",
        "cpu_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "dl4py": dl4py.__version__,
        "examples_per_epoch": data.total_examples(),
        "batch_size": batch,
        "repeats": args.repeats,
        "epoch_seconds": times,
        "median_epoch_seconds": median,
        "samples_per_second": {k: data.total_examples() / v for k, v in median.items()},
        "ratio_dl4py_over_hand_written": ratio,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overhead.json").write_text(json.dumps(result, indent=2) + "\n")
    table = "\n".join([
        f"# Training-loop overhead (seed LeNet, batch {batch}, {data.total_examples()} examples/epoch, "
        f"CPU, {torch.get_num_threads()} threads, torch {torch.__version__})",
        "",
        "| loop | median epoch (s) | samples/s |",
        "|---|---|---|",
        *(f"| {k} | {median[k]:.3f} | {result['samples_per_second'][k]:,.0f} |" for k in median),
        "",
        f"dl4py / hand-written = **{ratio:.3f}** (median of {args.repeats} interleaved epochs each)",
    ])
    (args.out / "overhead.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
