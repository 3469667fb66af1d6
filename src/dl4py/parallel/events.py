"""Worker 0's training events, relayed to the coordinator, which alone runs the listeners.

In a spawned run the coordinating process owns the run directory: the fit's listeners
(metrics, checkpoints, progress) and the early-stopping controller (scoring, best and
latest model, the epoch decision) run there, never in a worker. Worker 0 relays what they
need (``EventRelay``) and the coordinator replays it on its model (``EventReplay``):

- steps, as ``Iterations`` batches: worker 0 keeps the loss tensors and reads them all at
  once at most every ``FLUSH_SECONDS`` (and at each epoch's end), so relaying adds no
  wait for the device per step. One step is one round, numbered in the model's units:
  ``iteration`` counts the batches of every worker (2, 4, 6, ... with two workers);
- what listeners' parts in worker 0 made (``ListenerRecords``: a ``StatsListener``'s
  per-layer statistics, which need the live replica), sent with the ``Iterations``;
- each epoch's end, with worker 0's averaged replica as bytes: the coordinator loads it
  into its model before ``on_epoch_end``, so a listener that saves ``model`` saves that
  state, and under early stopping scores it and sends the decision back to worker 0,
  which passes it on to the other workers.

Every worker's "dl4py" log records go the same way (``LogRelay``), at the level the
coordinator's "dl4py" logger had when the fit began, and are logged there under the
worker's rank: "[worker 0] ...".

During an epoch the coordinator's model holds the state of the last epoch end.
Under torchrun there is no coordinator: rank 0 runs the listeners itself, and each rank
logs to its own handlers.
"""

from __future__ import annotations

import logging
import queue
import time

import torch

from dl4py.errors import TrainingError
from dl4py.nn.serialization import model_bytes, restore_state
from dl4py.parallel.messages import Decision, EpochEnded, EpochStarted, Iterations, ListenerRecords, LogRecord
from dl4py.train.listeners import TrainingListener
from dl4py.train.numbering import epoch_name

log = logging.getLogger("dl4py")

FLUSH_SECONDS = 0.25  # as often as a progress bar redraws


