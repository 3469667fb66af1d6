"""Wall seconds to 99.0% MNIST test accuracy with a run config's network and schedule.

    python benchmarks/time_to_accuracy.py [--config examples/lenet_mnist_fast.yaml]
        [--device auto|cpu|gpu] [--quick] [--runs 5] [--target 0.99] [--epochs E] [--batch B]
        [--updater adam|nesterovs] [--lr LR] [--precision P] [--mode eager|compiled|cuda-graphs]

The network, updater, learning-rate schedule, epochs, batch size, precision and compile
setting come from ``--config`` (default examples/lenet_mnist_fast.yaml: the seed's LeNet with
batch normalization and ReLU after its poolings, Adam one-cycle, 2 epochs at batch 256); the
rest of the file (data, backend, workers) is not read: MNIST, one device.
Flags override them; a schedule's ``total_steps`` is set to the updates the run makes (whole
batches: ``epochs * (60000 // batch)``), whatever the file says. ``--updater`` (with ``--lr``,
default 0.004 Adam, 0.15 Nesterov) replaces the config's updater, keeping its schedule. On a
GPU, precision and mode default to mixed-bf16 with CUDA graphs instead of the file's.

The data is held on the device. The test set is evaluated after every epoch, and that counts
toward the time; a run stops at the first evaluation at or above the target.

Compilation, CUDA graph capture and cuDNN's first choices happen in a warm-up run that is
timed and reported apart; each of the ``--runs`` timed runs then starts from fresh weights
(seed = run index, reshuffled data) in the same, already compiled model, so it pays for
training and evaluation only. Copying the data to the device is reported apart, too.
The figure is the median over the runs (a run that misses the target counts as infinite);
the accuracy each run ended at and how many reached the target are reported beside it.
Writes time-to-accuracy-<cpu|gpu>.json and .md to --out.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from pathlib import Path

import torch

from _common import ROOT, device_of, heading, label, machine, parser, settings, sync, write
from dl4py import (Adam, DeviceDataSetIterator, MnistDataSetIterator, MultiLayerNetwork, Nesterovs, NetworkConfig,
                   RunConfig)
from dl4py.config.schedules import OneCycleSchedule
from dl4py.errors import ConfigError
from dl4py.nn.serialization import model_bytes, restore_state

MODES = {"eager": {"compile": "off", "cuda_graphs": False},
         "compiled": {"compile": "default", "cuda_graphs": False},
         "cuda-graphs": {"compile": "default", "cuda_graphs": True}}
DEFAULT_CONFIG = ROOT / "examples" / "lenet_mnist_fast.yaml"
GPU_DEFAULTS = {"precision": "mixed-bf16", "mode": "cuda-graphs"}  # what trains fastest on a GPU


def mode_of(config: RunConfig) -> str:
    """The benchmark mode a config's ``environment.compile`` asks for (a CPU has no CUDA graphs)."""
    return "compiled" if config.environment.compile in ("default", "max-autotune") else "eager"


def network(args, config: RunConfig, steps: int, seed: int):
    """The config's network, seeded, its schedule stretched over the ``steps`` this run makes."""
    updater = config.network.updater
    if args.updater is not None:  # the flags' updater, on the config's schedule
        updater = (Nesterovs(learning_rate=args.lr, momentum=0.9, schedule=updater.schedule)
                   if args.updater == "nesterovs" else Adam(learning_rate=args.lr, schedule=updater.schedule))
    elif args.lr is not None:
        updater = dataclasses.replace(updater, learning_rate=args.lr)
    if updater.schedule is None:  # a config without one gets the one-cycle the benchmark always had
        updater = dataclasses.replace(updater, schedule=OneCycleSchedule(
            total_steps=steps, warmup_fraction=0.2, start_factor=0.1, end_factor=0.0))
    elif hasattr(updater.schedule, "total_steps"):
        updater = dataclasses.replace(updater, schedule=dataclasses.replace(updater.schedule, total_steps=steps))
    return dataclasses.replace(config.network, updater=updater, seed=seed)


