"""Score calculators: how good the model is on held-out data, after an epoch."""

from __future__ import annotations

from dl4py.errors import ConfigError
from dl4py.eval import RegressionEvaluation
from dl4py.eval.select import is_regression_loss, output_loss

CLASSIFICATION_METRICS = ("accuracy", "f1", "precision", "recall")
REGRESSION_METRICS = {"mse": True, "mae": True, "rmse": True, "rse": True, "r2": False, "pc": False}  # -> minimise
_REGRESSION_METHODS = {"mse": "mean_squared_error", "mae": "mean_absolute_error", "rmse": "root_mean_squared_error",
                       "rse": "relative_squared_error", "r2": "r_squared", "pc": "pearson_correlation"}


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
        evaluation = model.evaluate(self.iterator)
        if not hasattr(evaluation, self.metric):  # a RegressionEvaluation: the model regresses
            raise ConfigError("metric", f"{self.metric!r} is a classification metric but the model's output has a "
                                        f"regression loss; use RegressionScoreCalculator({', '.join(REGRESSION_METRICS)})")
        return float(getattr(evaluation, self.metric)())

    def __str__(self):
        return f"ClassificationScoreCalculator({self.metric})"


class RegressionScoreCalculator(ScoreCalculator):
    """A regression metric on ``iterator`` (DL4J's ``RegressionScoreCalculator``): mse, mae,
    rmse, rse (minimised), r2 or pc (Pearson correlation; maximised), averaged over columns."""

    def __init__(self, metric: str, iterator):
        if metric not in REGRESSION_METRICS:
            raise ConfigError("metric", f"must be one of {', '.join(REGRESSION_METRICS)}; got {metric!r}")
        self.metric, self.iterator = metric, iterator
        self.minimize_score = REGRESSION_METRICS[metric]

    def calculate_score(self, model) -> float:
        # Streamed batch by batch: nothing of the held-out set is kept but per-column sums.
        evaluation = RegressionEvaluation()
        for batch in self.iterator:
            evaluation.eval(batch.labels, model.output(batch.features))
        return float(getattr(evaluation, _REGRESSION_METHODS[self.metric])())

    def __str__(self):
        return f"RegressionScoreCalculator({self.metric})"


def calculator_for(metric: str, iterator, model=None) -> ScoreCalculator:
    """The calculator ``training.early_stopping.metric`` names: ``loss``, a classification or a
    regression metric. Given the model, a classification metric for a model trained with a
    regression loss is refused before training rather than after the first epoch."""
    if metric == "loss":
        return DataSetLossCalculator(iterator)
    if metric in REGRESSION_METRICS:
        return RegressionScoreCalculator(metric, iterator)
    if model is not None and metric in CLASSIFICATION_METRICS:
        loss = output_loss(model)
        if is_regression_loss(loss):
            raise ConfigError("training.early_stopping.metric",
                              f"{metric!r} is a classification metric but the output layer's loss {loss!r} is a "
                              f"regression loss; use loss or one of {', '.join(REGRESSION_METRICS)}")
    return ClassificationScoreCalculator(metric, iterator)
