"""Wall seconds to 99.0% MNIST test accuracy with the seed LeNet's architecture.

    python benchmarks/time_to_accuracy.py [--device auto|cpu|gpu] [--quick] [--runs 5]
        [--target 0.99] [--epochs 3] [--batch 512] [--updater adam|nesterovs] [--lr 0.004]
        [--precision P] [--mode eager|compiled|cuda-graphs]

The network is the seed's (two 5x5 convolutions with max pooling, dense 500, softmax 10;
L2 5e-4); the schedule is ours: a one-cycle learning rate (warm-up over the first 20% of
the updates, linear decay to zero) over ``--epochs`` epochs of whole batches, the data held
on the device. The test set is evaluated after every epoch, and that counts toward the
time; a run stops at the first evaluation at or above the target.

Compilation, CUDA graph capture and cuDNN's first choices happen in a warm-up run that is
timed and reported apart; each of the ``--runs`` timed runs then starts from fresh weights
(seed = run index, reshuffled data) in the same, already compiled model, so it pays for
training and evaluation only. Copying the data to the device is reported apart, too.
The figure is the median over the runs (a run that misses the target counts as infinite).
Writes time-to-accuracy-<cpu|gpu>.json and .md to --out.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import torch

from _common import device_of, heading, label, machine, parser, seed_lenet, settings, sync, write
from dl4py import Adam, DeviceDataSetIterator, MnistDataSetIterator, MultiLayerNetwork, Nesterovs
from dl4py.config.schedules import OneCycleSchedule
from dl4py.nn.serialization import model_bytes, restore_state

MODES = {"eager": {"compile": "off", "cuda_graphs": False},
         "compiled": {"compile": "default", "cuda_graphs": False},
         "cuda-graphs": {"compile": "default", "cuda_graphs": True}}
DEFAULTS = {  # per device: what trains fastest there
    "gpu": {"precision": "mixed-bf16", "mode": "cuda-graphs"},
    "cpu": {"precision": "float", "mode": "eager"},
}


def network(args, steps: int, seed: int):
    schedule = OneCycleSchedule(total_steps=steps, warmup_fraction=0.2, start_factor=0.1, end_factor=0.0)
    updater = (Nesterovs(learning_rate=args.lr, momentum=0.9, schedule=schedule) if args.updater == "nesterovs"
               else Adam(learning_rate=args.lr, schedule=schedule))
    return dataclasses.replace(seed_lenet(), updater=updater, seed=seed)


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


def _seconds(run: dict) -> str:
    return f"{run['seconds']:.3f}" if run["reached"] else "missed"


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--target", type=float, default=0.99)
    p.add_argument("--epochs", type=int, default=3, help="length of the schedule; the most a run trains")
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--updater", choices=["adam", "nesterovs"], default="adam")
    p.add_argument("--lr", type=float, help="peak learning rate (default 0.004 Adam, 0.15 Nesterov)")
    p.add_argument("--precision", help="default: mixed-bf16 on a GPU, float on a CPU")
    p.add_argument("--mode", choices=list(MODES), help="default: cuda-graphs on a GPU, eager on a CPU")
    p.add_argument("--limit", type=int, help="train on the first N examples only")
    args = p.parse_args()
    device = device_of(args.device)
    kind = label(device)
    args.precision = args.precision or DEFAULTS[kind]["precision"]
    args.mode = args.mode or DEFAULTS[kind]["mode"]
    args.lr = args.lr or (0.15 if args.updater == "nesterovs" else 0.004)
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
        fresh[seed] = model_bytes(MultiLayerNetwork(network(args, steps, seed), backend=backend,
                                                    precision=args.precision).init())
    with settings(**MODES[args.mode]):  # read when the model builds its step
        net = MultiLayerNetwork(network(args, steps, 0), backend=backend, precision=args.precision).init()
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
    setup = {"batch": args.batch, "updater": args.updater, "peak_lr": args.lr, "epochs": args.epochs,
             "schedule": "one_cycle: warm-up 20% from 0.1x, linear decay to 0", "precision": args.precision,
             "mode": args.mode, "target": args.target, "limit": args.limit, "data": "held on the device"}
    result = {"benchmark": "time-to-accuracy", **record, "quick": args.quick, "setup": setup,
              "median_seconds": None if math.isinf(median) else median,
              "reached": sum(r["reached"] for r in runs), "runs": runs,
              "warm_up_seconds": warm_up_seconds, "warm_up": warm_up, "data_to_device_seconds": copy_seconds}
    shown = "not reached" if math.isinf(median) else f"{median:.3f} s"
    lines = heading(f"Time to {args.target:.1%} MNIST test accuracy: seed LeNet, {kind.upper()}", record, args.quick) + [
        f"**median {shown}** over {len(runs)} runs ({result['reached']} reached the target); "
        f"warm-up run (compilation, graph capture) {warm_up_seconds:.2f} s; training set to the device "
        f"{copy_seconds:.3f} s (neither counted).",
        "",
        f"Batch {args.batch}, {args.updater} peak lr {args.lr}, one-cycle over {args.epochs} epoch(s), "
        f"precision {args.precision}, mode {args.mode}, test set evaluated after every epoch (counted).",
        "",
        "| run (seed) | seconds to target | epochs | accuracy at each evaluation |",
        "|---|---|---|---|",
        *(f"| {r['seed']} | {_seconds(r)} | {len(r['evaluations'])} | "
          + ", ".join(f"{e['accuracy']:.4f} @ {e['seconds']:.2f}s" for e in r["evaluations"]) + " |" for r in runs),
    ]
    write(args.out, f"time-to-accuracy-{kind}", result, lines)


if __name__ == "__main__":
    main()
