"""Training listeners (DL4J's TrainingListener family): score, speed, progress, metrics, checkpoints.

A listener sees the loss as a device tensor and converts it only when it reports, so a
quiet listener costs nothing per step.

``iteration`` counts minibatches, as ``model.iteration_count`` does. In one process each
call is one more; a ParallelWrapper calls once a round, for every worker's batches (2, 4,
6, ... with two workers). So listeners count the iterations between calls, and "every N
iterations" means each time the count passes a multiple of N.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

log = logging.getLogger("dl4py")


class TrainingListener:
    def on_fit_start(self, model) -> None: ...
    def on_epoch_start(self, model, epoch: int) -> None: ...
    def iteration_done(self, model, iteration: int, epoch: int, loss, batch_size: int) -> None: ...
    def on_epoch_end(self, model, summary) -> None: ...
    def on_fit_end(self, model, interrupted: bool) -> None: ...


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


class ProgressBar(TrainingListener):
    """One line per epoch on stderr: batches done, speed, ETA. Redrawn at most 4 times a second.
    ``batches_per_epoch=None`` (a stream of unknown length): the count and speed, no bar or ETA."""

    def __init__(self, total_epochs: int, batches_per_epoch: int | None, stream=None, interval: float = 0.25):
        self.total_epochs = total_epochs
        self.batches = batches_per_epoch
        self._stream = stream  # None: sys.stderr when drawing (keeps the listener picklable)
        self.interval = interval
        self._first_epoch = None
        self._count = _Count()

    def on_epoch_start(self, model, epoch):
        if self._first_epoch is None:
            self._first_epoch = epoch
        self._epoch, self._done, self._start, self._last = epoch, model.batch_in_epoch, time.perf_counter(), 0.0
        self._resumed_at = model.batch_in_epoch  # trained before this fit: not part of its speed
        self._count.start(model)

    def iteration_done(self, model, iteration, epoch, loss, batch_size):
        self._done += iteration - self._count.advance(iteration)
        now = time.perf_counter()
        if now - self._last >= self.interval or (self.batches is not None and self._done >= self.batches):
            self._last = now
            self._draw(now, float(loss))

    @property
    def stream(self):
        return self._stream or sys.stderr

    def _draw(self, now: float, score: float) -> None:
        elapsed = now - self._start
        rate = (self._done - self._resumed_at) / elapsed if elapsed > 0 else 0.0
        epoch_no = self._epoch - self._first_epoch + 1
        if self.batches is None:
            self.stream.write(f"\repoch {epoch_no}/{self.total_epochs} {self._done} batches "
                              f"{rate:.1f} it/s score {score:.4f} ")
            self.stream.flush()
            return
        remaining = (self.batches - self._done) / rate if rate > 0 else 0.0
        width = 24
        filled = int(width * self._done / max(self.batches, 1))
        bar = "=" * filled + ">" * (filled < width) + " " * (width - filled - 1)
        self.stream.write(
            f"\repoch {epoch_no}/{self.total_epochs} [{bar[:width]}] {self._done}/{self.batches} "
            f"{rate:.1f} it/s score {score:.4f} ETA {_clock(remaining)} "
        )
        self.stream.flush()

    def on_epoch_end(self, model, summary):
        self.stream.write("\n")
        self.stream.flush()


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class MetricsLogger(TrainingListener):
    """Appends JSON lines to ``path``: the score every ``every`` iterations and one record per
    epoch with History's keys (``loss``, ``val_loss``, ``val_accuracy``, ``seconds``,
    ``samples_per_second``, ``learning_rate``). ``time`` counts training seconds since the
    run began: appending to the file of a resumed run, it goes on from its last record."""

    def __init__(self, path, every: int = 100):
        self.path = Path(path)
        self.every = every
        self._file = None
        self._t0 = None
        self._count = _Count()

    def on_fit_start(self, model):
        if self._t0 is None:
            self._t0 = time.time() - _last_time(self.path)

    def on_epoch_start(self, model, epoch):
        self._count.start(model)

    def iteration_done(self, model, iteration, epoch, loss, batch_size):
        last = self._count.advance(iteration)
        if self.every and _passes(last, iteration, self.every):
            self._write({"kind": "iteration", "iteration": iteration, "epoch": epoch, "score": float(loss)})

    def on_epoch_end(self, model, summary):
        self._write({"kind": "epoch", "iteration": model.iteration_count, **summary.record(),
                     "completed": summary.completed})

    def write(self, record: dict) -> None:
        """Add a record of your own (e.g. an evaluation) to the same file."""
        self._write(record)

    def _write(self, record: dict) -> None:
        if self._t0 is None:
            self._t0 = time.time() - _last_time(self.path)
        record = {"time": round(time.time() - self._t0, 3), **record}
        try:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = self.path.open("a", buffering=1)  # line-buffered: each record lands whole
            self._file.write(json.dumps(record) + "\n")
        except OSError as exc:  # disk full, read-only: a sentence naming the file
            from dl4py.errors import StorageError

            raise StorageError("append to", self.path, exc) from exc

    def on_fit_end(self, model, interrupted):
        if self._file is not None:
            self._file.close()
            self._file = None


def _last_time(path: Path) -> float:
    """The ``time`` of the last whole record in ``path`` (0 for a new file)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 65536))  # records are short: the tail holds the last one
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return 0.0
    for line in reversed(lines):
        try:
            value = json.loads(line).get("time")
        except (ValueError, AttributeError):
            continue  # a torn last line (a crash mid-write), or a partial first one
        if isinstance(value, (int, float)):
            return float(value)
    return 0.0


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
