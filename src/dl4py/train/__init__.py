"""Training: the step every trainer shares, the single-device loop, listeners."""

from dl4py.train.keras_callbacks import EarlyStopping, ModelCheckpoint
from dl4py.train.listeners import (
    CheckpointListener,
    MetricsLogger,
    MonitoringListener,
    PerformanceListener,
    ScoreIterationListener,
    TrainingListener,
)
from dl4py.train.progress import EpochLines, ProgressBar
from dl4py.train.loop import EpochSummary, TrainingInterrupted, fit
from dl4py.train.step import make_train_step

__all__ = [
    "CheckpointListener", "EarlyStopping", "EpochLines", "EpochSummary", "MetricsLogger", "ModelCheckpoint",
    "MonitoringListener", "PerformanceListener", "ProgressBar", "ScoreIterationListener", "TrainingInterrupted",
    "TrainingListener", "fit", "make_train_step",
]
