"""What spawned workers and their coordinator tell each other: small picklable dataclasses.

Workers -> coordinator, on one queue (a queue keeps each sender's order): worker 0's
training events (``EpochStarted``, ``Iterations``, ``EpochEnded``) when the coordinator
runs listeners or early stopping, then every worker's last word, ``Done`` or ``Failed``.
Coordinator -> worker 0: a ``Decision`` after each ``EpochEnded`` under early stopping.
"""

from __future__ import annotations

from dataclasses import dataclass

from dl4py.train.loop import EpochSummary


@dataclass(frozen=True)
class EpochStarted:
    epoch: int


@dataclass(frozen=True)
class Iterations:
    """Worker 0's steps since its last message: ``(iteration, epoch, loss, batch_size)`` each."""

    records: list[tuple[int, int, float, int]]


@dataclass(frozen=True)
class EpochEnded:
    summary: EpochSummary
    state: bytes  # worker 0's replica after the epoch's final averaging, as a model file


@dataclass(frozen=True)
class Decision:
    """The early-stopping controller's verdict on ``epoch``: the condition that fired, or None."""

    epoch: int
    stop_reason: str | None


@dataclass(frozen=True)
class Done:
    rank: int
    report: dict  # summaries, stop reason, interrupted, recorded examples


@dataclass(frozen=True)
class Failed:
    rank: int
    device: str
    traceback: str  # the error's message alone when user_error
    user_error: bool = False  # a DL4PyError: a problem with the data or settings, not a bug
