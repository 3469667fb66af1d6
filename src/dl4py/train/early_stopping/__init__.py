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
from dl4py.train.early_stopping.savers import InMemoryModelSaver, LocalFileModelSaver
from dl4py.train.early_stopping.trainer import EarlyStoppingTrainer

__all__ = [
    "BestScore", "ClassificationScoreCalculator", "DataSetLossCalculator", "EarlyStoppingConfiguration",
    "EarlyStoppingController", "EarlyStoppingResult", "EarlyStoppingTrainer", "EpochTerminationCondition",
    "InMemoryModelSaver", "InvalidScore", "IterationTerminationCondition", "LocalFileModelSaver",
    "MaxEpochs", "MaxScore", "MaxTime", "RegressionScoreCalculator", "ScoreCalculator",
    "ScoreImprovement",
]
