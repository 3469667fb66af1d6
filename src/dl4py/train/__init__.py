"""Training: the step every trainer shares, the single-device loop, listeners."""

from dl4py.train.listeners import (
    CheckpointListener,
    MetricsLogger,
    PerformanceListener,
    ProgressBar,
    ScoreIterationListener,
    TrainingListener,
)
from dl4py.train.loop import EpochSummary, TrainingInterrupted, fit
from dl4py.train.step import make_train_step

__all__ = [
    "CheckpointListener", "EpochSummary", "MetricsLogger", "PerformanceListener", "ProgressBar",
    "ScoreIterationListener", "TrainingInterrupted", "TrainingListener", "fit", "make_train_step",
]
