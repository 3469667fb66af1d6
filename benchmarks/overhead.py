"""Overhead of dl4py's training loop against a hand-written PyTorch loop and Lightning's Trainer.

    python benchmarks/overhead.py [--device auto|cpu|gpu] [--quick] [--examples N] [--repeats 7]

All train the seed's LeNet (batch 128, Nesterov SGD, L2 on weights) on the same MNIST
slice, held where each loop reads it best and the same for all (host memory on a CPU,
device memory on a GPU), with a fresh shuffle each epoch. One epoch of each is timed in
turn (A, B, C, D, A, ...) so that drifts in machine load hit all alike; each figure is the
ratio of median epoch times to the hand-written loop's (1.00 = no overhead).

- ``dl4py``: ``MultiLayerNetwork.fit`` with its defaults (fused optimizer where torch has one);
- ``dl4py, StatsListener``: the same, with a ``StatsListener`` at its default frequency (a
  "stats" record every 10 iterations, per-layer statistics, into a ``metrics.jsonl``); its
  cost is reported apart, as the median over rounds of its epoch time over the plain
  ``dl4py`` epoch run just before it (the issue's budget: at most 1.03);
- ``dl4py, like for like``: ``fused_optimizer: off`` and ``channels_last: off``: the same
  kernels as the other two (torch's per-parameter optimizer loop, the default memory
  layout), so its ratio is the loop's own overhead;
- ``hand-written``: zero_grad / forward / loss / backward / step over shuffled index slices,
  with ``torch.optim.SGD(..., foreach=False)`` (torch's default on a CPU);
- ``dl4py, DataLoader`` and ``hand-written, DataLoader``: the like-for-like network and the
  hand-written loop, each reading the same shuffling ``torch.utils.data.DataLoader`` over a
  ``TensorDataset`` (host memory; copied to the GPU per batch there); their ratio is the cost
  of dl4py's DataLoader adapter and loop against ``for x, y in loader`` (reported apart);
- ``lightning``: ``Trainer(barebones=True)`` (its mode for measuring its own overhead), one
  ``fit`` per epoch, the epoch timed by a callback; its set-up per ``fit`` is reported apart.
  Needs ``pip install lightning`` (never a dependency of dl4py); without it the column says so.

Writes overhead-<cpu|gpu>.json and .md to --out.
"""

from __future__ import annotations

import logging
import statistics
import tempfile
import time
import warnings

import torch
import torch.nn.functional as F

from _common import (
    device_of,
    hand_written_epoch,
    hand_written_lenet,
    hand_written_optimizer,
    heading,
    label,
    machine,
    parser,
    seed_lenet,
    settings,
    sync,
    write,
)
from dl4py import MnistDataSetIterator, MultiLayerNetwork
from dl4py.monitor import StatsListener

INSTALL = "pip install lightning"


