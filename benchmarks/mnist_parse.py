"""Time to read the MNIST training set with nothing cached in the process: gunzip, SHA-256
and IDX parse of the 47 MB of images (and the labels), as an iterator's first use pays it.

    python benchmarks/mnist_parse.py [--repeats 7] [--quick] [--out benchmarks/results]

Each repeat clears dl4py's in-process cache and times ``load_mnist(train=True)``, then the
images file's phases apart (read, gunzip, SHA-256, parse); the files stay in the OS page
cache (read once before timing), so the disk is not measured. Figures are medians, with the
fastest and slowest repeat. The files are found as ``load_mnist`` finds them (``DL4PY_DATA``,
the cache folder). Writes mnist-parse-cpu.json and .md to --out.

This time was once a test's bound (2 s); on a shared machine a wall-clock limit fails by
luck, so the figure lives here, with the machine and its load named.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import os
import statistics
import time
from pathlib import Path

import torch

from _common import ROOT, heading, machine, write
from dl4py.data import load_mnist, mnist

IMAGES = "train-images-idx3-ubyte"


def timed(run) -> tuple[float, object]:
    start = time.perf_counter()
    value = run()
    return time.perf_counter() - start, value


def one_repeat(path: Path) -> dict[str, float]:
    """Seconds of a cold ``load_mnist(train=True)``, then of each phase of the images file."""
    mnist._read_idx.cache_clear()
    seconds = {"load_mnist(train=True), all of it": timed(lambda: load_mnist(train=True))[0]}
    seconds["images: read the file"], raw = timed(path.read_bytes)
    seconds["images: gunzip"], data = timed(lambda: gzip.decompress(raw) if path.suffix == ".gz" else raw)
    seconds["images: SHA-256"], _ = timed(lambda: hashlib.sha256(data).hexdigest())
    seconds["images: IDX parse"], _ = timed(lambda: mnist._parse_idx(data, str(path), 2051))
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="2 repeats, a smoke run; not figures for the record")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args()
    repeats = 2 if args.quick else args.repeats
    if repeats < 1:
        p.error(f"--repeats must be at least 1, got {repeats}")

    load_mnist(train=True)  # finds (or downloads) the files and warms the page cache
    path = mnist._locate(IMAGES, None)
    load_before = list(os.getloadavg())  # other work on the machine shows in the figures
    runs = [one_repeat(path) for _ in range(repeats)]
    load_after = list(os.getloadavg())

    phases = list(runs[0])
    figures = {name: {"median_s": statistics.median(r[name] for r in runs),
                      "min_s": min(r[name] for r in runs), "max_s": max(r[name] for r in runs)} for name in phases}
    record = machine(torch.device("cpu"))
    result = {"benchmark": "mnist-parse", **record, "quick": args.quick, "repeats": repeats,
              "file": path.name, "file_bytes": path.stat().st_size, "seconds": figures,
              "load_average_before": load_before, "load_average_after": load_after}
    lines = heading(f"MNIST training set read cold: {repeats} repeat(s)", record, args.quick)
    lines += ["| step | median (ms) | fastest (ms) | slowest (ms) |", "|---|---|---|---|"]
    lines += [f"| {name} | {1e3 * f['median_s']:.1f} | {1e3 * f['min_s']:.1f} | {1e3 * f['max_s']:.1f} |"
              for name, f in figures.items()]
    lines += ["", f"`load_mnist(train=True)` with dl4py's in-process cache cleared: images and labels read, "
                  f"gunzipped, hashed and parsed ({path.name}, {path.stat().st_size / 1e6:.1f} MB; the files in "
                  "the OS page cache); the images rows time that file's steps apart. Load average (1 min) "
                  f"before and after: {load_before[0]:.2f}, {load_after[0]:.2f}."]
    write(args.out, "mnist-parse-cpu", result, lines)


if __name__ == "__main__":
    main()