def describe_schedule(net_config) -> str:
    schedule = net_config.updater.schedule
    if not isinstance(schedule, OneCycleSchedule):
        return repr(schedule)
    return (f"one_cycle over {schedule.total_steps} updates: warm-up {schedule.warmup_fraction:.0%} from "
            f"{schedule.start_factor}x, {schedule.anneal} decay to {schedule.end_factor}x")


def accuracy(net, x: torch.Tensor, y: torch.Tensor) -> float:
    return net.output(x, batch_size=x.shape[0]).argmax(1).eq(y).float().mean().item()  # .item(): waits


def training_set(args, seed: int, device):
    """The shuffled training set on the device, and the seconds that took (outside the timed run)."""
    sync(device)
    start = time.perf_counter()
    data = DeviceDataSetIterator(
        MnistDataSetIterator(args.batch, train=True, seed=seed, drop_last=True, limit=args.limit), device)
    sync(device)
    return data, time.perf_counter() - start


def train_to_target(net, data, test_x, test_y, args, device) -> dict:
    evaluations = []
    sync(device)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        net.fit(data, epochs=1, verbose=0)
        acc = accuracy(net, test_x, test_y)
        evaluations.append({"epoch": epoch + 1, "seconds": time.perf_counter() - start, "accuracy": acc})
        if acc >= args.target:
            break
    reached = evaluations[-1]["accuracy"] >= args.target
    return {"seconds": evaluations[-1]["seconds"] if reached else None, "reached": reached,
            "final_accuracy": evaluations[-1]["accuracy"], "evaluations": evaluations}


