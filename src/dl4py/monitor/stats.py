"""StatsListener (DL4J's name): what training looks like inside, in records a UI can draw.

    from dl4py.monitor import StatsListener, InMemoryStatsStorage

    model.fit(train, epochs=5, validation=val, listeners=[StatsListener("runs/lenet")])
    # runs/lenet/metrics.jsonl: a "static" record, "stats" every 10 iterations, "epoch"s

At each fit's start a "static" record: the model's summary, parameter count and layer
names, the environment (backend, device, precision, versions) and the number of workers.
Every ``frequency`` iterations a "stats" record (``collector.py``: score, learning rate,
samples/s, memory, and per layer the mean absolute parameter, gradient, update and
activation with DL4J's update:parameter ratio; every ``histogram_every``-th of them also
the histograms of each layer's parameters, gradients and updates). At each epoch's end an
"epoch" record: History's keys, validation metrics included when the fit has validation data.

With a ParallelWrapper's spawned workers the listener runs in this process on worker 0's
relayed events, where the model holds only the last epoch's state; worker 0 runs the
collecting part on its replica and relays the records (``worker_part``), which this
listener writes. Under torchrun rank 0 runs the listener itself. Either way the stats
describe worker 0's replica, and the "static" record gives the number of workers.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from dl4py.monitor.collector import StatsCollector
from dl4py.monitor.environment import environment_record
from dl4py.monitor.layers import model_layers
from dl4py.monitor.storage import FileStatsStorage, StatsStorage
from dl4py.train.listeners import TrainingListener, _Count, _passes, epoch_record

METRICS_FILE = "metrics.jsonl"


class StatsListener(TrainingListener):
    """Records training statistics into ``storage``: one ``StatsStorage``, a list of them, or
    a run directory (str or Path: its ``metrics.jsonl``, through ``FileStatsStorage``).

    ``frequency``: iterations between "stats" records (0: none, only the static and epoch
    records). ``score_every``: also an "iteration" record (the score alone) every that many
    iterations (0: none). ``histogram_every``: every that many "stats" records (those at the
    iterations passing multiples of ``frequency * histogram_every``) carry ``histograms``:
    per layer, 20-bin histograms of its parameters, gradients and updates (0: none). The
    listener starts its storages at each fit's start and flushes them at its end; closing
    them is their owner's business (``close()`` closes them all). ``write(record)`` adds a
    record of one's own (an evaluation) to every storage."""

    def __init__(self, storage, frequency: int = 10, score_every: int = 0, histogram_every: int = 10):
        self.storages = _storages(storage)
        self.frequency = _count_setting("frequency", frequency)
        self.score_every = _count_setting("score_every", score_every)
        self.histogram_every = _count_setting("histogram_every", histogram_every, "stats records")
        self._collector = StatsCollector(self.frequency, self.histogram_every)
        self._count = _Count()
        self._relayed = False  # this fit's stats come from worker 0 (receive), not from the model here
        self._workers = 1
        self._static_for = None  # the model whose static record was written

    # ---- listener events ---------------------------------------------------------------
    def on_fit_start(self, model):
        for storage in self.storages:
            storage.start()
        workers = self._workers if self._relayed else _launched_world()
        if self._static_for is not model:  # once per model: early stopping fits epoch by epoch
            self._put(static_record(model, workers))
            self._static_for = model
        if not self._relayed:
            self._collector.on_fit_start(model)

    def on_epoch_start(self, model, epoch):
        self._count.start(model)
        if not self._relayed:
            self._collector.on_epoch_start(model, epoch)

    def iteration_done(self, model, iteration, epoch, loss, batch_size):
        if self.score_every and _passes(self._count.advance(iteration), iteration, self.score_every):
            self._put({"kind": "iteration", "iteration": iteration, "epoch": epoch, "score": float(loss)})
        if not self._relayed and self.frequency:
            self._collector.iteration_done(model, iteration, epoch, loss, batch_size)
            self.receive(self._collector.drain())

    def on_epoch_end(self, model, summary):
        self._put(epoch_record(model, summary))

    def on_fit_end(self, model, interrupted):
        if not self._relayed:
            self._collector.on_fit_end(model, interrupted)
        self._relayed, self._workers = False, 1
        for storage in self.storages:
            storage.flush()

    # ---- a spawned parallel fit -------------------------------------------------------------
    def worker_part(self, workers: int) -> StatsCollector:
        """The part worker 0 runs on its replica in a spawned fit of ``workers`` workers. Until
        that fit ends, this listener writes the records the part sends (``receive``) instead
        of reading the model here."""
        self._relayed, self._workers = True, workers
        return StatsCollector(self.frequency, self.histogram_every)

    def receive(self, records: list[dict]) -> None:
        """"stats" records made by the collecting part."""
        for record in records:
            self._put(record)

    # ---- records of one's own -------------------------------------------------------------
    def write(self, record: dict) -> None:
        """Add a record (a dict with a ``kind``, e.g. "evaluation") to every storage."""
        if not isinstance(record, dict) or "kind" not in record:
            raise ValueError(f"StatsListener.write: a record is a dict with a 'kind', got {record!r}")
        self._put(record)

    def close(self) -> None:
        for storage in self.storages:
            storage.close()

    def _put(self, record: dict) -> None:
        for storage in self.storages:
            storage.put_any(record)


def static_record(model, workers: int = 1) -> dict:
    """The "static" record of an initialised ``model``: what it is and where it trains."""
    return {"kind": "static",
            "model": {"summary": model.summary(), "parameters": model.num_params(),
                      "layers": [layer.name for layer in model_layers(model)]},
            "environment": environment_record(model), "workers": workers}


def _storages(storage) -> list[StatsStorage]:
    if isinstance(storage, (str, Path)):
        path = Path(storage)
        return [FileStatsStorage(path if path.suffix == ".jsonl" else path / METRICS_FILE)]
    storages = list(storage) if isinstance(storage, (list, tuple)) else [storage]
    for item in storages:
        if not isinstance(item, StatsStorage):
            raise TypeError(f"StatsListener: storage must be a StatsStorage (FileStatsStorage, InMemoryStatsStorage, "
                            f"...), a list of them, or a run directory, got {type(item).__name__}")
    if not storages:
        raise ValueError("StatsListener: give at least one storage")
    return storages


def _count_setting(name: str, value, counted: str = "iterations") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"StatsListener: {name} must be a whole number of {counted} (0: none), got {value!r}")
    return value


def _launched_world() -> int:
    """The ranks of the process group this fit runs in (torchrun: rank 0 runs the listeners); 1 alone."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
