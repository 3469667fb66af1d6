"""Step "inference": ParallelInference and ``dl4py serve`` under a short loopback load.

The seed's LeNet (examples/lenet_mnist.yaml), trained one short epoch, answers single-image
requests (MNIST test images) from CLIENTS threads, a fixed number of them:

- ParallelInference (batched), driven by benchmarks/inference.py's own load generator, so the
  figures mean what that benchmark's do (its ``model.output`` loop beside it); then the same
  requests again, their answers compared with ``model.output``;
- ``dl4py serve --backend <this device>``, a child process on a free port of 127.0.0.1, the
  same requests as ``POST /predict`` over keep-alive connections: requests/s, p50/p99, every
  request answered 200 with ``model.output``'s probabilities; then SIGTERM, which must stop it
  with status 0.

The server is stopped in a ``finally`` (SIGTERM, then SIGKILL); it shares this step's process
group, which gpu_check kills whole at the budget anyway. Without starlette or uvicorn the serve
part is an unmet target naming the pip install; ParallelInference's part runs all the same.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from _common import seed_lenet
from dl4py import MnistDataSetIterator, MultiLayerNetwork, ParallelInference
from dl4py.errors import DataError
from gpu_steps._check import Check
from inference import plain_loop, served  # benchmarks/inference.py, not dl4py.inference

CLIENTS, BATCH_LIMIT, QUEUE_LIMIT = 16, 32, 64  # benchmarks/inference.py's and dl4py serve's defaults
# tests/test_parallel_inference.py and test_serve.py hold answers to 1e-6 on a CPU. On CUDA,
# cuDNN runs convolutions in TF32 by default and picks its algorithm by batch size, so a merged
# batch strays further from model.output (tests/test_fast_path.py allows 2e-3 for TF32).
TOLERANCE = {"cpu": 1e-6, "gpu": 2e-3}
MISSING_SERVE = "serve: starlette/uvicorn missing (pip install dl4py[serve])"
JSON = {"Content-Type": "application/json"}


@dataclass(frozen=True)
class Workload:
    """What every path is asked, and what it must answer."""
    model: MultiLayerNetwork
    x: torch.Tensor  # one request per row
    expected: np.ndarray  # model.output(x)
    tolerance: float
    workers: int  # replicas, in ParallelInference and in the server


def run(check: Check) -> None:
    clock = Clock(check)
    model, x = lenet_and_requests(check)
    model.output(x[:64])  # warm-up: allocator, kernels, cuDNN's choice
    work = Workload(model, x, model.output(x).float().cpu().numpy(), TOLERANCE[check.backend],
                    workers=2 if check.gpu else 1)  # docs/inference.md: one replica on a CPU, one or two per GPU
    check.figure("load", f"{len(x)} single-image requests from {CLIENTS} client threads; {work.workers} replica(s), "
                         f"batch_limit {BATCH_LIMIT}; tolerance {work.tolerance:g} on the probabilities")
    rows: list[dict] = []  # one table row per path, rewritten as each part adds its own
    server = None
    with check.part("serve: start"):
        server = start_server(check, work)
    clock.lap("model, reference answers")
    try:
        with check.part("ParallelInference"):
            parallel_inference(check, work, rows)
        clock.lap("ParallelInference")
        if server is not None:
            with check.part("serve"):
                serve(check, server, work, rows)
            clock.lap("serve: ready, load")
    finally:
        if server is not None:
            ended = server.stop(grace_s=check.steps(30, 15))
            clock.lap("serve: stop")
            check.figure("serve: how it ended", ended)
            check.expect(ended == "SIGTERM: exit status 0", f"serve: {ended}, not stopped by SIGTERM with status 0")


class Clock:
    """Seconds per phase, one figure: where the budget went."""

    def __init__(self, check: Check):
        self.check, self.seconds, self._last = check, {}, time.monotonic()

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.seconds[name], self._last = round(now - self._last, 2), now
        self.check.figure("seconds", self.seconds)


def lenet_and_requests(check: Check):
    """The seed's LeNet, trained one short epoch on MNIST (--quick: as initialised, so that the
    server starts sooner), and the test images it is asked about."""
    n, examples = check.steps(2000, 100), check.steps(4096, 0)
    model = MultiLayerNetwork(seed_lenet(), backend=check.backend).init()
    try:
        x = MnistDataSetIterator(n, train=False, shuffle=False, limit=n).features
        if examples:
            model.fit(MnistDataSetIterator(128, train=True, limit=examples), epochs=1, verbose=0)
        trained = f"one epoch on {examples} MNIST images" if examples else "as initialised"
        check.figure("model", f"seed LeNet, {trained}; asked about MNIST test images")
    except DataError as exc:  # no MNIST files here: an untrained net on random pixels runs every path
        x = torch.rand(n, 28 * 28, generator=torch.Generator().manual_seed(0))
        why = str(exc).splitlines()[0][:200]
        check.figure("model", f"seed LeNet as initialised; asked about random pixels ({why})")
    return model, x


def parallel_inference(check: Check, work: Workload, rows: list[dict]) -> None:
    model, x, workers = work.model, work.x, work.workers
    loop_x = x[:check.steps(len(x), 10)]  # one example a call is slow on a busy CPU; --quick keeps it short
    loop_seconds, loop_latencies, _ = plain_loop(model, loop_x, check.device)()
    rows.append(load_row("model.output loop", len(loop_x), loop_seconds, loop_latencies, len(loop_latencies), None))
    check.figure("paths", rows)
    seconds, latencies, mean_batch = served(model, x, "batched", CLIENTS, workers, BATCH_LIMIT, "auto")()
    rows.append(load_row("ParallelInference batched, runtime auto", len(x), seconds, latencies, len(latencies),
                         mean_batch))
    check.figure("paths", rows)
    # A client thread of the load generator dies on an error, leaving its requests unanswered.
    check.expect(len(latencies) == len(x),
                 f"ParallelInference: {len(x) - len(latencies)} of {len(x)} requests got no answer")

    with ParallelInference(model, workers=workers, batch_limit=BATCH_LIMIT, queue_limit=QUEUE_LIMIT) as inference:
        with ThreadPoolExecutor(CLIENTS) as pool:
            answers = list(pool.map(lambda i: inference.output(x[i:i + 1]), range(len(x))))
        stats = inference.stats()
    check.figure("ParallelInference runtime", f"{inference.runtime} ({inference.runtime_reason})")
    check.figure("ParallelInference stats (answers pass)", {k: v for k, v in stats.items() if k != "batch_sizes"})
    check.expect(stats["requests"] == len(x) and stats["failed"] == 0,
                 f"ParallelInference: {stats['requests']} requests counted of {len(x)}, {stats['failed']} failed")
    got = torch.cat(answers).float().cpu().numpy()
    compare(check, "ParallelInference", got, work.expected, work.tolerance)


def start_server(check: Check, work: Workload) -> "ServeProcess | None":
    """``dl4py serve`` on the model saved, started now so that it boots (imports, CUDA) on other
    cores while ParallelInference is measured; None, an unmet target, without its packages."""
    missing = [name for name in ("starlette", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        check.figure("serve: missing packages", missing)
        check.expect(False, MISSING_SERVE)
        return None
    model_path = check.work_dir / "model.dl4py"
    work.model.save(model_path, save_updater=False)
    return ServeProcess(model_path, check.backend, work.workers, check.work_dir / "serve.log")


def serve(check: Check, server: "ServeProcess", work: Workload, rows: list[dict]) -> None:
    x = work.x
    bodies = [json.dumps({"features": [row]}).encode() for row in x.tolist()]  # float32 values: exact as JSON
    port = server.wait_ready(check.steps(40, 20))
    status, _ = post(port, bodies[0])  # the server's first forward pass, outside the clock
    check.expect(status == 200, f"serve: the first request got {status}")
    seconds, outcomes = http_load(port, bodies, deadline_s=check.steps(60, 30))
    health = json.loads(get(port, "/health"))

    answered = [i for i, o in enumerate(outcomes) if o is not None and o[0] == 200]
    latencies = [outcomes[i][2] for i in answered]
    mean_batch = health.get("inference", {}).get("mean_batch_size")
    rows.append(load_row("dl4py serve (HTTP)", len(x), seconds, latencies, len(answered), mean_batch))
    check.figure("paths", rows)
    check.figure("serve: /health after the load", health)
    others = Counter(outcome_kind(o) for o in outcomes if o is None or o[0] != 200)
    check.expect(not others, f"serve: {len(x) - len(answered)} of {len(x)} requests not answered 200: {dict(others)}"
                             + first_error(outcomes))
    if answered:
        answers = [json.loads(outcomes[i][1]) for i in answered]
        got = np.array([a["probabilities"][0] for a in answers], dtype=np.float64)
        classes = np.array([a["predictions"][0] for a in answers])
        compare(check, "serve", got, work.expected[answered], work.tolerance, classes)
    failed = health.get("inference", {}).get("failed")
    check.expect(failed == 0, f"serve: ParallelInference in the server counted {failed} failed requests")


def compare(check: Check, name: str, got, expected, tolerance: float, classes=None) -> None:
    """Probabilities within ``tolerance`` of model.output's; classes its highest, but for near ties."""
    difference = float(np.abs(got - expected).max())
    check.figure(f"{name}: max |answer - model.output|", difference)
    check.expect(difference <= tolerance,
                 f"{name}: answers differ from model.output by up to {difference:.3g} (tolerance {tolerance:g})")
    if classes is not None:
        top_two = np.sort(expected, axis=1)[:, -2:]
        clear = top_two[:, 1] - top_two[:, 0] > 2 * tolerance  # a near tie may flip within the tolerance
        wrong = int((classes != expected.argmax(axis=1))[clear].sum())
        check.expect(wrong == 0, f"{name}: {wrong} predictions are not model.output's highest class")


