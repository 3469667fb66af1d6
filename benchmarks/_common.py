"""What the benchmarks share: flags, the device, the seed LeNet, settings, result files."""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import dl4py  # noqa: E402
from dl4py import RunConfig  # noqa: E402
from dl4py.io import atomic_write_json, atomic_write_text  # noqa: E402


def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "gpu"])
    p.add_argument("--quick", action="store_true", help="a short smoke run; not figures for the record")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    return p


def device_of(choice: str) -> torch.device:
    return dl4py.resolve_backend(choice).device


def label(device: torch.device) -> str:
    """File-name suffix: cpu or gpu (as the --device flag says)."""
    return "gpu" if device.type == "cuda" else "cpu"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seed_lenet() -> dl4py.NetworkConfig:
    """The seed's LeNet (examples/lenet_mnist.yaml): Nesterov 0.03/0.9, L2 5e-4, batch 128."""
    return RunConfig.from_file(ROOT / "examples" / "lenet_mnist.yaml").network


def hand_written_lenet() -> nn.Module:
    """The same network written as plain PyTorch."""
    return nn.Sequential(
        nn.Unflatten(1, (1, 28, 28)),
        nn.Conv2d(1, 20, 5), nn.MaxPool2d(2, 2),
        nn.Conv2d(20, 50, 5), nn.MaxPool2d(2, 2),
        nn.Flatten(), nn.Linear(800, 500), nn.ReLU(), nn.Linear(500, 10),
    )


def hand_written_optimizer(module: nn.Module, config: dl4py.NetworkConfig, foreach=None) -> torch.optim.Optimizer:
    """The seed's updater as a PyTorch user writes it: L2 on weights; torch's default kernels
    (foreach on CUDA, the for-loop on a CPU) unless ``foreach`` says otherwise."""
    updater = config.updater
    weights = [p for n, p in module.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in module.named_parameters() if n.endswith("bias")]
    return torch.optim.SGD(
        [{"params": weights, "weight_decay": config.l2}, {"params": biases, "weight_decay": 0.0}],
        lr=updater.learning_rate, momentum=updater.momentum, nesterov=True, foreach=foreach,
    )


def hand_written_epoch(config: dl4py.NetworkConfig, features, labels, batch: int, device, foreach=None):
    """An epoch function of the hand-written loop over data already where it trains:
    shuffled index slices, zero_grad / forward / loss / backward / step."""
    import torch.nn.functional as F

    model = hand_written_lenet().to(device)
    optimizer = hand_written_optimizer(model, config, foreach=foreach)
    generator = torch.Generator(device=device).manual_seed(0)

    def epoch():
        order = torch.randperm(features.shape[0], generator=generator, device=device)
        for idx in order.split(batch):
            x, y = features[idx], labels[idx]
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()

    return epoch


def settings(**values):
    """dl4py environment settings for a block; models built inside keep what they read."""
    return dl4py.environment().temporarily(**values)


def machine(device: torch.device) -> dict:
    record = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "dl4py": dl4py.__version__,
        "python": platform.python_version(),
    }
    try:
        import lightning

        record["lightning"] = lightning.__version__
    except ImportError:
        pass
    return record


def write(out: Path, stem: str, result: dict, markdown: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / f"{stem}.json", result)
    atomic_write_text(out / f"{stem}.md", "\n".join(markdown) + "\n")
    print("\n".join(markdown))
    print(f"\nwritten: {out / stem}.json, {out / stem}.md", file=sys.stderr)


def heading(title: str, record: dict, quick: bool) -> list[str]:
    where = f"{record['device']}, torch {record['torch']}, {record['cpu_threads']} CPU threads"
    lines = [f"# {title}", "", f"{where}; {record['platform']}"]
    if quick:
        lines += ["", "**--quick smoke run: not figures for the record.**"]
    return lines + [""]
