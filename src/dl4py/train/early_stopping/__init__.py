"""Early stopping (DL4J's earlystopping package): conditions, score calculators, savers, trainers."""

from dl4py.train.early_stopping.calculators import (
    ClassificationScoreCalculator,
    DataSetLossCalculator,
    RegressionScoreCalculator,
    ScoreCalculator,
)
from dl4py.train.early_stopping.conditions import (
    BestScore,
    EpochTerminationCondition,
    InvalidScore,
    IterationTerminationCondition,
    MaxEpochs,
    MaxScore,
    MaxTime,
    ScoreImprovement,
)
from dl4py.train.early_stopping.configuration import EarlyStoppingConfiguration, EarlyStoppingResult
from dl4py.train.early_stopping.controller import EarlyStoppingController
from dl4py.train.early_stopping.savers import EarlyStoppingModelSaver
from dl4py.train.early_stopping.trainer import EarlyStoppingTrainer

# DL4J's savers, named here as in its earlystopping package; they live in dl4py.nn.savers.
_SAVERS = ("InMemoryModelSaver", "LocalFileModelSaver")

__all__ = [
    "BestScore", "ClassificationScoreCalculator", "DataSetLossCalculator", "EarlyStoppingConfiguration",
    "EarlyStoppingController", "EarlyStoppingModelSaver", "EarlyStoppingResult", "EarlyStoppingTrainer",
    "EpochTerminationCondition",
    "InMemoryModelSaver", "InvalidScore", "IterationTerminationCondition", "LocalFileModelSaver",
    "MaxEpochs", "MaxScore", "MaxTime", "RegressionScoreCalculator", "ScoreCalculator",
    "ScoreImprovement",
]


def __getattr__(name: str):
    """The savers, loaded when first asked for: train sits below nn and imports none of it."""
    if name in _SAVERS:
        from dl4py.nn import savers  # cycle: dl4py.nn.savers imports dl4py.train.early_stopping.savers
        return getattr(savers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