def load_row(path: str, requests: int, seconds: float, latencies, answered: int, mean_batch) -> dict:
    ms = np.asarray(latencies, dtype=np.float64) * 1000
    return {"path": path, "requests": requests, "answered": answered, "requests/s": round(requests / seconds, 1),
            "p50 ms": round(float(np.percentile(ms, 50)), 3) if len(ms) else None,
            "p99 ms": round(float(np.percentile(ms, 99)), 3) if len(ms) else None,
            "mean batch": None if mean_batch is None else round(float(mean_batch), 2)}


class ServeProcess:
    """``python -m dl4py serve`` on a free port of 127.0.0.1, its output in ``log_path``."""

    def __init__(self, model_path: Path, backend: str, workers: int, log_path: Path):
        self.log_path = log_path
        self._log = open(log_path, "wb")  # a file, not a pipe: nobody reads it while the server runs
        self.process = subprocess.Popen(
            [sys.executable, "-m", "dl4py", "serve", str(model_path), "--host", "127.0.0.1", "--port", "0",
             "--backend", backend, "--workers", str(workers), "--batch-limit", str(BATCH_LIMIT),
             "--queue-limit", str(QUEUE_LIMIT)],
            stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, seconds: float) -> int:
        """The port, once the first line names it and ``/health`` answers "serving"."""
        deadline, port = time.monotonic() + seconds, None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"dl4py serve exited with status {self.process.returncode} before serving: "
                                   f"{self.log_tail(1)}")
            found = re.search(rb"http://127\.0\.0\.1:(\d+)", self.log_path.read_bytes())
            port = port or (int(found.group(1)) if found else None)
            if port is not None:
                try:
                    if json.loads(get(port, "/health", timeout=5)).get("status") == "serving":
                        return port
                except (OSError, http.client.HTTPException, ValueError):
                    pass  # not listening yet
            time.sleep(0.1)
        raise TimeoutError(f"dl4py serve was not serving within {seconds:g} s (port {port}): {self.log_tail(1)}")

    def stop(self, grace_s: float) -> str:
        """SIGTERM (its graceful stop), SIGKILL after ``grace_s``; how it ended."""
        if self.process.poll() is not None:
            ended = f"had exited by itself with status {self.process.returncode}"
        else:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace_s)
                ended = f"SIGTERM: exit status {self.process.returncode}"
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                ended = f"still running {grace_s:g} s after SIGTERM: killed"
        self._log.close()
        print(f"dl4py serve's output (last lines):\n{self.log_tail(20)}", flush=True)
        return ended

    def log_tail(self, lines: int) -> str:
        text = self.log_path.read_bytes()[-16_000:].decode("utf-8", "replace")
        return "\n".join(text.strip().splitlines()[-lines:])