def lightning_loop(config, features, labels, batch, device):
    """One Lightning fit per call; returns the epoch's seconds (the callback's) and the fit's."""
    import lightning as L
    from torch.utils.data import DataLoader, IterableDataset

    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")
    warnings.filterwarnings("ignore", module="pytorch_lightning")

    class LeNet(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = hand_written_lenet()

        def training_step(self, batch_, _):
            x, y = batch_
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return hand_written_optimizer(self.net, config, foreach=False)

    generator = torch.Generator(device=device).manual_seed(0)

    class ShuffledBatches(IterableDataset):  # what the other loops get: in-memory slices
        def __iter__(self):
            order = torch.randperm(features.shape[0], generator=generator, device=device)
            return ((features[idx], labels[idx]) for idx in order.split(batch))

    class EpochTimer(L.Callback):
        def on_train_epoch_start(self, trainer, module):
            sync(device)
            self.start = time.perf_counter()

        def on_train_epoch_end(self, trainer, module):
            sync(device)
            self.seconds = time.perf_counter() - self.start

    module = LeNet()
    loader = DataLoader(ShuffledBatches(), batch_size=None)

    def epoch():
        timer = EpochTimer()
        trainer = L.Trainer(
            max_epochs=1, accelerator="gpu" if device.type == "cuda" else "cpu",
            devices=[device.index or 0] if device.type == "cuda" else 1,  # the GPU the data is on
            barebones=True, callbacks=[timer],
        )
        start = time.perf_counter()
        trainer.fit(module, loader)
        return timer.seconds, time.perf_counter() - start

    return epoch


def hand_written_loader_epoch(config, loader, device):
    """The hand-written loop over a DataLoader: what a PyTorch user writes."""
    model = hand_written_lenet().to(device)
    optimizer = hand_written_optimizer(model, config, foreach=False)

    def epoch():
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()

    return epoch


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--examples", type=int, help="examples per epoch (default 6400 on a CPU, 60000 on a GPU)")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    device = device_of(args.device)
    examples = args.examples or (1280 if args.quick else 6400 if device.type == "cpu" else 60000)
    repeats = 2 if args.quick else args.repeats

    config = seed_lenet()
    batch = 128
    data = MnistDataSetIterator(batch, train=True, seed=12345, limit=examples)
    features, labels = data.features.to(device), data.labels.to(device)
    backend = "gpu" if device.type == "cuda" else "cpu"

    dl4py_net = MultiLayerNetwork(config, backend=backend).init()
    stats_net = MultiLayerNetwork(config, backend=backend).init()
    stats_dir = tempfile.TemporaryDirectory(prefix="dl4py-overhead-")
    stats = StatsListener(stats_dir.name)  # the default frequency, into stats_dir/metrics.jsonl
    with settings(fused_optimizer="off", channels_last="off"):
        plain_net = MultiLayerNetwork(config, backend=backend).init()
        loader_net = MultiLayerNetwork(config, backend=backend).init()
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(data.features, data.labels), batch_size=batch, shuffle=True,
                        pin_memory=device.type == "cuda")

    def timed(fn):
        def run():
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            return time.perf_counter() - start
        return run

    contestants = {
        "dl4py": timed(lambda: dl4py_net.fit(data, epochs=1, verbose=0)),
        "dl4py, StatsListener": timed(lambda: stats_net.fit(data, epochs=1, listeners=[stats], verbose=0)),
        "dl4py, like for like": timed(lambda: plain_net.fit(data, epochs=1, verbose=0)),
        "hand-written": timed(hand_written_epoch(config, features, labels, batch, device, foreach=False)),
        "dl4py, DataLoader": timed(lambda: loader_net.fit(loader, epochs=1, verbose=0)),
        "hand-written, DataLoader": timed(hand_written_loader_epoch(config, loader, device)),
    }
    lightning_note, fit_seconds = None, []
    try:
        lightning_epoch = lightning_loop(config, features, labels, batch, device)

        def lightning_run():
            epoch_s, fit_s = lightning_epoch()
            fit_seconds.append(fit_s - epoch_s)
            return epoch_s

        contestants["lightning"] = lightning_run
    except ImportError:
        lightning_note = f"not installed: `{INSTALL}` to add this column (it is not a dl4py dependency)"

    for run in contestants.values():  # warm-up: allocator, kernels, caches, the device copy
        run()
    fit_seconds.clear()
    times = {name: [] for name in contestants}
    for _ in range(repeats):
        for name, run in contestants.items():
            times[name].append(run())

    stats_dir.cleanup()
    median = {k: statistics.median(v) for k, v in times.items()}
    # Each round's pair, run one after the other: the machine's drifts cancel in the ratio.
    stats_ratios = [s / d for s, d in zip(times["dl4py, StatsListener"], times["dl4py"])]
    base = median["hand-written"]
    record = machine(device)
    result = {
        "benchmark": "overhead", **record, "quick": args.quick,
        "examples_per_epoch": data.total_examples(), "batch_size": batch, "repeats": repeats,
        "epoch_seconds": times, "median_epoch_seconds": median,
        "samples_per_second": {k: data.total_examples() / v for k, v in median.items()},
        "ratio_to_hand_written": {k: v / base for k, v in median.items()},
        "dataloader_ratio": median["dl4py, DataLoader"] / median["hand-written, DataLoader"],
        "stats_listener_ratio": statistics.median(stats_ratios),
        "stats_listener_ratios": stats_ratios,
        "lightning_fit_setup_seconds": statistics.median(fit_seconds) if fit_seconds else None,
        "lightning_loop": lightning_note or "Trainer(barebones=True), one fit per epoch",
    }
    lines = heading(
        f"Training-loop overhead: seed LeNet, batch {batch}, {data.total_examples()} examples/epoch, "
        f"{label(device).upper()}", record, args.quick,
    ) + [
        "| loop | median epoch (s) | samples/s | time / hand-written |",
        "|---|---|---|---|",
        *(f"| {k} | {median[k]:.3f} | {result['samples_per_second'][k]:,.0f} | "
          f"**{result['ratio_to_hand_written'][k]:.3f}** |" for k in median),
        "",
        f"Median of {repeats} interleaved epochs each, after one warm-up epoch.",
        f"Over the same DataLoader, dl4py `fit(loader)` / hand-written `for x, y in loader`: "
        f"**{result['dataloader_ratio']:.3f}**.",
        f"Cost of a `StatsListener` at its default frequency (every 10 iterations, into metrics.jsonl): "
        f"epoch time with it / without it, median of {repeats} interleaved pairs: "
        f"**{result['stats_listener_ratio']:.3f}** (range {min(stats_ratios):.3f} to {max(stats_ratios):.3f}).",
    ]
    if lightning_note:
        lines.append(f"Lightning: {lightning_note}.")
    else:
        lines.append(f"Lightning: Trainer(barebones=True); its set-up per fit() call, outside the epoch: "
                     f"{result['lightning_fit_setup_seconds']:.3f} s (median).")
    write(args.out, f"overhead-{label(device)}", result, lines)


if __name__ == "__main__":
    main()
