"""The memory estimator against measurement, and batch_size auto on a real device.

    python benchmarks/memory.py                 # CPU: live tensor bytes (TorchDispatchMode)
    python benchmarks/memory.py --batches 32    # a quick run
    python benchmarks/memory.py --device gpu    # CUDA: torch.cuda.max_memory_allocated

For the seed LeNet, the MLP 784-4000-4000-10 and the small VGG (examples/), batch sizes
32..1024, float and bfloat16: the estimated peak of a training step against the measured
one. On a GPU the comparison is on the step's own tensors: max_memory_allocated less what
the allocator held at the reset for anything but the model and the batch (cuBLAS'
workspaces: none, one or two, of 1 to 32 MiB, depending on torch and the GPU), which gets
a column of its own, as does the estimate's full total. On a GPU it also trains a few
steps at the batch size `batch_size: auto` picks and records whether they ran. Writes
benchmarks/results/memory-<device>.{json,md}, before the auto phase and again after it.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from dl4py import MultiLayerNetwork, RunConfig  # noqa: E402
from dl4py.io import atomic_write_json, atomic_write_text  # noqa: E402
from dl4py.memory import estimate, measure_training_step  # noqa: E402
from dl4py.memory.auto import auto_batch_size, training_budget  # noqa: E402
from dl4py.memory.capacity import device_memory  # noqa: E402
from dl4py.memory.measure import cuda_allocated_besides, resident_tensors  # noqa: E402

MODELS = {"lenet": "lenet_mnist.yaml", "mlp-4000": "mlp_4000.yaml", "vgg-small": "vgg_small.yaml"}
MiB = 2**20


def _batch(config, n: int, device):
    shape = config.input_type.example_shape()
    return torch.rand(n, *shape, device=device), torch.randint(0, 10, (n,), device=device)


def release(device: torch.device) -> int:
    """Free what earlier cases left and return the bytes still allocated. The first
    torch.optim optimizer of a process can keep its network alive in a reference cycle
    until gc runs; cuBLAS keeps a workspace per handle and stream until told to let go."""
    gc.collect()
    if device.type != "cuda":
        return 0
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # private: absent is fine
    if clear_workspaces is not None:
        clear_workspaces()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device)


def measure(config, batch: int, precision: str, device: torch.device, baseline: int) -> dict:
    """The measured peak of one step; on a GPU also what the allocator held besides it."""
    leftover = release(device) - baseline
    net = MultiLayerNetwork(config, backend="gpu" if device.type == "cuda" else "cpu", precision=precision).init()
    features, labels = _batch(config, batch, device)
    if device.type != "cuda":
        return {"measured": measure_training_step(net, features, labels).peak_bytes}
    from dl4py.train.step import make_train_step

    step = make_train_step(net)
    features = net.precision.convert_input(features)
    step(features[:2], labels[:2])  # the updater's state, cuBLAS' workspaces (forward and backward threads)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    outside = cuda_allocated_besides(resident_tensors(net) + [features, labels], device)
    step(features, labels)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return {"measured": peak - outside, "outside_step": outside, "max_memory_allocated": peak,
            "leftover_at_start": leftover}


def compare(args, device: torch.device, baseline: int) -> list[dict]:
    rows = []
    for name, file in MODELS.items():
        config = RunConfig.from_file(ROOT / "examples" / file).network
        for precision in ("float", "bfloat16"):
            for batch in map(int, args.batches.split(",")):
                report = estimate(config, batch, precision, device=device.type)
                row = {"model": name, "precision": precision, "batch_size": batch, "estimated": report.peak_bytes,
                       "estimated_total": report.total_bytes, **measure(config, batch, precision, device, baseline)}
                row["error"] = row["estimated"] / row["measured"] - 1
                rows.append(row)
                outside = f"  outside the step {row['outside_step'] / MiB:6.1f} MiB" if "outside_step" in row else ""
                print(f"{name:10s} {precision:9s} {batch:5d}  estimated {row['estimated'] / MiB:9.1f} MiB  "
                      f"measured {row['measured'] / MiB:9.1f} MiB  {row['error']:+.2%}{outside}", flush=True)
    return rows


def auto_batch_run(run_config: RunConfig, device: torch.device, baseline: int) -> dict:
    """Train 3 steps at the batch auto chooses once the model is on the device. An
    out-of-memory error is a failure; so is any other RuntimeError (a kernel's limit)."""
    record = {"leftover_at_start": release(device) - baseline, "completed": False, "error": None}
    torch.cuda.reset_peak_memory_stats(device)
    try:
        _train_at_auto_batch(run_config, device, record)
    except RuntimeError as error:  # torch.cuda.OutOfMemoryError among them
        record["error"] = f"{type(error).__name__}: {error}"[:500]
    free, total = torch.cuda.mem_get_info(device)
    # What competes with the budget: the allocator's reserve, and the context outside it.
    record.update(max_memory_allocated=torch.cuda.max_memory_allocated(device),
                  max_memory_reserved=torch.cuda.max_memory_reserved(device), device_used=total - free,
                  device_total=total)
    return record


def _train_at_auto_batch(run_config: RunConfig, device: torch.device, record: dict) -> None:
    from dl4py.train.step import make_train_step

    net = MultiLayerNetwork(run_config.network, backend="gpu", precision=run_config.training.precision).init()
    budget, context = training_budget(device_memory(device), device)
    record.update(budget=budget, context_charged=context)
    batch, record["why"] = auto_batch_size(run_config, device, train_examples=1 << 62, example_bytes=0)
    record["batch_size"] = batch
    step = make_train_step(net)
    features, labels = _batch(run_config.network, batch, device)
    for _ in range(3):
        step(net.precision.convert_input(features), labels)
    torch.cuda.synchronize(device)
    record["completed"] = True


def markdown(device_name: str, what: str, rows: list[dict], auto: dict) -> str:
    lines = [f"Device: {device_name}, torch {torch.__version__}; measured: {what}.", "",
             "| model | precision | batch | estimated MiB | measured MiB | error | outside the step MiB "
             "| estimate's total MiB |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        outside = f"{r['outside_step'] / MiB:.1f}" if "outside_step" in r else "-"
        lines.append(f"| {r['model']} | {r['precision']} | {r['batch_size']} | {r['estimated'] / MiB:.1f} | "
                     f"{r['measured'] / MiB:.1f} | {r['error']:+.2%} | {outside} | {r['estimated_total'] / MiB:.1f} |")
    if auto:
        lines += ["", "| model | auto batch | completed | error | peak allocated MiB | peak reserved MiB "
                      "| device used MiB | budget MiB |", "|---|---:|---|---|---:|---:|---:|---:|"]
        for m, a in auto.items():
            batch = f"{a['batch_size']:,}" if "batch_size" in a else "-"
            budget = f"{a['budget'] / MiB:.0f}" if "budget" in a else "-"
            error = (a["error"] or "").split("\n")[0].replace("|", "/")  # the JSON keeps all of it
            lines.append(f"| {m} | {batch} | {a['completed']} | {error} | "
                         f"{a['max_memory_allocated'] / MiB:.0f} | {a['max_memory_reserved'] / MiB:.0f} | "
                         f"{a['device_used'] / MiB:.0f} | {budget} |")
    return "\n".join(lines) + "\n"


def write(out: Path, device_name: str, what: str, rows: list[dict], auto: dict) -> str:
    text = markdown(device_name, what, rows, auto)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out.with_suffix(".json"), {"device": device_name, "torch": torch.__version__, "measured": what,
                                                 "rows": rows, "auto": auto})
    atomic_write_text(out.with_suffix(".md"), text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--batches", default="32,128,512,1024")
    args = parser.parse_args()
    device = torch.device("cuda" if args.device == "gpu" else "cpu")
    baseline = release(device)
    what = ("torch.cuda.max_memory_allocated, less what was allocated outside the step at its start"
            if device.type == "cuda" else "live tensor bytes (TorchDispatchMode)")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    out = ROOT / "benchmarks" / "results" / f"memory-{args.device}"
    rows = compare(args, device, baseline)
    text = write(out, name, what, rows, {})  # kept even if the auto phase dies
    auto = {}
    if device.type == "cuda":
        for model, file in MODELS.items():
            run_config = RunConfig.from_file(ROOT / "examples" / file).with_overrides(["training.precision=float"])
            auto[model] = auto_batch_run(run_config, device, baseline)
            print(model, "auto:", auto[model], flush=True)
            text = write(out, name, what, rows, auto)
    print(text, end="")


if __name__ == "__main__":
    main()
