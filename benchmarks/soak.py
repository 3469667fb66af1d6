"""Memory soak: does memory stay flat when the same work is done again and again?

    python benchmarks/soak.py [--device auto|cpu|gpu] [--quick] [--fits 20] [--epochs 10]
                              [--sweeps 10] [--serve-seconds 300] [--inference-seconds 120]
                              [--scenarios fits,epochs,sweep,serve,inference] [--out benchmarks/results]

``make soak`` runs it in full (about 10 minutes on 2 cores, 5 of them serving). Five
scenarios (``soak_scenarios.py``): 20 consecutive ``wrapper.fit`` calls on the persistent
pool; one fit of 10 epochs; 10 sweeps of 4 runs in one process; ``dl4py serve`` under 5
minutes of load from 4 keep-alive clients; ParallelInference under 2 minutes of the same.
Host memory is the RSS of every process doing the work (the coordinator and its workers;
the server); with CUDA, the device memory in use too.

Each scenario passes when memory after its warm-up (the first 3 fits, 2 epochs, 1 sweep,
first minute of serving, first 30 s of inference) grew by at most BOUND by the end. Writes
soak-<cpu|gpu>.json and .md to --out; exits 1 when a scenario failed.
"""

from __future__ import annotations

import os
import platform
import sys
import time

import psutil

from _common import device_of, label, machine, parser, write  # first: it puts the checkout's src on sys.path
import soak_scenarios as scenarios  # noqa: E402
from soak_memory import MB, Bound, judge  # noqa: E402

# From measurement (benchmarks/results/soak-cpu.md, 2 cores, two full runs): after warm-up the
# pool's three processes grew 4.2 to 4.4 MB over 17 fits, slowing down as fits go on (the
# allocator settling: worker 0's Python objects and tensors stay the same in number from fit to
# fit); the server 0.8 to 1.0 MB over 4 minutes, slowing down too; the rest < 2.2 MB. The bound (~17 MB for the pool) is 3.6x the
# largest, and less than what a leak adds up to of 1.1 MB per fit (17 after warm-up), 2.2 MB per
# epoch (8), 0.5 MB per run (36) or 300 bytes per request (~54,000 served after the server's
# warm-up, ~150,000 by ParallelInference); each fit or epoch moves 4 MiB of data, each run 2 MiB.
BOUND = Bound(floor_mb=16, percent=2)
SCENARIOS = ("fits", "epochs", "sweep", "serve", "inference")
RUNS_PER_SWEEP = 4  # the grid of learning rates each sweep runs
# Enough iterations or seconds for samples after the warm-up and an end window.
LEAST = {"fits": 4, "epochs": 3, "sweeps": 2, "serve_seconds": 10, "inference_seconds": 5}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--fits", type=int, default=20, help="consecutive wrapper.fit calls (first 3: warm-up)")
    p.add_argument("--epochs", type=int, default=10, help="epochs of the one long fit (first 2: warm-up)")
    p.add_argument("--sweeps", type=int, default=10, help=f"sweeps of {RUNS_PER_SWEEP} runs in one process "
                                                          "(first: warm-up)")
    p.add_argument("--serve-seconds", type=float, default=300.0, help="dl4py serve under load (first 20%%: warm-up)")
    p.add_argument("--inference-seconds", type=float, default=120.0,
                   help="ParallelInference under load (first 25%%: warm-up)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated: {', '.join(SCENARIOS)}")
    args = p.parse_args()
    if args.quick:
        args.fits, args.epochs, args.sweeps = 6, 4, 2
        args.serve_seconds, args.inference_seconds = 20.0, 10.0
    for option, least in LEAST.items():
        value = getattr(args, option)
        if value < least:
            p.error(f"--{option.replace('_', '-')} must be at least {least} (a warm-up and an end to compare), "
                    f"got {value:g}")
    chosen = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SCENARIOS))
    if unknown:
        p.error(f"--scenarios: unknown {', '.join(unknown)} (choose from {', '.join(SCENARIOS)})")

    device = device_of(args.device)
    backend = "gpu" if device.type == "cuda" else "cpu"
    results = []
    for name in chosen:
        started = time.perf_counter()
        trace = run_scenario(name, args, backend)
        verdict = judge(trace, BOUND)
        print(verdict.line(), file=sys.stderr, flush=True)
        results.append({"name": name, **verdict.to_dict(), "seconds": round(time.perf_counter() - started, 1),
                        "warmup_samples": trace.warmup, "window": trace.window, "notes": trace.notes,
                        "samples": [{"label": s.label, "rss_mb": round(s.rss / MB, 2),
                                     **({"device_used_mb": round(s.device_used / MB, 2),
                                         "device_allocated_mb": round(s.device_allocated / MB, 2),
                                         "device_reserved_mb": round(s.device_reserved / MB, 2)}
                                        if s.device_used is not None else {})}
                                    for s in trace.samples]})
    record = {**machine(device), **cpu()}
    result = {"machine": record, "quick": args.quick, "bound": str(BOUND), "passed": all(r["passed"] for r in results),
              "scenarios": results}
    write(args.out, f"soak-{label(device)}", result, report(record, results, args.quick))
    sys.exit(0 if result["passed"] else 1)


