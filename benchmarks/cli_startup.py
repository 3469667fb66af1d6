"""How long the ``dl4py`` command takes to start: ``dl4py --help`` and ``dl4py --version``, each
run as a fresh process (``python -m dl4py``), interleaved (help, version, help, version, ...),
the median of ``--runs`` each, beside a bare ``python -c pass`` for the interpreter's own start.
Also says whether the command imported PyTorch (it should not, for these two).

    python benchmarks/cli_startup.py [--runs 5] [--out benchmarks/results]

Writes ``cli-startup-cpu.json`` and ``.md`` under ``--out`` (the machine described inside).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "dl4py --help": [sys.executable, "-m", "dl4py", "--help"],
    "dl4py --version": [sys.executable, "-m", "dl4py", "--version"],
}
# The same start, then whether torch was imported: what --help pulled in.
TORCH_CHECK = ("import sys, contextlib, io\nfrom dl4py.cli import main\n"
               "with contextlib.redirect_stdout(io.StringIO()):\n"
               "    try: main(['--help'])\n    except SystemExit: pass\n"
               "print('torch' in sys.modules)")


def _cores() -> int:
    return os.cpu_count() or 1


def _seconds(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, cwd=ROOT, timeout=120)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    for command in COMMANDS.values():  # warm the file cache: the first run of each is not measured
        _seconds(command)
    times = {name: [] for name in COMMANDS}
    for _ in range(args.runs):
        for name, command in COMMANDS.items():
            times[name].append(_seconds(command))
    imported = subprocess.run([sys.executable, "-c", TORCH_CHECK], capture_output=True, text=True, cwd=ROOT,
                              timeout=120, check=True).stdout.strip() == "True"
    result = {
        "machine": f"{platform.machine()} CPU, {_cores()} cores, python {platform.python_version()}",
        "runs": args.runs, "median_seconds": {name: statistics.median(ts) for name, ts in times.items()},
        "seconds": times, "help_imports_torch": imported,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cli-startup-cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# dl4py command start-up ({result['machine']})", "",
             f"Fresh processes, interleaved, median of {args.runs}:", "", "| command | median (s) |", "|---|---|"]
    lines += [f"| `{name}` | {seconds:.3f} |" for name, seconds in result["median_seconds"].items()]
    lines += ["", f"`dl4py --help` imports PyTorch: {imported}."]
    (args.out / "cli-startup-cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
