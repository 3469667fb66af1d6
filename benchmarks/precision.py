"""Speed and memory of the seed LeNet in each precision, against float in the same run.

    python benchmarks/precision.py [--device auto|cpu|gpu] [--batch 128] [--steps 60]
                                   [--precisions float,bfloat16,mixed-bf16,...] [--out DIR]

Per precision: training samples/s (median of timed windows, after warm-up), the bytes of
parameters, the bytes of parameters + updater state + master weights, and on CUDA the
peak allocated memory of a training step (``torch.cuda.max_memory_allocated``). Every
figure is also given as a ratio to float. Writes precision-<device>.json and .md to --out.
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
from dl4py import MultiLayerNetwork, RunConfig  # noqa: E402

DEFAULT_PRECISIONS = {
    "cpu": ["float", "double", "bfloat16", "mixed-bf16"],  # fp16 has no fast CPU kernels
    "cuda": ["float", "double", "half", "bfloat16", "mixed-fp16", "mixed-bf16"],
}


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def state_bytes(net) -> dict:
    params = tensor_bytes(net.module.parameters())
    updater = tensor_bytes(
        v for state in net.optimizer.state.values() for v in state.values() if torch.is_tensor(v)
    )
    masters = tensor_bytes(net.precision_state.named_master_parameters().values())
    return {"parameters": params, "updater_state": updater, "master_weights": masters,
            "total": params + updater + masters}


def measure(config, precision: str, backend: str, batch: int, steps: int, windows: int) -> dict:
    net = MultiLayerNetwork(config, backend=backend, precision=precision).init()
    device = net.device
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(batch, 784, generator=gen).to(device)
    y = torch.randint(0, 10, (batch,), generator=gen).to(device)
    data = dl4py.ArrayDataSetIterator(x.cpu(), y.cpu(), batch_size=batch, shuffle=False)
    # Whole-device data so the figure is the step, not the host-to-device copy.
    batches = [net._prepare(b) for b in data]
    net.fit(data, epochs=1, verbose=0)  # builds the step, warms kernels and the allocator
    step = net._train_step
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)  # its GPU, not cuda:0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(5):
        step(*batches[0])
    rates = []
    for _ in range(windows):
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            step(*batches[0])
        sync()
        rates.append(steps * batch / (time.perf_counter() - start))
    result = {"precision": precision, "samples_per_second": statistics.median(rates), "bytes": state_bytes(net)}
    if device.type == "cuda":
        result["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "gpu"])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("--precisions")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()

    config = RunConfig.from_file(ROOT / "examples" / "lenet_mnist.yaml").network
    backend = dl4py.resolve_backend(args.device)
    kind = backend.device.type
    precisions = args.precisions.split(",") if args.precisions else DEFAULT_PRECISIONS[kind]
    if "float" not in precisions:
        precisions = ["float", *precisions]
    rows = [measure(config, p, args.device, args.batch, args.steps, args.windows) for p in precisions]
    base = next(r for r in rows if r["precision"] == "float")
    for r in rows:
        r["speed_vs_float"] = r["samples_per_second"] / base["samples_per_second"]
        r["state_bytes_vs_float"] = r["bytes"]["total"] / base["bytes"]["total"]
        r["param_bytes_vs_float"] = r["bytes"]["parameters"] / base["bytes"]["parameters"]
        if "peak_allocated_bytes" in r:
            r["peak_vs_float"] = r["peak_allocated_bytes"] / base["peak_allocated_bytes"]

    device_name = torch.cuda.get_device_name(backend.device) if kind == "cuda" else "CPU"
    meta = {"device": device_name, "torch": torch.__version__, "batch": args.batch,
            "threads": torch.get_num_threads(), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"precision-{kind}"
    (args.out / f"{stem}.json").write_text(json.dumps(meta, indent=2) + "\n")
    peak = kind == "cuda"
    lines = [
        f"# Seed LeNet per precision: {device_name}, batch {args.batch}, torch {torch.__version__}",
        "",
        "| precision | samples/s | vs float | param bytes | params+updater+masters | vs float |"
        + (" peak allocated | vs float |" if peak else ""),
        "|---|---|---|---|---|---|" + ("---|---|" if peak else ""),
    ]
    for r in rows:
        line = (f"| {r['precision']} | {r['samples_per_second']:,.0f} | {r['speed_vs_float']:.2f}x | "
                f"{r['bytes']['parameters']:,} | {r['bytes']['total']:,} | {r['state_bytes_vs_float']:.2f}x |")
        if peak:
            line += f" {r['peak_allocated_bytes']:,} | {r['peak_vs_float']:.2f}x |"
        lines.append(line)
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
