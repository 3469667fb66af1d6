"""Training listeners (DL4J's TrainingListener family): score, speed, metrics, checkpoints
(the console's progress bar and epoch lines: ``progress.py``).

A listener sees the loss as a device tensor and converts it only when it reports, so a
quiet listener costs nothing per step.

``iteration`` counts minibatches, as ``model.iteration_count`` does. In one process each
call is one more; a ParallelWrapper calls once a round, for every worker's batches (2, 4,
6, ... with two workers). So listeners count the iterations between calls, and "every N
iterations" means each time the count passes a multiple of N.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

log = logging.getLogger("dl4py")


class TrainingListener:
    def on_fit_start(self, model) -> None: ...
    def on_epoch_start(self, model, epoch: int) -> None: ...
    def iteration_done(self, model, iteration: int, epoch: int, loss, batch_size: int) -> None: ...
    def on_epoch_end(self, model, summary) -> None: ...
    def on_fit_end(self, model, interrupted: bool) -> None: ...


class MonitoringListener(TrainingListener):
    """A listener that reads keys of the epoch records (History's keys: ``val_loss``,
    ``accuracy``, ...), as Keras' ``EarlyStopping`` and ``ModelCheckpoint`` do. Before the
    first step the fit shows it the keys its History will have, so that a key it can never
    read is one error at the start rather than after an epoch's training."""

    def check_keys(self, keys: list[str]) -> None:
        """Raise ConfigError, naming the key and ``keys``, for a key this listener reads that
        ``keys`` lacks."""
        raise NotImplementedError


class Listeners(list):
    """The fit's listeners as one: each event goes to every listener, in order."""

    def check_keys(self, keys: list[str]) -> None:
        for listener in self:
            if isinstance(listener, MonitoringListener):
                listener.check_keys(keys)

    def on_fit_start(self, model) -> None:
        for listener in self:
            listener.on_fit_start(model)

    def on_epoch_start(self, model, epoch: int) -> None:
        for listener in self:
            listener.on_epoch_start(model, epoch)

    def iteration_done(self, model, iteration: int, epoch: int, loss, batch_size: int) -> None:
        for listener in self:
            listener.iteration_done(model, iteration, epoch, loss, batch_size)

    def on_epoch_end(self, model, summary) -> None:
        for listener in self:  # in order: one may add to the summary that the next reads (EpochValidation)
            listener.on_epoch_end(model, summary)

    def on_fit_end(self, model, interrupted: bool) -> None:
        for listener in self:
            listener.on_fit_end(model, interrupted)


class _Count:
    """Where a listener's count of iterations stood at its last call."""

    def __init__(self):
        self.last: int | None = None

    def start(self, model) -> None:
        self.last = model.iteration_count

    def advance(self, iteration: int) -> int:
        """The iteration of the call before (or of the epoch's start); ``iteration`` becomes it.
        A count that does not go up (a loop of one's own numbering its steps otherwise) is one step."""
        last = self.last if self.last is not None and self.last < iteration else iteration - 1
        self.last = iteration
        return last


def _passes(last: int, iteration: int, every: int) -> bool:
    """Whether going from ``last`` to ``iteration`` passes a multiple of ``every``."""
    return iteration // every > last // every


class ScoreIterationListener(TrainingListener):
    """Logs the minibatch score every ``print_every`` iterations."""

    def __init__(self, print_every: int = 10):
        if print_every <= 0:
            raise ValueError(f"ScoreIterationListener: print_every must be positive, got {print_every}")
        self.print_every = print_every
        self.history: list[tuple[int, float]] = []
        self._count = _Count()

    def on_epoch_start(self, model, epoch):
        self._count.start(model)

    def iteration_done(self, model, iteration, epoch, loss, batch_size):
        if _passes(self._count.advance(iteration), iteration, self.print_every):
            score = float(loss)
            self.history.append((iteration, score))
            log.info("Score at iteration %d is %.6f", iteration, score)


class PerformanceListener(TrainingListener):
    """Samples/s and batches/s over each window of ``frequency`` iterations."""

    def __init__(self, frequency: int = 100, report: bool = True):
        if frequency <= 0:
            raise ValueError(f"PerformanceListener: frequency must be positive, got {frequency}")
        self.frequency = frequency
        self.report = report
        self.samples_per_second = 0.0
        self.batches_per_second = 0.0
        self._start = None
        self._samples = 0
        self._batches = 0
        self._count = _Count()

    def on_epoch_start(self, model, epoch):
        self._start, self._samples, self._batches = time.perf_counter(), 0, 0
        self._count.start(model)

    def iteration_done(self, model, iteration, epoch, loss, batch_size):
        self._samples += batch_size
        self._batches += iteration - self._count.advance(iteration)
        if self._batches >= self.frequency:
            elapsed = time.perf_counter() - self._start
            self.samples_per_second = self._samples / elapsed
            self.batches_per_second = self._batches / elapsed
            if self.report:
                log.info(
                    "iteration %d: %.1f samples/s, %.2f batches/s",
                    iteration, self.samples_per_second, self.batches_per_second,
                )
            self._start, self._samples, self._batches = time.perf_counter(), 0, 0


class MetricsLogger(TrainingListener):
    """Appends JSON lines to ``path``: the score every ``every`` iterations and one record per
    epoch with History's keys (``loss``, ``val_loss``, ``val_accuracy``, ``seconds``,
    ``samples_per_second``, ``learning_rate``). ``time`` counts training seconds since the
    run began: appending to the file of a resumed run, it goes on from its last record.
    The file is written by ``dl4py.monitor.FileStatsStorage``, which ``StatsListener``
    writes through too (with per-layer statistics)."""

    def __init__(self, path, every: int = 100):
        from dl4py.monitor.storage import FileStatsStorage  # cycle: dl4py.monitor.storage imports this module

        self.path = Path(path)
        self.every = every
        self.storage = FileStatsStorage(self.path)
        self._count = _Count()

    def on_fit_start(self, model):
        self.storage.start()

    def on_epoch_start(self, model, epoch):
        self._count.start(model)

    def iteration_done(self, model, iteration, epoch, loss, batch_size):
        last = self._count.advance(iteration)
        if self.every and _passes(last, iteration, self.every):
            self.storage.put({"kind": "iteration", "iteration": iteration, "epoch": epoch, "score": float(loss)})

    def on_epoch_end(self, model, summary):
        self.storage.put_epoch(epoch_record(model, summary))

    def write(self, record: dict) -> None:
        """Add a record of your own (e.g. an evaluation) to the same file."""
        self.storage.put(record)


def epoch_record(model, summary) -> dict:
    """The "epoch" record of ``metrics.jsonl``: History's keys of the epoch that ended."""
    return {"kind": "epoch", "iteration": model.iteration_count, **summary.record(), "completed": summary.completed}


class CheckpointListener(TrainingListener):
    """Saves the model (with updater state) atomically at each epoch end and when training is interrupted."""

    def __init__(self, path, every_epochs: int = 1):
        self.path = Path(path)
        self.every_epochs = every_epochs

    def on_epoch_end(self, model, summary):
        if model.epoch_count % self.every_epochs == 0:
            model.save(self.path)

    def on_fit_end(self, model, interrupted):
        if interrupted:
            model.save(self.path)
            log.info("checkpoint saved to %s (iteration %d)", self.path, model.iteration_count)
