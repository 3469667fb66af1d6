"""What spawned workers and their coordinator tell each other: small picklable dataclasses.

Coordinator -> each worker of the pool: a ``Job`` per fit (None: the pool closes).
Workers -> coordinator, on one queue (a queue keeps each sender's order): ``Ready`` once
a worker runs, then for each job worker 0's training events (``EpochStarted``,
``Iterations``, ``ListenerRecords``, ``EpochEnded``) when the coordinator runs listeners or early stopping,
every worker's ``LogRecord``s, then every worker's last word on the job, ``Done`` or
``Failed`` (after which it exits).
Coordinator -> worker 0: a ``Decision`` after each ``EpochEnded`` under early stopping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dl4py.train.loop import EpochSummary

if TYPE_CHECKING:
    from dl4py.parallel.rank import RankReport
    from dl4py.parallel.worker import WorkerSpec


@dataclass(frozen=True)
class Job:
    """One fit, for every worker of the pool: its number counts the pool's fits."""

    number: int
    spec: "WorkerSpec"


@dataclass(frozen=True)
class Ready:
    """A worker runs dl4py's code: it got through importing the main script."""

    rank: int


@dataclass(frozen=True)
class EpochStarted:
    epoch: int


@dataclass(frozen=True)
class Iterations:
    """Rounds since worker 0's last message: ``(iteration, epoch, loss, batch_size)`` each, in
    the model's units: ``iteration`` counts every worker's batches, ``batch_size`` is the
    round's examples, ``loss`` worker 0's."""

    records: list[tuple[int, int, float, int]]


@dataclass(frozen=True)
class ListenerRecords:
    """What a listener's part in worker 0 made since worker 0's last message (``StatsListener``'s
    "stats" records, read from the live replica): for the coordinator's listener that handed
    out part number ``part`` of this fit (``EventReplay.worker_parts``)."""

    part: int
    records: list


@dataclass(frozen=True)
class EpochEnded:
    summary: EpochSummary
    state: bytes  # worker 0's replica after the epoch's final averaging, as a model file


@dataclass(frozen=True)
class LogRecord:
    """A record of a worker's "dl4py" logger, its message formatted in the worker (the
    arguments of a log call need not be picklable)."""

    rank: int
    levelno: int
    name: str  # the logger's: "dl4py" or a child
    message: str


@dataclass(frozen=True)
class Decision:
    """The early-stopping controller's verdict on ``epoch``: the condition that fired, or None."""

    epoch: int
    stop_reason: str | None


@dataclass(frozen=True)
class Done:
    rank: int
    report: "RankReport"
    job: int = 0  # the Job's number


@dataclass(frozen=True)
class Failed:
    rank: int
    device: str
    traceback: str  # the error's message alone when user_error
    user_error: bool = False  # a DL4PyError: a problem with the data or settings, not a bug
