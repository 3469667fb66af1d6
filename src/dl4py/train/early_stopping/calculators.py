"""Score calculators: how good the model is on held-out data, after an epoch."""

from __future__ import annotations

import torch

from dl4py.errors import ConfigError

CLASSIFICATION_METRICS = ("accuracy", "f1", "precision", "recall")
REGRESSION_METRICS = {"mse": True, "mae": True, "rmse": True, "r2": False}  # name -> minimise


class ScoreCalculator:
    minimize_score: bool

    def calculate_score(self, model) -> float:
        raise NotImplementedError


class DataSetLossCalculator(ScoreCalculator):
    """Mean loss per example on ``iterator`` (minimised)."""

    minimize_score = True

    def __init__(self, iterator):
        self.iterator = iterator

    def calculate_score(self, model) -> float:
        return model.score(self.iterator)

    def __str__(self):
        return "DataSetLossCalculator"


class ClassificationScoreCalculator(ScoreCalculator):
    """A classification metric on ``iterator`` (maximised): accuracy, f1, precision or recall."""

    minimize_score = False

    def __init__(self, metric: str, iterator):
        if metric not in CLASSIFICATION_METRICS:
            raise ConfigError("metric", f"must be one of {', '.join(CLASSIFICATION_METRICS)}; got {metric!r}")
        self.metric, self.iterator = metric, iterator

    def calculate_score(self, model) -> float:
        return float(getattr(model.evaluate(self.iterator), self.metric)())

    def __str__(self):
        return f"ClassificationScoreCalculator({self.metric})"


class RegressionScoreCalculator(ScoreCalculator):
    """A regression metric on ``iterator``: mse, mae, rmse (minimised) or r2 (maximised)."""

    def __init__(self, metric: str, iterator):
        if metric not in REGRESSION_METRICS:
            raise ConfigError("metric", f"must be one of {', '.join(REGRESSION_METRICS)}; got {metric!r}")
        self.metric, self.iterator = metric, iterator
        self.minimize_score = REGRESSION_METRICS[metric]

    def calculate_score(self, model) -> float:
        errors, targets = [], []
        for batch in self.iterator:
            predicted = model.output(batch.features).to("cpu", torch.float64)
            target = batch.labels.to("cpu", torch.float64).reshape(predicted.shape)  # labels may be on a GPU
            errors.append(predicted - target)
            targets.append(target)
        error, target = torch.cat(errors), torch.cat(targets)
        if self.metric == "mae":
            return float(error.abs().mean())
        mse = float((error**2).mean())
        if self.metric == "mse":
            return mse
        if self.metric == "rmse":
            return mse**0.5
        return 1.0 - float((error**2).sum()) / float(((target - target.mean(0)) ** 2).sum())

    def __str__(self):
        return f"RegressionScoreCalculator({self.metric})"
