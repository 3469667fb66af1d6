"""The training loop's own cost per step, this checkout against another (before a redesign).

    python benchmarks/loop_overhead.py --other OTHER_SRC [--pairs 5]

A network so small (8 -> 16 -> 3, batch 8, one thread) that a step is mostly the loop's own
Python: the epoch loop, the step, the counters, the listeners' fan-out. Each pair runs one
process on ``OTHER_SRC`` (a ``src`` folder of another commit: ``git worktree add``) and one on
this checkout, in turn, so that machine load hits both alike; each process reports the best of
3 epochs of 1,024 steps. The figure is the median over pairs of this checkout's time per step
over the other's (1.00: the same). Writes loop-overhead-cpu.json and .md to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# One process's measurement: microseconds per step, best of 3 epochs after a warm-up epoch.
PROGRAM = """
import time, torch
torch.set_num_threads(1)
from dl4py import ArrayDataSetIterator, DenseLayer, InputType, MultiLayerNetwork, NetworkConfig, OutputLayer, Sgd
config = NetworkConfig(layers=[DenseLayer(n_out=16, activation="relu"), OutputLayer(n_out=3)],
                       input_type=InputType.feed_forward(8), updater=Sgd(0.1), seed=1)
net = MultiLayerNetwork(config).init()
gen = torch.Generator().manual_seed(0)
data = ArrayDataSetIterator(torch.randn(8192, 8, generator=gen), torch.randint(0, 3, (8192,), generator=gen),
                            batch_size=8, shuffle=False)
net.fit(data, epochs=1, verbose=0)
times = []
for _ in range(3):
    start = time.perf_counter()
    net.fit(data, epochs=1, verbose=0)
    times.append(time.perf_counter() - start)
print(min(times) / 1024 * 1e6)
"""


def per_step(src: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"loop_overhead: the run on {src} failed: {done.stderr.strip().splitlines()[-1:]}")
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--other", type=Path, required=True, help="the src folder of the checkout to compare with")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    if not (args.other / "dl4py" / "__init__.py").is_file():
        raise SystemExit(f"loop_overhead: {args.other} is not a src folder holding dl4py/")
    pairs = [(per_step(args.other), per_step(ROOT / "src")) for _ in range(args.pairs)]
    ratios = [mine / other for other, mine in pairs]
    commit = subprocess.run(["git", "-C", str(args.other), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    record = {"benchmark": "loop-overhead", "other_commit": commit, "machine": f"CPU, {platform.platform()}",
              "threads": 1,
              "pairs_us_per_step": [{"other": round(o, 1), "this": round(m, 1)} for o, m in pairs],
              "ratio_median": round(statistics.median(ratios), 3), "ratio_range": [round(min(ratios), 3),
                                                                                     round(max(ratios), 3)]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "loop-overhead-cpu.json").write_text(json.dumps(record, indent=2) + "\n")
    rows = "\n".join(f"| {i + 1} | {o:.1f} | {m:.1f} | {m / o:.3f} |" for i, (o, m) in enumerate(pairs))
    (args.out / "loop-overhead-cpu.md").write_text(
        f"# Training-loop cost per step: this checkout against {commit}\n\n"
        f"{record['machine']}, 1 thread; 8 -> 16 -> 3 MLP, batch 8, best of 3 epochs of 1,024 steps each.\n\n"
        "| pair | other (us/step) | this (us/step) | this / other |\n|---|---|---|---|\n" + rows +
        f"\n\nMedian ratio **{record['ratio_median']}** (range {record['ratio_range'][0]} to "
        f"{record['ratio_range'][1]}).\n")
    print(f"this / other, per step: median {record['ratio_median']} over {args.pairs} pairs")


if __name__ == "__main__":
    main()