def _shown_path(path: Path) -> str:
    """The config's path as the record shows it: relative to the repository when inside it."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def _seconds(run: dict) -> str:
    return f"{run['seconds']:.3f}" if run["reached"] else "missed"


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="a run config (YAML or JSON)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--target", type=float, default=0.99)
    p.add_argument("--epochs", type=int, help="length of the schedule; the most a run trains (default: the config's)")
    p.add_argument("--batch", type=int, help="default: the config's training.batch_size")
    p.add_argument("--updater", choices=["adam", "nesterovs"], help="default: the config's updater")
    p.add_argument("--lr", type=float, help="peak learning rate (default: the config's; with --updater, "
                                            "0.004 Adam, 0.15 Nesterov)")
    p.add_argument("--precision", help="default: mixed-bf16 on a GPU, the config's on a CPU")
    p.add_argument("--mode", choices=list(MODES), help="default: cuda-graphs on a GPU, the config's compile on a CPU")
    p.add_argument("--limit", type=int, help="train on the first N examples only")
    p.add_argument("--note", default="", help="a line for the record: what else the machine was doing")
    args = p.parse_args()
    try:
        config = RunConfig.from_file(args.config)
    except ConfigError as exc:
        p.error(str(exc))
    if not isinstance(config.network, NetworkConfig):
        p.error(f"{args.config}: network must be a stack of layers (a MultiLayerNetwork), not a graph")
    if not isinstance(config.training.batch_size, int) and args.batch is None:
        p.error(f"{args.config}: training.batch_size must be a number here (or pass --batch)")
    device = device_of(args.device)
    kind = label(device)
    args.epochs = args.epochs or config.training.epochs
    args.batch = args.batch or config.training.batch_size
    args.precision = args.precision or (GPU_DEFAULTS["precision"] if kind == "gpu" else config.training.precision)
    args.mode = args.mode or (GPU_DEFAULTS["mode"] if kind == "gpu" else mode_of(config))
    if args.updater is not None and args.lr is None:
        args.lr = 0.15 if args.updater == "nesterovs" else 0.004
    if args.quick:  # the code path, not the figure: a slice, one run, a reachable target
        args.runs, args.epochs, args.limit, args.target = 1, 1, args.limit or 10240, min(args.target, 0.8)
    if kind == "cpu" and args.mode == "cuda-graphs":
        p.error("cuda-graphs needs a GPU (--device gpu)")
    backend = "gpu" if kind == "gpu" else "cpu"

    test = MnistDataSetIterator(10_000, train=False, shuffle=False)
    test_x, test_y = test.features.to(device), test.labels.to(device)
    first_data, copy_seconds = training_set(args, 0, device)
    steps = args.epochs * len(first_data)
    fresh = {}
    for seed in range(args.runs):  # each run's starting weights, made before any timing
        fresh[seed] = model_bytes(MultiLayerNetwork(network(args, config, steps, seed), backend=backend,
                                                    precision=args.precision).init())
    net_config = network(args, config, steps, 0)
    with settings(**MODES[args.mode]):  # read when the model builds its step
        net = MultiLayerNetwork(net_config, backend=backend, precision=args.precision).init()
        restore_state(net, fresh[0])
        sync(device)
        start = time.perf_counter()
        warm_up = train_to_target(net, first_data, test_x, test_y, args, device)  # compiles, captures
        warm_up_seconds = time.perf_counter() - start
        runs = []
        for seed in range(args.runs):
            data, _ = (first_data, None) if seed == 0 else training_set(args, seed, device)
            restore_state(net, fresh[seed])
            runs.append({"seed": seed, **train_to_target(net, data, test_x, test_y, args, device)})
            print(f"run {seed}: {_seconds(runs[-1])} s to target, accuracy {runs[-1]['final_accuracy']:.4f}", flush=True)
            del data

    times = [r["seconds"] if r["reached"] else math.inf for r in runs]
    median = statistics.median(times)
    record = machine(device)
    updater = net_config.updater
    config_name = _shown_path(args.config)
    setup = {"config": config_name, "batch": args.batch, "updater": updater.type_name,
             "peak_lr": updater.learning_rate, "epochs": args.epochs, "schedule": describe_schedule(net_config),
             "precision": args.precision, "mode": args.mode, "target": args.target, "limit": args.limit,
             "data": "held on the device", "evaluation": "test set after every epoch, counted"}
    final = [r["final_accuracy"] for r in runs]
    result = {"benchmark": "time-to-accuracy", **record, "quick": args.quick, "note": args.note, "setup": setup,
              "median_seconds": None if math.isinf(median) else median,
              "reached": sum(r["reached"] for r in runs), "final_accuracy": {"min": min(final), "max": max(final),
                                                                             "median": statistics.median(final)},
              "runs": runs,
              "warm_up_seconds": warm_up_seconds, "warm_up": warm_up, "data_to_device_seconds": copy_seconds}
    shown = "not reached" if math.isinf(median) else f"{median:.3f} s"
    lines = heading(f"Time to {args.target:.1%} MNIST test accuracy: {config_name}, {kind.upper()}", record,
                    args.quick) + [
        f"**median {shown}** over {len(runs)} runs; **{result['reached']} of {len(runs)} reached "
        f"{args.target:.1%}**; final test accuracy {min(final):.2%} to {max(final):.2%} (median "
        f"{statistics.median(final):.2%}). Warm-up run (compilation, graph capture) {warm_up_seconds:.2f} s; "
        f"training set to the device {copy_seconds:.3f} s (neither counted).",
        "",
        f"`{config_name}`: batch {args.batch}, {updater.type_name} peak lr {updater.learning_rate}, "
        f"{describe_schedule(net_config)} ({args.epochs} epoch(s)), precision {args.precision}, mode {args.mode}, "
        "test set evaluated after every epoch (counted).",
        *(["", f"Note: {args.note}"] if args.note else []),
        "",
        "| run (seed) | seconds to target | epochs | final accuracy | accuracy at each evaluation |",
        "|---|---|---|---|---|",
        *(f"| {r['seed']} | {_seconds(r)} | {len(r['evaluations'])} | {r['final_accuracy']:.4f} | "
          + ", ".join(f"{e['accuracy']:.4f} @ {e['seconds']:.2f}s" for e in r["evaluations"]) + " |" for r in runs),
    ]
    write(args.out, f"time-to-accuracy-{kind}", result, lines)


if __name__ == "__main__":
    main()
