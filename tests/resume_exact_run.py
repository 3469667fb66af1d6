"""Run by tests/test_resume_exact.py: one phase of the two-run test, for several cases.

    python resume_exact_run.py PHASE FOLDER CASE [CASE ...]

``CASE`` is ``plan:precision:data``, e.g. ``single:mixed-fp16:loader``; ``plan`` is
``single`` (Model.fit) or a ParallelWrapper training mode on 2 workers, ``data`` a
``stream`` (Parquet files read by a TableDirectoryIterator) or a ``loader`` (a shuffling
torch DataLoader). A case ending ``:cuda`` trains on the GPU (2 workers share cuda:0);
any other on the CPU. ``PHASE``:

- ``reference``: train ``EPOCHS`` epochs without a stop;
- ``first``: the same, stopped by a real Ctrl-C (SIGINT) after iteration ``STOP_AT``
  (mid-way through the second epoch), which the checkpoint listener saves;
- ``resume``: load that checkpoint and train to the end of ``EPOCHS``.

Each phase leaves ``FOLDER/CASE/PHASE.dl4py`` (the model at its end) and ``PHASE.json``
(the loss of every iteration), and ``first`` the checkpoint. Every case starts as a user's
script does: the global generators seeded, the data and the network built afresh.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from dl4py import (
    Adam,
    DenseLayer,
    DropoutLayer,
    InputType,
    MultiLayerNetwork,
    NetworkConfig,
    OutputLayer,
    TableDirectoryIterator,
    TrainingInterrupted,
    load,
)
from devices import backend_for  # beside this script, as it is run
from dl4py.parallel import ParallelPlan, ParallelWrapper
from dl4py.train.listeners import CheckpointListener, TrainingListener

EPOCHS, BATCH = 2, 8
ROWS, FILES = 160, 4  # 20 batches an epoch: 10 rounds of two workers (20 in tensor mode)
STOP_AT = 30  # an iteration of the second epoch, half-way through it
STOPPING_WAIT = 20.0  # s worker 0 waits, at most, for the coordinator to pass its Ctrl-C on


def case_folder(folder: Path, case: str) -> Path:
    return folder / case.replace(":", "-")


def parse_case(case: str) -> tuple[str, str, str, str]:
    """``(plan, precision, data, device)`` of ``plan:precision:data[:cuda]``."""
    plan, precision, kind, *device = case.split(":")
    return plan, precision, kind, device[0] if device else "cpu"


def network(precision: str, device: str = "cpu") -> MultiLayerNetwork:
    """Dropout draws from training's generators (on the input: the hybrid plan takes it only
    before its first dense layer; on a GPU, the GPU's generator); Adam's moments are the
    updater state. Loss scaling grows the scale every 4 steps without an overflow, so the
    scale changes often."""
    config = NetworkConfig(seed=5, updater=Adam(learning_rate=0.01), input_type=InputType.feed_forward(5), layers=[
        DropoutLayer(rate=0.25), DenseLayer(n_out=16, activation="tanh"), DenseLayer(n_out=16, activation="relu"),
        OutputLayer(n_out=3)])
    model = MultiLayerNetwork(config, backend=backend_for(device), precision=precision).init()
    if model.precision_state.scales_loss:
        model.precision_state.set_loss_scale(2.0**16, growth_interval=4)
    return model


def toy_rows() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, 5, generator=generator)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    # Rows far out: the batches holding them overflow a loss scale that the others do not, so
    # workers' scales part between averages.
    x[torch.rand(ROWS, generator=generator) < 0.1] *= 300.0
    return x, y


def write_table(folder: Path) -> None:
    """The toy rows as ``FILES`` Parquet files (the streamed source's pieces)."""
    import pandas as pd

    x, y = toy_rows()
    folder.mkdir(parents=True, exist_ok=True)
    per_file = ROWS // FILES
    for i in range(FILES):
        rows = slice(i * per_file, (i + 1) * per_file)
        frame = pd.DataFrame(x[rows].numpy(), columns=[f"f{j}" for j in range(5)])
        frame["y"] = y[rows].numpy()
        frame.to_parquet(folder / f"part-{i}.parquet")


def data(kind: str, folder: Path):
    if kind == "stream":
        return TableDirectoryIterator(folder / "table", label="y", batch_size=BATCH, chunk_rows=16,
                                      shuffle_buffer=24, seed=3)
    return DataLoader(TensorDataset(*toy_rows()), batch_size=BATCH, shuffle=True)


class Losses(TrainingListener):
    def __init__(self):
        self.seen: list[tuple[int, float]] = []

    def iteration_done(self, model, iteration, epoch, loss, batch_size):
        self.seen.append((iteration, float(loss)))


class CtrlCAt(TrainingListener):
    """A Ctrl-C to this process when iteration ``at`` is done. In a parallel fit the
    coordinator sees worker 0's steps late, so worker 0 sends it (``worker_part``) and
    waits until the coordinator has passed it on to the workers (it logs a warning then)."""

    def __init__(self, at: int, stopping: Path):
        self.at, self.stopping, self.in_worker = at, stopping, False

    def iteration_done(self, model, iteration, epoch, loss, batch_size):
        if iteration == self.at and not self.in_worker:
            os.kill(os.getpid(), signal.SIGINT)

    def worker_part(self, workers: int):
        self.in_worker = True
        logging.getLogger("dl4py").addHandler(_MarkWarnings(self.stopping))
        return _CtrlCFromWorker(self.at, os.getpid(), self.stopping)

    def receive(self, records):
        pass


class _MarkWarnings(logging.Handler):
    """Touches ``path`` when the coordinator says it is stopping the workers."""

    def __init__(self, path: Path):
        super().__init__(logging.WARNING)
        self.path = path

    def emit(self, record):
        if "stopping the workers" in record.getMessage():
            self.path.touch()


class _CtrlCFromWorker(TrainingListener):
    def __init__(self, at: int, coordinator: int, stopping: Path):
        self.at, self.coordinator, self.stopping, self.sent = at, coordinator, stopping, False

    def iteration_done(self, model, iteration, epoch, loss, batch_size):
        if iteration >= self.at and not self.sent:
            self.sent = True
            os.kill(self.coordinator, signal.SIGINT)
            deadline = time.monotonic() + STOPPING_WAIT
            while not self.stopping.exists() and time.monotonic() < deadline:
                time.sleep(0.05)

    def drain(self):
        return []


def run_case(phase: str, folder: Path, case: str) -> None:
    plan, precision, kind, device = parse_case(case)
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    out = case_folder(folder, case)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = out / "checkpoint.dl4py"
    model = load(checkpoint, backend=backend_for(device)) if phase == "resume" else network(precision, device)
    losses = Losses()
    listeners = [losses]
    if phase == "first":
        listeners += [CtrlCAt(STOP_AT, out / "stopping"), CheckpointListener(checkpoint)]
    try:
        if plan == "single":
            model.fit(data(kind, folder), epochs=EPOCHS - model.epoch_count, listeners=listeners, verbose=0)
        else:
            tensor_size = 2 if plan in ("tensor", "hybrid") else None
            options = {}
            if device == "cuda":
                options["devices"] = ["cuda:0"]  # both workers on one GPU, whatever the machine has
            with ParallelWrapper(model, workers=2, parallelism=ParallelPlan.from_training_mode(plan, tensor_size),
                                 **options) as wrapper:
                wrapper.fit(data(kind, folder), epochs=EPOCHS - model.epoch_count, listeners=listeners, verbose=0)
    except TrainingInterrupted:
        if phase != "first":
            raise
    else:
        if phase == "first":
            raise SystemExit(f"{case}: the run was not stopped")
    model.save(out / f"{phase}.dl4py")
    (out / f"{phase}.json").write_text(json.dumps(losses.seen))


if __name__ == "__main__":
    phase, folder = sys.argv[1], Path(sys.argv[2])
    for case in sys.argv[3:]:
        started = time.perf_counter()
        run_case(phase, folder, case)
        print(f"{case} {phase} {time.perf_counter() - started:.1f} s", flush=True)