class EventRelay(TrainingListener):
    """Worker 0's last listener in a spawned run: sends the coordinator its events.
    ``iterations``: relay steps and epoch starts too (the coordinator has listeners).
    ``parts``: the listeners' parts that run before it on the replica (``worker_parts``);
    what each made (``drain()``) goes with the steps."""

    def __init__(self, messages, decisions, iterations: bool, timeout: float, parts=()):
        self.messages, self.decisions = messages, decisions
        self.iterations, self.timeout = iterations, timeout
        self.parts = list(parts)
        self._pending: list[tuple] = []  # (iteration, epoch, loss on the device, batch size)
        self._flushed = time.monotonic()

    def on_epoch_start(self, model, epoch):
        if self.iterations:
            self.messages.put(EpochStarted(epoch))

    def iteration_done(self, model, iteration, epoch, loss, batch_size):
        if self.iterations:
            self._pending.append((iteration, epoch, loss, batch_size))
            if time.monotonic() - self._flushed >= FLUSH_SECONDS:
                self._flush()

    def on_epoch_end(self, model, summary):
        self._flush()
        self.messages.put(EpochEnded(summary, model_bytes(model)))

    def on_fit_end(self, model, interrupted):
        self._flush()  # the steps of an interrupted epoch count: its checkpoint has them

    def decision(self, replica) -> str | None:
        """Wait for the coordinator's early-stopping verdict on the epoch just ended."""
        epoch = replica.epoch_count - 1
        try:
            decision = self.decisions.get(timeout=self.timeout)
        except queue.Empty:
            raise TrainingError(f"worker 0 waited timeout={self.timeout:.0f} s for the coordinator's early-stopping "
                                f"decision on {epoch_name(epoch)}, and none came") from None
        if decision.epoch != epoch:
            raise TrainingError(f"worker 0 expected the early-stopping decision on {epoch_name(epoch)} but got one "
                                f"on {epoch_name(decision.epoch)}")
        return decision.stop_reason

    def _flush(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, []
            # One device-to-host copy for them all: reading each loss alone would make every
            # step wait for the GPU.
            losses = torch.stack([loss for _, _, loss, _ in pending]).tolist()
            self.messages.put(Iterations([(i, e, value, n) for (i, e, _, n), value in zip(pending, losses)]))
        for index, part in enumerate(self.parts):
            records = part.drain()
            if records:
                self.messages.put(ListenerRecords(index, records))
        self._flushed = time.monotonic()


class EventReplay:
    """The coordinator's side: runs the fit's ``listeners`` and the early-stopping
    ``controller`` on worker 0's events, with ``model`` (the user's) as their model, and
    logs every worker's records."""

    def __init__(self, model, listeners, controller=None):
        self.model, self.listeners, self.controller = model, list(listeners), controller
        self.decisions = None  # the queue worker 0 reads decisions from (with a controller)
        self.model_changed = False
        self._part_owners: list = []  # the listener that handed out each of worker 0's parts

    def worker_parts(self, workers: int) -> list:
        """The parts worker 0 runs on its replica for listeners that must read the live model
        (a ``StatsListener``'s collector: its ``worker_part(workers)``); their records come
        back as ``ListenerRecords`` to the listener's ``receive``."""
        owners = [listener for listener in self.listeners if hasattr(listener, "worker_part")]
        self._part_owners = owners
        return [listener.worker_part(workers) for listener in owners]

    @property
    def relays_epochs(self) -> bool:
        return bool(self.listeners) or self.controller is not None

    @property
    def relays_iterations(self) -> bool:
        return bool(self.listeners)

    def fit_start(self) -> None:
        for listener in self.listeners:
            listener.on_fit_start(self.model)

    def handle(self, message) -> None:
        if isinstance(message, Iterations):
            for iteration, epoch, value, batch_size in message.records:
                loss = torch.tensor(value, dtype=torch.float64)  # a tensor, as listeners see in one process
                for listener in self.listeners:
                    listener.iteration_done(self.model, iteration, epoch, loss, batch_size)
        elif isinstance(message, EpochStarted):
            for listener in self.listeners:
                listener.on_epoch_start(self.model, message.epoch)
        elif isinstance(message, ListenerRecords):
            self._part_owners[message.part].receive(message.records)
        elif isinstance(message, EpochEnded):
            restore_state(self.model, message.state)
            self.model_changed = True
            for listener in self.listeners:
                listener.on_epoch_end(self.model, message.summary)
            if self.controller is not None:
                epoch = message.summary.epoch
                # Always answered, even while stopping: worker 0 may already be waiting.
                self.decisions.put(Decision(epoch, self.controller.end_of_epoch(self.model, epoch)))
        elif isinstance(message, LogRecord):
            logging.getLogger(message.name).log(message.levelno, "[worker %d] %s", message.rank, message.message,
                                                extra={"worker": message.rank})
        else:
            raise TrainingError(f"the coordinator got a message it does not know from a worker: {message!r}")

    def fit_end(self, interrupted: bool) -> None:
        for listener in self.listeners:
            listener.on_fit_end(self.model, interrupted)

    def abandon(self, before) -> None:
        """A fit that failed: the listeners end without a checkpoint, and the model goes back
        to its state from before the fit (``before``: that state's file)."""
        for listener in self.listeners:
            try:
                listener.on_fit_end(self.model, False)
            except Exception:  # the failure being raised matters more than this one
                log.exception("%s.on_fit_end failed after the parallel fit failed", type(listener).__name__)
        if self.model_changed:
            restore_state(self.model, before)


class LogRelay(logging.Handler):
    """A spawned worker's handler for its "dl4py" logger: each record goes to the
    coordinator as a ``LogRecord``, its message (and traceback) formatted here. The queue is
    unbounded and ``put_nowait`` never waits, so logging cannot hold a worker up."""

    def __init__(self, messages, rank: int, level: int):
        super().__init__(level)
        self.messages, self.rank = messages, rank

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.messages.put_nowait(LogRecord(self.rank, record.levelno, record.name, self.format(record)))
        except Exception:  # a closed queue (the worker is failing): logging's own report, on stderr
            self.handleError(record)


def relay_logs(messages, rank: int, level: int) -> None:
    """Send this worker's "dl4py" records of ``level`` and above to the coordinator, and
    nowhere else: the coordinator's handlers decide where they are shown. Called again (a
    worker that lives on for the next fit), it replaces the relay it set up before."""
    logger = logging.getLogger("dl4py")
    logger.setLevel(level)  # a record below it is not even made, let alone sent
    logger.handlers[:] = [h for h in logger.handlers if not isinstance(h, LogRelay)]
    logger.addHandler(LogRelay(messages, rank, level))
    logger.propagate = False