def http_load(port: int, bodies: list[bytes], deadline_s: float):
    """CLIENTS threads, each on its own keep-alive connection, share the requests. (seconds,
    outcomes): outcome i is (status, body, seconds) or (None, error, seconds); None if never sent."""
    outcomes: list = [None] * len(bodies)

    def client(first: int) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=deadline_s)
        try:
            for i in range(first, len(bodies), CLIENTS):
                began = time.perf_counter()
                try:
                    connection.request("POST", "/predict", body=bodies[i], headers=JSON)
                    response = connection.getresponse()
                    outcomes[i] = (response.status, response.read(), time.perf_counter() - began)
                except (OSError, http.client.HTTPException) as exc:
                    connection.close()  # the next request opens a fresh connection
                    outcomes[i] = (None, f"{type(exc).__name__}: {exc}", time.perf_counter() - began)
        finally:
            connection.close()

    # Daemons joined against one deadline: a hung server costs the budget once, not per request.
    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(CLIENTS)]
    start = time.perf_counter()
    deadline = time.monotonic() + deadline_s
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return time.perf_counter() - start, list(outcomes)  # a copy: a late thread may still write


def outcome_kind(outcome) -> str:
    return "never sent" if outcome is None else "connection error" if outcome[0] is None else str(outcome[0])


def first_error(outcomes) -> str:
    for outcome in outcomes:
        if outcome is not None and outcome[0] != 200:
            return f"; the first: {outcome_kind(outcome)}: {str(outcome[1])[:200]}"
    return ""


def post(port: int, body: bytes, timeout: float = 30) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("POST", "/predict", body=body, headers=JSON)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def get(port: int, path: str, timeout: float = 30) -> bytes:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("GET", path)
        return connection.getresponse().read()
    finally:
        connection.close()
