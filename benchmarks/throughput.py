"""Training samples/s of the seed LeNet: dl4py eager / compiled / CUDA graphs, per precision,
against a hand-written eager PyTorch loop fed by a standard DataLoader.

    python benchmarks/throughput.py [--device auto|cpu|gpu] [--quick] [--batches 128,512]
                                    [--precisions float,...] [--modes eager,compiled,cuda-graphs]
                                    [--examples N] [--epochs 3]

Every row trains on the same MNIST slice (whole batches: ``drop_last``, so that shapes stay
static for CUDA graphs) through its ordinary path: ``MultiLayerNetwork.fit`` with dl4py's
defaults (on a GPU: the data held on the device, fused optimizer, channels_last) and the
environment's ``compile`` / ``cuda_graphs``. The baseline is the loop most PyTorch code
has: ``DataLoader(TensorDataset(x, y), batch_size, shuffle=True)`` (no workers; pinned memory
and asynchronous copies on a GPU, as PyTorch's guide advises), float32, PyTorch's default
optimizer kernels. A second hand-written row keeps the data on the device and slices it, as
dl4py does, so the table shows how much of the speed-up is feeding and how much the step.
The first epoch (compilation, CUDA graph capture, cuDNN's choices) is reported apart;
samples/s is the median of the timed epochs. Writes throughput-<cpu|gpu>.json and .md to --out.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

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

PRECISIONS = {"cpu": ["float", "bfloat16", "mixed-bf16"],  # fp16 has no fast CPU kernels
              "gpu": ["float", "half", "bfloat16", "mixed-fp16", "mixed-bf16"]}
MODES = {"eager": {"compile": "off", "cuda_graphs": False},
         "compiled": {"compile": "default", "cuda_graphs": False},
         "cuda-graphs": {"compile": "default", "cuda_graphs": True}}  # Inductor's cudagraph trees


def timed_epochs(run_epoch, device, epochs: int) -> tuple[float, list[float]]:
    """(seconds of the first epoch, seconds of each later one)."""
    times = []
    for _ in range(epochs + 1):
        sync(device)
        start = time.perf_counter()
        run_epoch()
        sync(device)
        times.append(time.perf_counter() - start)
    return times[0], times[1:]


def baseline(config, data, batch: int, device, epochs: int) -> tuple[float, list[float]]:
    model = hand_written_lenet().to(device)
    optimizer = hand_written_optimizer(model, config)
    gpu = device.type == "cuda"
    loader = DataLoader(TensorDataset(data.features, data.labels), batch_size=batch, shuffle=True, drop_last=True,
                        pin_memory=gpu)

    def epoch():
        for x, y in loader:
            x, y = x.to(device, non_blocking=gpu), y.to(device, non_blocking=gpu)
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()

    return timed_epochs(epoch, device, epochs)


def dl4py_row(config, data, device, precision: str, mode: str, epochs: int) -> tuple[float, list[float]]:
    backend = "gpu" if device.type == "cuda" else "cpu"
    if mode != "eager":
        torch._dynamo.reset()  # a fresh compile per row: dynamo stops recompiling after a few
    with settings(**MODES[mode]):  # read when the model builds its step
        net = MultiLayerNetwork(config, backend=backend, precision=precision).init()
        return timed_epochs(lambda: net.fit(data, epochs=1, verbose=0), device, epochs)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--batches", default="128,512")
    p.add_argument("--precisions", help="comma-separated (default: all that are fast on the device)")
    p.add_argument("--modes", help="comma-separated: eager, compiled, cuda-graphs (GPU only)")
    p.add_argument("--examples", type=int, help="examples per epoch (default 6400 on a CPU, 60000 on a GPU)")
    p.add_argument("--epochs", type=int, default=3, help="timed epochs after the first")
    args = p.parse_args()
    device = device_of(args.device)
    kind = label(device)
    batches = [128] if args.quick else [int(b) for b in args.batches.split(",")]
    precisions = (args.precisions.split(",") if args.precisions
                  else ["float"] if args.quick else PRECISIONS[kind])
    modes = args.modes.split(",") if args.modes else ["eager", "compiled"] + (["cuda-graphs"] if kind == "gpu" else [])
    if kind == "cpu" and "cuda-graphs" in modes:
        p.error("cuda-graphs needs a GPU (--device gpu)")
    examples = args.examples or (1280 if args.quick else 6400 if kind == "cpu" else 60000)
    epochs = 1 if args.quick else args.epochs

    config = seed_lenet()
    rows = []
    for batch in batches:
        data = MnistDataSetIterator(batch, train=True, seed=12345, limit=examples, drop_last=True)
        n = data.total_examples()
        first, later = baseline(config, data, batch, device, epochs)
        base = n / statistics.median(later)
        rows.append({"batch": batch, "loop": "PyTorch eager + DataLoader", "precision": "float", "mode": "eager",
                     "first_epoch_s": first, "epoch_s": later, "samples_per_second": base, "speedup": 1.0})
        features, labels = data.features[:n].to(device), data.labels[:n].to(device)  # whole batches, as the others
        first, later = timed_epochs(hand_written_epoch(config, features, labels, batch, device), device, epochs)
        rate = n / statistics.median(later)
        rows.append({"batch": batch, "loop": "PyTorch eager, data on the device", "precision": "float",
                     "mode": "eager", "first_epoch_s": first, "epoch_s": later, "samples_per_second": rate,
                     "speedup": rate / base})
        for precision in precisions:
            for mode in modes:
                first, later = dl4py_row(config, data, device, precision, mode, epochs)
                rate = n / statistics.median(later)
                rows.append({"batch": batch, "loop": "dl4py", "precision": precision, "mode": mode,
                             "first_epoch_s": first, "epoch_s": later, "samples_per_second": rate,
                             "speedup": rate / base})
                print(f"batch {batch} {precision} {mode}: {rate:,.0f} samples/s ({rate / base:.2f}x)", flush=True)

    record = machine(device)
    result = {"benchmark": "throughput", **record, "quick": args.quick, "examples_per_epoch": examples,
              "timed_epochs": epochs, "rows": rows}
    lines = heading(f"Training throughput: seed LeNet on MNIST, {kind.upper()}", record, args.quick) + [
        "| batch | loop | precision | mode | samples/s | vs baseline | first epoch (s) |",
        "|---|---|---|---|---|---|---|",
        *(f"| {r['batch']} | {r['loop']} | {r['precision']} | {r['mode']} | {r['samples_per_second']:,.0f} | "
          f"**{r['speedup']:.2f}x** | {r['first_epoch_s']:.2f} |" for r in rows),
        "",
        f"{examples} examples per epoch, median of {epochs} timed epoch(s) after the first; the first "
        "includes compilation and CUDA graph capture. Baseline: PyTorch eager + DataLoader (float).",
    ]
    write(args.out, f"throughput-{kind}", result, lines)


if __name__ == "__main__":
    main()
