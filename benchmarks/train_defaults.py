"""``dl4py train`` of the seed config with its defaults (``compile: auto``, ``channels_last:
auto``, which on a CPU now stores the convolutions NHWC) against the earlier defaults
(``compile: off``, ``channels_last: off`` on a CPU) and against compiling regardless
(``compile: default``, cold cache).

    python benchmarks/train_defaults.py [--repeats 3] [--small 1000]

Each run is a fresh ``dl4py train examples/lenet_mnist.yaml`` process (one epoch, batch 128)
on the full MNIST training set (469 steps) and on its first ``--small`` examples; every
process gets a new, empty Inductor cache folder, as a first run on a machine has. The settings
run in turn, repeat after repeat, so that a shared machine's load falls on each alike. Reported:
the process's wall time (start-up, data, training, evaluation: what a user waits for), the
training samples/s from ``result.json``, and the ``compile`` choice the run recorded.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, heading, machine, parser, write

EARLIER = "earlier defaults (compile off, channels_last off)"
SETTINGS = {EARLIER: ["environment.compile=off", "environment.channels_last=off"],
            "defaults (compile auto, channels_last auto)": [],
            "compile always (default), channels_last auto": ["environment.compile=default"]}


def train(sets: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="dl4py-defaults-") as tmp:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor")}
        args = [sys.executable, "-m", "dl4py", "train", str(ROOT / "examples" / "lenet_mnist.yaml"),
                "--output", str(Path(tmp) / "run"), "--no-progress", *(f"--set={s}" for s in sets)]
        started = time.perf_counter()
        subprocess.run(args, env=env, check=True, capture_output=True, text=True)
        wall = time.perf_counter() - started
        result = json.loads((Path(tmp) / "run" / "result.json").read_text())
    return {"wall_s": wall, "samples_per_second": result["train_samples_per_second"],
            "iterations": result["iterations"], "compile": result["compile"]}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--repeats", type=int, default=3, help="runs per row, in turn (the median counts)")
    p.add_argument("--small", type=int, default=1000, help="training examples of the small run")
    args = p.parse_args()
    rows = []
    for data, sets in (("full MNIST (60,000)", []), (f"first {args.small:,}", [f"data.limit_train={args.small}"])):
        runs = {name: [] for name in SETTINGS}
        for repeat in range(args.repeats):  # in turn, so that each setting meets the machine's load alike
            for name, overrides in SETTINGS.items():
                if not name.startswith("compile always") or repeat == 0:  # once: its cost is plain
                    runs[name].append(train(sets + overrides))
        for name, done in runs.items():
            row = {"data": data, "settings": name, "runs": done,
                   "wall_s": statistics.median(r["wall_s"] for r in done),
                   "samples_per_second": statistics.median(r["samples_per_second"] for r in done),
                   "iterations": done[0]["iterations"], "choice": done[0]["compile"]}
            rows.append(row)
            print(f"{data} {name}: {row['wall_s']:.1f} s, {row['samples_per_second']:,.0f} samples/s", flush=True)
    for row in rows:
        earlier = next(r for r in rows if r["data"] == row["data"] and r["settings"] == EARLIER)
        row["speedup"] = earlier["wall_s"] / row["wall_s"]
    import torch  # this process only names the machine

    record = machine(torch.device("cpu"))
    result = {"benchmark": "train_defaults", **record, "repeats": args.repeats, "rows": rows}
    write(args.out, "train-defaults-cpu", result, markdown(result, record, args.quick))


def markdown(result: dict, record: dict, quick: bool) -> list[str]:
    title = "dl4py train defaults: the seed LeNet, today's defaults against the earlier ones, CPU"
    return heading(title, record, quick) + [
        "| data | settings | steps | compile choice recorded | wall (s) | vs earlier | each run (s) | train samples/s |",
        "|---|---|---|---|---|---|---|---|",
        *(f"| {r['data']} | {r['settings']} | {r['iterations']} | "
          f"{'on' if r['choice']['on'] else 'off'}: {r['choice']['why']} | {r['wall_s']:.1f} | "
          f"**{r['speedup']:.2f}x** | {_each(r['runs'])} | "
          f"{r['samples_per_second']:,.0f} |" for r in result["rows"]),
        "",
        f"Wall time of the whole `dl4py train` process, median of {result['repeats']} (compile always: one "
        "run), each with a new, empty Inductor cache; vs earlier: the earlier defaults' wall time / the "
        "row's. Where compile auto chose off, the defaults differ from the earlier ones by channels_last "
        "alone (NHWC convolutions in oneDNN).",
    ]


def _each(runs: list[dict]) -> str:
    return ", ".join(f"{run['wall_s']:.1f}" for run in runs)


if __name__ == "__main__":
    main()
