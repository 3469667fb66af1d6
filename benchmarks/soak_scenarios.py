"""The soak scenarios: the same work done again and again, memory sampled as it goes.

Each function runs one scenario and returns its ``Trace`` (``soak_memory.py``); ``soak.py``
runs them long and writes the figures, tests/test_memory_soak.py runs them short.

- ``repeated_fits``: ``wrapper.fit`` again and again on one ParallelWrapper (its persistent
  pool of 2 workers); RSS of this process and the workers after each fit (DL4J #8023, #3304;
  Keras #21090).
- ``long_fit``: one ``wrapper.fit`` of many epochs; RSS at each epoch's end.
- ``sweep_runs``: a sweep's experiments run in one process, as a notebook runs them:
  ``train_run`` of a fresh config (learning rate from a grid) into its own run directory,
  one after another, with the CPU threads a sweep gives each (``dl4py sweep`` itself runs
  each in a process of its own, which gives its memory back when it ends; here nothing does).
- ``serve_load``: ``dl4py serve`` started as a process on 127.0.0.1, a few keep-alive
  clients sending requests without pause; the server's RSS every few seconds.
- ``inference_load``: the same load on a ParallelInference in this process (DL4J #4018).

The workload is a toy MLP on random data (no downloads): big enough per iteration (MBs of
data; ~85k parameters, ~300k for the sweep's runs) that memory kept from each iteration adds
up to more than the bound.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dl4py import (
    ArrayDataSetIterator,
    DenseLayer,
    InputType,
    MultiLayerNetwork,
    NetworkConfig,
    OutputLayer,
    ParallelInference,
    RunConfig,
    Sgd,
)
from dl4py.parallel import ParallelWrapper
from dl4py.runner import train_run
from dl4py.sweep import make_slots
from dl4py.train.listeners import TrainingListener
from soak_memory import MemoryProbe, Trace, tree

SRC = Path(__file__).resolve().parents[1] / "src"
# Requests are 1 to MAX_ROWS examples: the server and the replicas see batches of many sizes.
MAX_ROWS = 16
SERVER_START_SECONDS = 120.0


@dataclass(frozen=True)
class Workload:
    """The toy problem: ``examples`` rows of ``features`` random numbers, 4 classes."""

    examples: int = 16384  # 4 MiB of features: what a leak of each fit's data would keep
    features: int = 64
    hidden: int = 256
    batch: int = 128

    def data(self, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(self.examples, self.features, generator=generator)
        return x, (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()

    def network(self, learning_rate: float = 0.05) -> NetworkConfig:
        return NetworkConfig(
            layers=[DenseLayer(n_out=self.hidden, activation="tanh"), DenseLayer(n_out=self.hidden, activation="tanh"),
                    OutputLayer(n_out=4)],
            input_type=InputType.feed_forward(self.features), updater=Sgd(learning_rate), seed=1)

    def iterator(self) -> ArrayDataSetIterator:
        return ArrayDataSetIterator(*self.data(), batch_size=self.batch, shuffle=True, seed=1)


# ---- training ----------------------------------------------------------------------------------
def repeated_fits(fits: int, warmup: int, workload: Workload = Workload(), backend: str = "cpu") -> Trace:
    """``fits`` consecutive ``wrapper.fit`` calls, one epoch each, on one wrapper's pool."""
    trace = Trace("repeated wrapper.fit", warmup, notes={"fits": fits, "workers": 2})
    model = MultiLayerNetwork(workload.network(), backend=backend)
    data = workload.iterator()
    with ParallelWrapper(model, workers=2, averaging_frequency=3) as wrapper:
        probe = MemoryProbe(lambda: [os.getpid(), *wrapper._pool.pids])  # the coordinator and its workers
        for fit in range(1, fits + 1):
            wrapper.fit(data, verbose=0)
            trace.add(probe.sample(f"fit {fit}"))
        trace.notes["pool_starts"] = wrapper._pool.starts  # 1: every fit ran on the same workers
    return trace


class _EpochSampler(TrainingListener):
    """Samples at each epoch's end as worker 0 relays it. The workers go on meanwhile, so on
    a busy machine a sample may come late, by up to an epoch. Not after the fit: the workers
    then hold no replica or batches, a phase of their own (~5 MB less here)."""

    def __init__(self, probe: MemoryProbe, trace: Trace):
        self.probe, self.trace = probe, trace

    def on_epoch_end(self, model, summary) -> None:
        self.trace.add(self.probe.sample(f"epoch {summary.epoch + 1}"))