def run_scenario(name: str, args, backend: str):
    if name == "fits":
        return scenarios.repeated_fits(args.fits, warmup=3, backend=backend)
    if name == "epochs":
        return scenarios.long_fit(args.epochs, warmup=2, backend=backend)
    if name == "sweep":
        return scenarios.sweep_runs(args.sweeps * RUNS_PER_SWEEP, warmup=RUNS_PER_SWEEP, backend=backend)
    if name == "serve":
        return scenarios.serve_load(args.serve_seconds, warmup_seconds=args.serve_seconds / 5,
                                    interval=5.0 if args.serve_seconds >= 60 else 1.0, backend=backend)
    return scenarios.inference_load(args.inference_seconds, warmup_seconds=args.inference_seconds / 4,
                                    interval=2.0 if args.inference_seconds >= 60 else 0.5, backend=backend)


def cpu() -> dict:
    """The processor by its model name and cores (not the host's name)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), model)
    except OSError:
        pass
    return {"cpu_model": model, "logical_cores": os.cpu_count(), "physical_cores": psutil.cpu_count(logical=False)}


def report(record: dict, results: list[dict], quick: bool) -> list[str]:
    where = (f"{record['cpu_model']}, {record['logical_cores']} logical cores"
             + (f", {record['device']}" if record["device"] != "CPU" else "")
             + f"; torch {record['torch']}, Python {record['python']}; {record['platform']}")
    lines = ["# Memory soak: RSS (and device memory) after warm-up against the end", "", where, ""]
    if quick:
        lines += ["**--quick smoke run: not figures for the record.**", ""]
    device = any(r["device_growth"] is not None for r in results)
    lines += [f"Bound: growth after warm-up <= {BOUND} (MB: 2^20 bytes), the same for device memory. RSS is summed over the "
              "processes doing the work (this process and its 2 workers; the server process), shared libraries "
              "counted in each; sampled after each fit, epoch or run (this process first collects its garbage "
              "and trims its heap), or every few seconds under load (then each end's figure is the median of "
              "5 samples).", "",
              "| scenario | warm-up ends | warm RSS (MB) | end RSS (MB) | growth (MB) | allowed (MB) | "
              + ("device growth (MB) | " if device else "") + "result |",
              "|---|---|---|---|---|---|---|" + ("---|" if device else "")]
    for r in results:
        device_cell = (f"{r['device_growth'] / MB:+.1f} of {r['device_allowed'] / MB:.1f} | "
                       if r["device_growth"] is not None else "n/a | ") if device else ""
        lines.append(f"| {r['scenario']} | {r['warm_label']} | {r['warm_rss'] / MB:.1f} | {r['end_rss'] / MB:.1f} | "
                     f"{r['growth'] / MB:+.1f} | {r['allowed'] / MB:.1f} | {device_cell}"
                     f"{'pass' if r['passed'] else 'FAIL'} |")
    lines += ["", "What ran, and every sample (RSS in MB):", ""]
    for r in results:
        notes = ", ".join(f"{k} {v}" for k, v in r["notes"].items() if v is not None)
        lines.append(f"- **{r['scenario']}** ({notes}; {r['seconds']:.0f} s): "
                     + ", ".join(f"{s['label']} {s['rss_mb']:.1f}" for s in r["samples"]))
        if not r["passed"]:
            lines.append(f"  - FAIL: {r['reason']}")
    return lines


if __name__ == "__main__":
    main()
