"""Wall time of a 4-experiment sweep with 1, 2 and 4 experiments at a time on one device.

    python benchmarks/sweep.py [--devices 0|cpu] [--per-device 1,2,4] [--examples 10000]
                               [--epochs 1] [--out benchmarks/results]

Four seed-LeNet runs (learning rate 0.005, 0.01, 0.02, 0.04) as one ``dl4py sweep`` per
``--per-device`` value. ``--per-device 1`` on one device runs them one after another: the
baseline the others are compared with. Every figure is the sweep's whole wall time,
process start-ups (Python, torch, MNIST) included, since that is what a user waits for.
Writes sweep-<device>.json and .md to --out.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from dl4py import sweep  # noqa: E402
from dl4py.io import atomic_write_json, atomic_write_text  # noqa: E402
from dl4py.sweep.slots import available_cpus  # noqa: E402

RATES = [0.005, 0.01, 0.02, 0.04]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="0" if torch.cuda.is_available() else "cpu",
                        help="one GPU index, or cpu (default: GPU 0 when there is one)")
    parser.add_argument("--per-device", default="1,2,4", help="comma-separated slot counts; 1 is the baseline")
    parser.add_argument("--examples", type=int, default=10_000, help="training examples per run")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    counts = [int(c) for c in args.per_device.split(",")]
    overrides = [f"data.limit_train={args.examples}", "data.limit_test=2000", f"training.epochs={args.epochs}",
                 "training.score_every=0"]

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for k in counts:
            started = time.perf_counter()
            result = sweep.run(ROOT / "examples" / "lenet_mnist.yaml", grid={"network.updater.learning_rate": RATES},
                               overrides=overrides, devices=args.devices, per_device=k,
                               output=Path(folder) / f"k{k}", progress=False)
            wall = time.perf_counter() - started
            if result.counts["completed"] != len(RATES):
                failed = "; ".join(f"{r['experiment']}: {r.get('error')}" for r in result.failed)
                raise SystemExit(f"--per-device {k}: {result.counts}; {failed}")
            rows.append({"per_device": k, "wall_seconds": wall,
                         "mean_experiment_seconds": sum(r["seconds"] for r in result.rows) / len(result.rows),
                         "best_test_accuracy": result.best["test_accuracy"]})
    base = next((r["wall_seconds"] for r in rows if r["per_device"] == 1), rows[0]["wall_seconds"])
    for row in rows:
        row["vs_one_at_a_time"] = base / row["wall_seconds"]

    gpu = args.devices.strip().lower() != "cpu"
    device = torch.cuda.get_device_name(int(args.devices)) if gpu else f"CPU ({available_cpus()} cores)"
    result = {"device": device, "torch": torch.__version__, "experiments": len(RATES),
              "examples_per_run": args.examples, "epochs": args.epochs, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"sweep-{'gpu' if gpu else 'cpu'}"
    atomic_write_json(args.out / f"{stem}.json", result)
    lines = [
        f"# dl4py sweep, 4 seed-LeNet runs on one device: {device}, torch {torch.__version__}",
        "",
        (f"{args.examples} training examples, {args.epochs} epoch(s) per run; wall time of the whole sweep, "
         "process start-ups included."),
        "",
        "| per device | sweep wall (s) | mean run (s) | speed-up vs one at a time |",
        "|---|---|---|---|",
        *(f"| {r['per_device']} | {r['wall_seconds']:.1f} | {r['mean_experiment_seconds']:.1f} | "
          f"{r['vs_one_at_a_time']:.2f}x |" for r in rows),
    ]
    atomic_write_text(args.out / f"{stem}.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
