"""Termination conditions (DL4J's EpochTerminationCondition / IterationTerminationCondition).

Epoch conditions are asked after each epoch, with the latest score when the epoch was
evaluated; iteration conditions after every minibatch, with its loss. Each is told
whether the score is minimised or maximised, so "better" is always the right way round
(DL4J compared every score with ``<``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from dl4py.errors import ConfigError


def _positive(value, name: str, cls: str) -> None:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
        raise ConfigError(f"{cls}.{name}", f"must be positive, got {value!r}")


class EpochTerminationCondition:
    needs_score = True  # asked only after epochs that were evaluated

    def initialize(self) -> None: ...

    def terminate(self, epoch: int, score: float, minimize: bool) -> bool:
        raise NotImplementedError


class IterationTerminationCondition:
    def initialize(self) -> None: ...

    def terminate(self, score: float) -> bool:
        raise NotImplementedError


@dataclass
class MaxEpochs(EpochTerminationCondition):
    """Stop after ``max_epochs`` epochs."""

    max_epochs: int
    needs_score = False

    def __post_init__(self):
        _positive(self.max_epochs, "max_epochs", "MaxEpochs")

    def terminate(self, epoch, score, minimize):
        return epoch + 1 >= self.max_epochs

    def __str__(self):
        return f"MaxEpochs({self.max_epochs})"


@dataclass
class ScoreImprovement(EpochTerminationCondition):
    """Stop when the score has not improved by more than ``min_delta`` for ``patience``
    epochs since the best one (DL4J's ScoreImprovementEpochTerminationCondition).

    ``baseline`` (Keras' EarlyStopping): an improvement restarts the patience only when it
    also beats the baseline by more than ``min_delta``; until one does, the patience counts
    from the start (epoch 0 is the first epoch without improvement on the baseline)."""

    patience: int
    min_delta: float = 0.0
    baseline: float | None = None
    _best: float = field(default=math.nan, init=False, repr=False)
    _since: int = field(default=-1, init=False, repr=False)  # the last epoch that restarted the patience

    def __post_init__(self):
        _positive(self.patience, "patience", "ScoreImprovement")
        if self.min_delta < 0:
            raise ConfigError("ScoreImprovement.min_delta", f"must be zero or more, got {self.min_delta}")

    def initialize(self):
        self._best, self._since = math.nan, -1

    def terminate(self, epoch, score, minimize):
        if math.isnan(self._best) or _gain(self._best, score, minimize) > self.min_delta:
            self._best = score
            if self.baseline is None or _gain(self.baseline, score, minimize) > self.min_delta:
                self._since = epoch
            return False
        return epoch >= self._since + self.patience

    def __str__(self):
        baseline = "" if self.baseline is None else f", baseline={self.baseline}"
        return f"ScoreImprovement(patience={self.patience}, min_delta={self.min_delta}{baseline})"


def _gain(reference: float, score: float, minimize: bool) -> float:
    """How much better ``score`` is than ``reference`` (negative: worse)."""
    return reference - score if minimize else score - reference


@dataclass
class BestScore(EpochTerminationCondition):
    """Stop once the score reaches ``target`` (at or below it when minimising, at or above it otherwise)."""

    target: float

    def terminate(self, epoch, score, minimize):
        return score <= self.target if minimize else score >= self.target

    def __str__(self):
        return f"BestScore({self.target})"


@dataclass
class MaxTime(IterationTerminationCondition):
    """Stop once ``seconds`` have passed since training started."""

    seconds: float
    _start: float = field(default=0.0, init=False, repr=False)

    def __post_init__(self):
        _positive(self.seconds, "seconds", "MaxTime")

    def initialize(self):
        self._start = time.monotonic()

    def terminate(self, score):
        return time.monotonic() - self._start >= self.seconds

    def __str__(self):
        return f"MaxTime({self.seconds:g} s)"


@dataclass
class MaxScore(IterationTerminationCondition):
    """Stop when a minibatch score exceeds ``max_score`` (or is NaN)."""

    max_score: float

    def terminate(self, score):
        return math.isnan(score) or score > self.max_score

    def __str__(self):
        return f"MaxScore({self.max_score})"


@dataclass
class InvalidScore(IterationTerminationCondition):
    """Stop when a minibatch score is NaN or infinite."""

    def terminate(self, score):
        return not math.isfinite(score)

    def __str__(self):
        return "InvalidScore"
