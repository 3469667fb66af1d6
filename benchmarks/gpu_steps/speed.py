"""Step 4: the speed targets. The seed LeNet at batch 128: dl4py's fastest configuration
against the eager DataLoader loop most PyTorch code has (target: 3x); and seconds of
training to 99.0% MNIST test accuracy (target: under 1.0 s on one GPU).

Both run the benchmarks that `dl4py bench` runs (throughput.py, time_to_accuracy.py), with
shorter settings, in processes of their own; their JSON is read back. On a CPU the figures
are recorded and the targets, which are GPU claims, are not applied.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gpu_steps._check import Check

BENCHMARKS = Path(__file__).resolve().parents[1]
FAST_CONFIG = BENCHMARKS.parent / "examples" / "lenet_mnist_fast.yaml"  # the schedule `dl4py bench` times
THROUGHPUT_TARGET = 3.0  # dl4py's fastest / PyTorch eager + DataLoader
SECONDS_TO_99_TARGET = 1.0
CANDIDATES = {"gpu": {"precisions": "float,bfloat16,mixed-bf16", "modes": "eager,cuda-graphs"},
              "cpu": {"precisions": "float", "modes": "eager"}}


def run(check: Check) -> None:
    with check.part("throughput"):
        throughput(check)
    with check.part("time to accuracy"):
        time_to_accuracy(check)


def throughput(check: Check) -> None:
    candidates = CANDIDATES[check.backend]
    result = benchmark(check, "throughput.py", "--batches", "128", "--precisions", candidates["precisions"],
                       "--modes", candidates["modes"], "--examples", str(check.steps(30_000, 1_280)),
                       "--epochs", str(check.steps(2, 1)))
    rows = [{k: r[k] for k in ("loop", "precision", "mode", "samples_per_second", "speedup")} for r in result["rows"]]
    check.figure("throughput_rows", rows)
    best = max((r for r in rows if r["loop"] == "dl4py"), key=lambda r: r["samples_per_second"])
    check.figure("fastest", f"{best['precision']} {best['mode']}: {best['samples_per_second']:,.0f} samples/s")
    check.figure("fastest_vs_dataloader_loop", round(best["speedup"], 3))
    if check.gpu:
        check.expect(best["speedup"] >= THROUGHPUT_TARGET,
                     f"fastest dl4py LeNet is {best['speedup']:.2f}x the eager DataLoader loop (target {THROUGHPUT_TARGET}x)")


def time_to_accuracy(check: Check) -> None:
    # --quick's own slice (10,240 examples, target 80%) takes half a minute on a small CPU: a smaller one,
    # eager, as compiling would take longer than the slice trains.
    extra = (["--runs", "3"] if not check.quick else ["--quick"] if check.gpu
             else ["--quick", "--limit", "2048", "--batch", "128", "--target", "0.3", "--mode", "eager"])
    result = benchmark(check, "time_to_accuracy.py", "--config", str(FAST_CONFIG), *extra)
    check.figure("time_to_accuracy", {k: result.get(k) for k in ("median_seconds", "reached", "final_accuracy",
                                                                   "warm_up_seconds", "data_to_device_seconds")}
                 | {"setup": result.get("setup"), "runs": [r["seconds"] for r in result.get("runs", [])]})
    target = result["setup"]["target"]
    check.expect(result["reached"] > 0, f"no run reached {target:.1%} test accuracy")
    if check.gpu and not check.quick:
        median = result["median_seconds"]
        check.expect(median is not None and median < SECONDS_TO_99_TARGET,
                     f"median time to {target:.1%}: {median} s (target under {SECONDS_TO_99_TARGET} s)")


def benchmark(check: Check, script: str, *arguments: str) -> dict:
    out = check.work_dir / script.removesuffix(".py")
    command = [sys.executable, str(BENCHMARKS / script), "--device", check.backend, "--out", str(out), *arguments]
    done = subprocess.run(command, capture_output=True, text=True)
    print(done.stdout[-4000:], done.stderr[-4000:], sep="\n")
    if done.returncode != 0:
        raise RuntimeError(f"{script} exited {done.returncode}: {done.stderr.strip().splitlines()[-1:] or ''}")
    return json.loads(next(out.glob("*.json")).read_text())