def long_fit(epochs: int, warmup: int, workload: Workload = Workload(), backend: str = "cpu") -> Trace:
    """One ``wrapper.fit`` of ``epochs`` epochs on 2 workers; RSS at each epoch's end."""
    trace = Trace("one wrapper.fit, many epochs", warmup, notes={"epochs": epochs, "workers": 2})
    model = MultiLayerNetwork(workload.network(), backend=backend)
    with ParallelWrapper(model, workers=2, averaging_frequency=3) as wrapper:
        probe = MemoryProbe(lambda: [os.getpid(), *wrapper._pool.pids])
        wrapper.fit(workload.iterator(), epochs=epochs, listeners=[_EpochSampler(probe, trace)], verbose=0)
    return trace


def sweep_runs(runs: int, warmup: int, workload: Workload = Workload(examples=8192, hidden=512), backend: str = "cpu",
               rates=(0.01, 0.02, 0.05, 0.1)) -> Trace:
    """``runs`` training runs of a learning-rate grid, one after another in this process,
    each read from CSV files and recorded in its own run directory."""
    trace = Trace("sweep runs in one process", warmup, notes={"runs": runs, "grid": list(rates)})
    probe = MemoryProbe(lambda: [os.getpid()])
    # The CPU threads a sweep gives each of 2 experiments at a time on this machine.
    threads = make_slots(None, per_device=2)[0].threads
    with tempfile.TemporaryDirectory(prefix="dl4py-soak-") as folder, _torch_threads(threads):
        train, test = Path(folder) / "train.csv", Path(folder) / "test.csv"
        _write_csv(train, *workload.data(0))
        _write_csv(test, *(part[:workload.examples // 8] for part in workload.data(1)))  # evaluation is not the point
        network = workload.network().to_dict()
        for run in range(1, runs + 1):
            network["updater"]["learning_rate"] = rates[(run - 1) % len(rates)]
            config = RunConfig.from_dict({
                "network": network,
                "data": {"dataset": "csv", "train_path": str(train), "test_path": str(test), "num_classes": 4},
                "training": {"epochs": 1, "batch_size": workload.batch, "backend": backend, "score_every": 0},
            })
            train_run(config, output=Path(folder) / f"run-{run}", progress=False)  # raises if the run fails
            trace.add(probe.sample(f"run {run}"))
    return trace


@contextlib.contextmanager
def _torch_threads(threads: int):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _write_csv(path: Path, x: torch.Tensor, y: torch.Tensor) -> None:
    np.savetxt(path, np.column_stack([x.numpy(), y.numpy()]), delimiter=",", fmt="%.5f")


# ---- serving -----------------------------------------------------------------------------------
class _Load:
    """``clients`` threads, each with its own keep-alive connection, sending requests of 1 to
    MAX_ROWS examples without pause until ``stop``. A connection the server closes is opened
    again (counted as a reconnect); an answer other than 200, or an error, counts as a failure."""

    def __init__(self, send, clients: int):
        self.send, self.stopping = send, threading.Event()
        self.answered = self.failed = self.reconnects = 0
        self.first_failure: str | None = None
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, args=(c,), name=f"soak-client-{c}", daemon=True)
                         for c in range(clients)]

    def __enter__(self) -> "_Load":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        for thread in self._threads:
            thread.join(60)

    def _client(self, index: int) -> None:
        state = {}
        n = index
        while not self.stopping.is_set():
            try:
                ok = self.send(state, 1 + n % MAX_ROWS, n)
            except Exception as error:  # noqa: BLE001 - counted and told, the client goes on
                connection = state.pop("connection", None)
                if connection is not None:
                    connection.close()
                ok = self._reconnectable(error)
            with self._lock:
                if ok:
                    self.answered += 1
                elif ok is False:
                    self.failed += 1
            n += 1

    def _reconnectable(self, error) -> bool | None:
        """None (try again on a new connection) when the server closed a kept-alive one;
        False (a failure) for anything else."""
        if isinstance(error, (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)):
            with self._lock:
                self.reconnects += 1
            return None
        with self._lock:
            self.first_failure = self.first_failure or repr(error)
        return False

    def note(self, trace: Trace) -> None:
        trace.notes.update(answered=self.answered, failures=self.failed, reconnects=self.reconnects,
                           first_failure=self.first_failure)


def _sample_for(probe: MemoryProbe, trace: Trace, seconds: float, interval: float, stop=None) -> None:
    """A sample every ``interval`` seconds for ``seconds``; stops early when ``stop()`` says."""
    started = time.monotonic()
    while time.monotonic() - started < seconds and not (stop and stop()):
        time.sleep(interval)
        trace.add(probe.sample(f"t={round((time.monotonic() - started) / interval) * interval:g}s"))


def serve_load(seconds: float, warmup_seconds: float, interval: float, workload: Workload = Workload(),
               backend: str = "cpu", clients: int = 4) -> Trace:
    """``dl4py serve`` (2 replicas) under ``clients`` keep-alive clients for ``seconds``."""
    trace = Trace("dl4py serve under load", int(warmup_seconds / interval), window=5,
                  notes={"seconds": seconds, "clients": clients, "sample_every_s": interval})
    rows = [json.dumps(row) for row in workload.data(2)[0][:256].tolist()]
    with tempfile.TemporaryDirectory(prefix="dl4py-soak-serve-") as folder:
        model_file = Path(folder) / "model.dl4py"
        MultiLayerNetwork(workload.network(), backend="cpu").init().save(model_file)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
        server = subprocess.Popen([sys.executable, "-m", "dl4py", "serve", str(model_file), "--host", "127.0.0.1",
                                   "--port", "0", "--workers", "2", "--backend", backend],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            port = _port_of(server)

            def send(state, size, n) -> bool:
                connection = state.get("connection")
                if connection is None:
                    connection = state["connection"] = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                chosen = (rows[(7 * n + k) % len(rows)] for k in range(size))
                connection.request("POST", "/predict", body=('{"features": [' + ",".join(chosen) + "]}").encode(),
                                   headers={"Content-Type": "application/json"})
                response = connection.getresponse()
                response.read()
                return response.status == 200

            probe = MemoryProbe(lambda: tree(server.pid), collect=False)
            with _Load(send, clients) as load:
                _sample_for(probe, trace, seconds, interval, stop=lambda: server.poll() is not None)
            load.note(trace)
            if server.poll() is not None:
                trace.notes["failures"] = (trace.notes["failures"] or 0) + 1
                trace.notes["first_failure"] = f"the server exited ({server.returncode}): {server.stderr.read()[-500:]}"
            server.send_signal(signal.SIGTERM)
            server.wait(60)
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
            server.stdout.close()
            server.stderr.close()
    return trace


def _port_of(server: subprocess.Popen) -> int:
    """The port ``dl4py serve`` announces on its first line (never waits past SERVER_START_SECONDS)."""
    line = []
    reader = threading.Thread(target=lambda: line.append(server.stdout.readline()), daemon=True)
    reader.start()
    reader.join(SERVER_START_SECONDS)
    found = re.search(r"http://127\.0\.0\.1:(\d+)", line[0]) if line else None
    if found is None:
        server.kill()
        raise RuntimeError(f"dl4py serve did not announce its address: {line[:1]} {server.stderr.read()[-2000:]}")
    return int(found.group(1))


def inference_load(seconds: float, warmup_seconds: float, interval: float, workload: Workload = Workload(),
                   backend: str = "cpu", clients: int = 4) -> Trace:
    """A ParallelInference (2 replicas, batched) in this process under ``clients`` threads."""
    trace = Trace("ParallelInference under load", int(warmup_seconds / interval), window=5,
                  notes={"seconds": seconds, "clients": clients, "sample_every_s": interval})
    x = workload.data(2)[0][:256]
    model = MultiLayerNetwork(workload.network(), backend=backend).init()
    with ParallelInference(model, workers=2, batch_limit=32, queue_limit=64) as inference:
        def send(state, size, n) -> bool:
            start = (7 * n) % (len(x) - size)
            return inference.output(x[start:start + size]).shape[0] == size

        probe = MemoryProbe(lambda: [os.getpid()], collect=False)  # the clients allocate as they go
        with _Load(send, clients) as load:
            _sample_for(probe, trace, seconds, interval)
        load.note(trace)
        trace.notes["forward_passes"] = inference.stats()["forward_passes"]
    return trace
