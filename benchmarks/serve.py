"""dl4py serve against a minimal Starlette + ONNX Runtime server: CPU per request, requests/s, latency.

    python benchmarks/serve.py [--quick] [--rounds 3] [--concurrency 1 16 64] [--runtime auto]
                               [--workers 1] [--note "what else ran"]

The seed's LeNet (examples/lenet_mnist.yaml, initialised by its seed) is saved as a dl4py model
file and exported to ONNX. Two servers run side by side, each in its own process on 127.0.0.1:

- ``dl4py serve``: ``python -m dl4py serve model.dl4py`` with its defaults (``--runtime``
  and ``--workers`` as given here);
- ``minimal``: ``benchmarks/minimal_server.py``, the 30-line Starlette + onnxruntime server a
  user would write (no limits, no validation, no batching).

A load generator in this process keeps ``concurrency`` kept-alive HTTP/1.1 connections busy,
each sending its next request (one MNIST test image as JSON) as soon as the last is answered.
For each concurrency the servers take turns, ``--rounds`` rounds (A, B, then B, A, ...). A
server's CPU per request is the CPU time its process used in the round (all its threads, from
/proc) over the requests answered. Every answer is checked: status 200 and probabilities equal
to ``model.output`` of that image within 1e-5; a lost or wrong answer is counted and fails the
run. The figures are the median round's.
Writes serve-cpu.json and .md to --out.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from _common import ROOT, heading, machine, parser, seed_lenet, write
from dl4py import MnistDataSetIterator, MultiLayerNetwork
from dl4py.export import export

IMAGES = 512
TOLERANCE = 1e-5
START_SECONDS = 120.0
_LENGTH = re.compile(rb"(?i)\r\ncontent-length:\s*(\d+)")


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--requests", type=int, default=3000, help="requests per server per round (1/2 at concurrency 1)")
    p.add_argument("--runtime", default="auto", help="dl4py serve --runtime")
    p.add_argument("--workers", type=int, default=1, help="dl4py serve --workers")
    p.add_argument("--note", default="", help="what else ran on the machine meanwhile")
    args = p.parse_args()
    rounds, requests = (1, 300) if args.quick else (args.rounds, args.requests)

    images = MnistDataSetIterator(IMAGES, train=False, shuffle=False, limit=IMAGES).features
    model = MultiLayerNetwork(seed_lenet()).init()
    expected = model.output(images).numpy()
    bodies = [_request(json.dumps({"features": [row]}).encode()) for row in images.tolist()]
    with tempfile.TemporaryDirectory() as folder:
        model_file, onnx_file = Path(folder) / "model.dl4py", Path(folder) / "model.onnx"
        model.save(model_file)
        export(model, onnx_file)
        servers = {
            "dl4py serve": [sys.executable, "-m", "dl4py", "serve", str(model_file), "--backend", "cpu",
                            "--runtime", args.runtime, "--workers", str(args.workers), "--queue-limit", "256",
                            "--max-connections", "512", "--port"],
            "minimal": [sys.executable, str(ROOT / "benchmarks" / "minimal_server.py"), str(onnx_file)],
        }
        with running(servers) as ports:
            results = measure(ports, bodies, expected, args.concurrency, rounds, requests)
    report(results, args, rounds, requests)


class running:
    """The servers started, each on a free port of 127.0.0.1, answered once; stopped after."""

    def __init__(self, commands: dict[str, list[str]]):
        self.commands, self.processes, self.ports = commands, {}, {}

    def __enter__(self) -> dict[str, tuple[int, int]]:
        try:
            for name, command in self.commands.items():
                port = _free_port()
                self.processes[name] = subprocess.Popen([*command, str(port)], stdout=subprocess.DEVNULL,
                                                        stderr=subprocess.PIPE)
                self.ports[name] = (port, self.processes[name].pid)
            for name, (port, _) in self.ports.items():
                _wait_until_up(name, port, self.processes[name])
        except BaseException:
            self.__exit__()
            raise
        return self.ports

    def __exit__(self, *exc) -> None:
        for process in self.processes.values():
            process.terminate()
        for process in self.processes.values():
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


def measure(ports, bodies, expected, levels, rounds, requests) -> dict:
    names = list(ports)
    results = {}
    for concurrency in levels:
        count = requests // 2 if concurrency == 1 else requests
        for name in names:  # warm each server at this concurrency (pools, caches) before timing
            asyncio.run(_load(ports[name][0], bodies, concurrency, min(count, 200)))
        rows = {name: [] for name in names}
        for round_index in range(rounds):
            for name in names if round_index % 2 == 0 else names[::-1]:
                port, pid = ports[name]
                cpu_before = _process_cpu(pid)
                answers, latencies, wall = asyncio.run(_load(port, bodies, concurrency, count))
                cpu = _process_cpu(pid) - cpu_before
                lost, wrong = _check(answers, expected, count)
                rows[name].append({"requests_per_s": count / wall, "cpu_ms_per_request": 1e3 * cpu / count,
                                   "p50_ms": 1e3 * _percentile(latencies, 50), "p99_ms": 1e3 * _percentile(latencies, 99),
                                   "lost": lost, "wrong": wrong})
                print(f"c={concurrency} {name}: {count / wall:,.0f} req/s, {1e3 * cpu / count:.3f} CPU ms/request, "
                      f"lost {lost}, wrong {wrong}", file=sys.stderr, flush=True)
        results[concurrency] = {"requests": count, "rounds": rows,
                                "median": {name: _median_round(rows[name]) for name in names}}
    return results


async def _load(port: int, bodies, concurrency: int, count: int):
    """``count`` requests over ``concurrency`` kept-alive connections: (answers by request
    index as (status, body), latencies in seconds, wall seconds)."""
    answers, latencies = [None] * count, [0.0] * count
    next_index = iter(range(count))

    async def connection():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for index in next_index:
                start = time.perf_counter()
                writer.write(bodies[index % len(bodies)])
                head = await reader.readuntil(b"\r\n\r\n")
                body = await reader.readexactly(int(_LENGTH.search(head).group(1)))
                latencies[index] = time.perf_counter() - start
                answers[index] = (int(head[9:12]), body)
        finally:
            writer.close()

    start = time.perf_counter()
    await asyncio.gather(*(connection() for _ in range(concurrency)))
    return answers, latencies, time.perf_counter() - start


def _check(answers, expected, count) -> tuple[int, int]:
    """(lost: no 200 answer, wrong: probabilities not model.output's within TOLERANCE)."""
    lost = wrong = 0
    for index, answer in enumerate(answers):
        if answer is None or answer[0] != 200:
            lost += 1
            continue
        probabilities = np.asarray(json.loads(answer[1])["probabilities"][0])
        if not np.allclose(probabilities, expected[index % len(expected)], rtol=TOLERANCE, atol=TOLERANCE):
            wrong += 1
    return lost, wrong


def _request(body: bytes) -> bytes:
    return (b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def _process_cpu(pid: int) -> float:
    """User + system CPU seconds of process ``pid``, all its threads (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_until_up(name: str, port: int, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{name} exited with {process.returncode}: {process.stderr.read().decode()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"{name} did not listen on port {port} within {START_SECONDS:g} s")


def _percentile(values, q) -> float:
    return float(np.percentile(np.asarray(values), q))


def _median_round(rows: list[dict]) -> dict:
    """The round with the median CPU per request (its other figures with it)."""
    ordered = sorted(rows, key=lambda row: row["cpu_ms_per_request"])
    middle = dict(ordered[len(ordered) // 2])
    middle["lost"], middle["wrong"] = sum(r["lost"] for r in rows), sum(r["wrong"] for r in rows)
    return middle


def report(results: dict, args, rounds: int, requests: int) -> None:
    record = machine(torch.device("cpu"))
    lines = heading("Serving: dl4py serve against a minimal Starlette + ONNX Runtime server (seed LeNet, CPU)",
                    record, args.quick)
    if args.note:
        lines += [f"Machine: {args.note}", ""]
    lines += [f"dl4py serve --runtime {args.runtime} --workers {args.workers}; one MNIST image per request; "
              f"{rounds} interleaved round(s) per concurrency, the median round's figures (by CPU per request).", "",
              "| concurrency | server | requests/s | p50 (ms) | p99 (ms) | CPU ms / request | CPU / minimal's | "
              "requests/s / minimal's | lost | wrong |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    summary = {}
    for concurrency, level in results.items():
        base = level["median"]["minimal"]
        for name, row in level["median"].items():
            cpu_ratio = row["cpu_ms_per_request"] / base["cpu_ms_per_request"]
            speed_ratio = row["requests_per_s"] / base["requests_per_s"]
            lines.append(f"| {concurrency} | {name} | {row['requests_per_s']:,.0f} | {row['p50_ms']:.2f} | "
                         f"{row['p99_ms']:.2f} | {row['cpu_ms_per_request']:.3f} | **{cpu_ratio:.2f}** | "
                         f"**{speed_ratio:.2f}** | {row['lost']} | {row['wrong']} |")
            if name == "dl4py serve":
                summary[concurrency] = {"cpu_per_request_vs_minimal": cpu_ratio, "requests_per_s_vs_minimal": speed_ratio}
    lines += ["", f"{requests} requests per server per round ({requests // 2} at concurrency 1); an answer is wrong "
                  f"when its probabilities differ from model.output's by more than {TOLERANCE:g}.", "",
              "CPU per request (dl4py serve / minimal): "
              + ", ".join(f"{c} connection(s) {s['cpu_per_request_vs_minimal']:.2f}" for c, s in summary.items())
              + "; requests/s: "
              + ", ".join(f"{c} {s['requests_per_s_vs_minimal']:.2f}" for c, s in summary.items()) + "."]
    write(args.out, "serve-cpu", {"machine": record, "runtime": args.runtime, "workers": args.workers,
                                  "rounds": rounds, "note": args.note, "summary": summary,
                                  "results": {str(c): level for c, level in results.items()}}, lines)
    failures = sum(row["lost"] + row["wrong"] for level in results.values() for row in level["median"].values())
    if failures:
        raise SystemExit(f"{failures} request(s) lost or answered wrong")


if __name__ == "__main__":
    main()
