"""What compiling the seed LeNet's step costs and saves: the numbers behind ``compile: auto``.

    python benchmarks/compile_cost.py [--device auto|cpu|gpu] [--batch 128] [--steps 40]
                                      [--repeats 7] [--precision float]

Two fresh processes (dynamo's in-memory caches empty), each with an eager and a compiled
network: ``cold`` with Inductor's on-disk cache in a new temporary folder, ``warm`` with the
folder ``cold`` filled. Each times the compiled network's first fit of ``--steps`` batches
(compilation included), then ``--repeats`` pairs of fits, eager then compiled, in turn. On a
shared machine load only slows a fit, so each step time is the fastest fit's (over both
processes for the saving). compile cost = first compiled fit - its steps at the compiled step
time; the break-even step count = cold compile cost / saving per step: at fewer planned
steps, compiling loses time.
docs/performance.md ("compile: auto") quotes the result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from _common import heading, machine, parser, write

_CHILD = """
import json, sys, time, torch
sys.path.insert(0, {bench!r})
from _common import seed_lenet, settings, sync
from dl4py import MnistDataSetIterator, MultiLayerNetwork
steps, batch, precision, backend, repeats = {steps}, {batch}, {precision!r}, {backend!r}, {repeats}
data = MnistDataSetIterator(batch, train=True, seed=12345, limit=steps * batch, drop_last=True)
nets = {{mode: MultiLayerNetwork(seed_lenet(), backend=backend, precision=precision).init()
         for mode in ("off", "default")}}

def fit(mode):
    with settings(compile=mode):
        sync(nets[mode].device)
        start = time.perf_counter()
        nets[mode].fit(data, epochs=1, verbose=0)
        sync(nets[mode].device)
        return time.perf_counter() - start

first = fit("default")
fit("off")  # the eager network's first fit: its own warm-up
pairs = [(fit("off"), fit("default")) for _ in range(repeats)]
print(json.dumps({{"first_s": first, "pairs": pairs}}))
"""


def row(name: str, cache: str, args, backend: str) -> dict:
    code = _CHILD.format(bench=os.path.dirname(os.path.abspath(__file__)), steps=args.steps, batch=args.batch,
                         precision=args.precision, backend=backend, repeats=args.repeats)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    eager = min(e for e, _ in result["pairs"]) / args.steps
    compiled = min(c for _, c in result["pairs"]) / args.steps
    return {"row": name, **result, "eager_step_s": eager, "compiled_step_s": compiled,
            "compile_s": result["first_s"] - args.steps * compiled}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=40, help="batches per fit")
    p.add_argument("--repeats", type=int, default=7, help="pairs of timed fits, eager and compiled")
    p.add_argument("--precision", default="float")
    args = p.parse_args()
    backend = {"auto": "auto", "cpu": "cpu", "gpu": "gpu"}[args.device]
    with tempfile.TemporaryDirectory(prefix="dl4py-inductor-") as cache:
        cold = row("cold", cache, args, backend)
        warm = row("warm", cache, args, backend)
    saved = min(r["eager_step_s"] for r in (cold, warm)) - min(r["compiled_step_s"] for r in (cold, warm))
    break_even = {r["row"]: r["compile_s"] / saved if saved > 0 else None for r in (cold, warm)}
    import torch  # after the children: this process only names the machine

    device = torch.device("cuda" if backend == "gpu" else "cpu")
    record = machine(device)
    kind = "gpu" if device.type == "cuda" else "cpu"
    result = {"benchmark": "compile_cost", **record, "batch": args.batch, "steps": args.steps,
              "repeats": args.repeats, "precision": args.precision, "rows": [cold, warm],
              "saved_step_s": saved, "break_even_steps": break_even}
    lines = heading(f"Compile cost of the seed LeNet's step, {kind.upper()}", record, args.quick) + [
        "| cache | compile (s) | eager step (ms) | compiled step (ms) | break-even (steps) |",
        "|---|---|---|---|---|",
        *(f"| {r['row']} | {r['compile_s']:.1f} | {1000 * r['eager_step_s']:.1f} | "
          f"{1000 * r['compiled_step_s']:.1f} | "
          + (f"{break_even[r['row']]:,.0f}" if break_even[r["row"]] else "never") + " |" for r in (cold, warm)),
        "",
        f"Batch {args.batch}, precision {args.precision}, {args.steps} steps per fit; step times the fastest of "
        f"{args.repeats} fits each, eager and compiled in turn, in one process. Saved per step: "
        f"{1000 * saved:.1f} ms (the fastest eager step less the fastest compiled one, both processes). "
        "Break-even: compile cost / that saving.",
    ]
    write(args.out, f"compile-cost-{kind}", result, lines)


if __name__ == "__main__":
    main()
