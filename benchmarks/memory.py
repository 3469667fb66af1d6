"""The memory estimator against measurement, and batch_size auto on a real device.

    python benchmarks/memory.py                 # CPU: live tensor bytes (TorchDispatchMode)
    python benchmarks/memory.py --device gpu    # CUDA: torch.cuda.max_memory_allocated

For the seed LeNet, the MLP 784-4000-4000-10 and the small VGG (examples/), batch sizes
32..1024, float and bfloat16: the estimated peak of a training step against the measured
one. On a GPU it also trains a few steps at the batch size `batch_size: auto` would pick
and records whether any ran out of memory. Writes benchmarks/results/memory-<device>.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from dl4py import MultiLayerNetwork, RunConfig  # noqa: E402
from dl4py.io import atomic_write_json, atomic_write_text  # noqa: E402
from dl4py.memory import estimate, measure_training_step  # noqa: E402
from dl4py.memory.auto import AUTO_MARGIN  # noqa: E402
from dl4py.memory.capacity import device_memory, max_batch_size  # noqa: E402

MODELS = {"lenet": "lenet_mnist.yaml", "mlp-4000": "mlp_4000.yaml", "vgg-small": "vgg_small.yaml"}


def _batch(config, n: int, device):
    shape = config.input_type.example_shape()
    return torch.rand(n, *shape, device=device), torch.randint(0, 10, (n,), device=device)


def measure(config, batch: int, precision: str, device: torch.device) -> int:
    net = MultiLayerNetwork(config, backend="gpu" if device.type == "cuda" else "cpu", precision=precision).init()
    features, labels = _batch(config, batch, device)
    if device.type != "cuda":
        return measure_training_step(net, features, labels).peak_bytes
    from dl4py.train.step import make_train_step

    step = make_train_step(net)
    features = net.precision.convert_input(features)
    step(features[:2], labels[:2])  # the updater's state, cuBLAS' workspace
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step(features, labels)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def auto_batch_runs(config, precision: str, device: torch.device) -> dict:
    """Train 3 steps at the batch auto would choose; an OutOfMemoryError is a failure."""
    torch.cuda.empty_cache()
    memory = device_memory(device)
    budget = memory.bytes + torch.cuda.memory_allocated(device)
    batch = max_batch_size(config, budget, precision, device="cuda", margin=AUTO_MARGIN, context=False)
    net = MultiLayerNetwork(config, backend="gpu", precision=precision).init()
    from dl4py.train.step import make_train_step

    step, ok = make_train_step(net), True
    try:
        features, labels = _batch(config, batch, device)
        for _ in range(3):
            step(net.precision.convert_input(features), labels)
        torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError:
        ok = False
    peak = torch.cuda.max_memory_allocated()
    del net, step
    torch.cuda.empty_cache()
    return {"batch_size": batch, "ran_without_oom": ok, "max_memory_allocated": peak, "budget": budget}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--batches", default="32,128,512,1024")
    args = parser.parse_args()
    device = torch.device("cuda" if args.device == "gpu" else "cpu")
    rows = []
    for name, file in MODELS.items():
        config = RunConfig.from_file(ROOT / "examples" / file).network
        for precision in ("float", "bfloat16"):
            for batch in map(int, args.batches.split(",")):
                report = estimate(config, batch, precision, device=device.type)
                # max_memory_allocated counts cuBLAS' workspace but not the CUDA context
                estimated = report.peak_bytes + report.fixed.get("cublas_workspace", 0)
                measured = measure(config, batch, precision, device)
                rows.append({"model": name, "precision": precision, "batch_size": batch,
                             "estimated": estimated, "measured": measured, "error": estimated / measured - 1})
                print(f"{name:10s} {precision:9s} {batch:5d}  estimated {estimated / 2**20:9.1f} MiB  "
                      f"measured {measured / 2**20:9.1f} MiB  {rows[-1]['error']:+.2%}", flush=True)
    auto = {}
    if device.type == "cuda":
        for name, file in MODELS.items():
            config = RunConfig.from_file(ROOT / "examples" / file).network
            auto[name] = auto_batch_runs(config, "float", device)
            print(name, "auto:", auto[name], flush=True)
    what = ("torch.cuda.max_memory_allocated" if device.type == "cuda"
            else "live tensor bytes (TorchDispatchMode)")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [f"Device: {name}, torch {torch.__version__}; measured: {what}.", "",
             "| model | precision | batch | estimated MiB | measured MiB | error |", "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {r['model']} | {r['precision']} | {r['batch_size']} | {r['estimated'] / 2**20:.1f} | "
              f"{r['measured'] / 2**20:.1f} | {r['error']:+.2%} |" for r in rows]
    if auto:
        lines += ["", "| model | auto batch | ran without OOM | peak MiB | budget MiB |", "|---|---:|---|---:|---:|"]
        lines += [f"| {m} | {a['batch_size']:,} | {a['ran_without_oom']} | {a['max_memory_allocated'] / 2**20:.0f} | "
                  f"{a['budget'] / 2**20:.0f} |" for m, a in auto.items()]
    out = ROOT / "benchmarks" / "results" / f"memory-{args.device}"
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out.with_suffix(".json"), {"device": name, "torch": torch.__version__, "rows": rows, "auto": auto})
    atomic_write_text(out.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
