"""EarlyStoppingConfiguration and EarlyStoppingResult (DL4J's classes of those names)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dl4py.errors import ConfigError
from dl4py.train.early_stopping.calculators import ScoreCalculator
from dl4py.train.early_stopping.conditions import EpochTerminationCondition, IterationTerminationCondition, MaxEpochs

EPOCH_CONDITION = "EpochTerminationCondition"
ITERATION_CONDITION = "IterationTerminationCondition"
ERROR = "Error"


def _in_memory_saver():
    """DL4J's default saver, an InMemoryModelSaver: it writes model files, so it lives in nn."""
    from dl4py.nn.savers import InMemoryModelSaver  # cycle: dl4py.nn.savers imports dl4py.train.early_stopping.savers

    return InMemoryModelSaver()


@dataclass
class EarlyStoppingConfiguration:
    """What ends training and how models are scored and kept.

        EarlyStoppingConfiguration(
            score_calculator=ClassificationScoreCalculator("accuracy", validation),
            epoch_conditions=[MaxEpochs(30), ScoreImprovement(patience=3)],
            iteration_conditions=[MaxTime(3600), InvalidScore()],
            model_saver=LocalFileModelSaver("runs/es"))
    """

    score_calculator: ScoreCalculator | None = None
    epoch_conditions: list = field(default_factory=list)
    iteration_conditions: list = field(default_factory=list)
    model_saver: object = field(default_factory=_in_memory_saver)
    evaluate_every_n_epochs: int = 1
    save_last_model: bool = False

    def __post_init__(self):
        if not isinstance(self.score_calculator, ScoreCalculator):
            raise ConfigError("score_calculator", "is required: a ScoreCalculator that scores the model "
                              "on held-out data (e.g. ClassificationScoreCalculator('accuracy', iterator))")
        if not self.epoch_conditions and not self.iteration_conditions:
            raise ConfigError("epoch_conditions", "at least one termination condition (epoch or iteration) "
                              "is required, e.g. MaxEpochs(n) or ScoreImprovement(patience)")
        for i, c in enumerate(self.epoch_conditions):
            if not isinstance(c, EpochTerminationCondition):
                raise ConfigError(f"epoch_conditions[{i}]", f"is not an epoch termination condition: {c!r}")
        for i, c in enumerate(self.iteration_conditions):
            if not isinstance(c, IterationTerminationCondition):
                raise ConfigError(f"iteration_conditions[{i}]", f"is not an iteration termination condition: {c!r}")
        if not isinstance(self.evaluate_every_n_epochs, int) or self.evaluate_every_n_epochs < 1:
            raise ConfigError("evaluate_every_n_epochs", f"must be a positive integer, got {self.evaluate_every_n_epochs!r}")
        if not all(hasattr(self.model_saver, m) for m in ("save_best", "save_latest", "get_best_model")):
            raise ConfigError("model_saver", "must have save_best, save_latest and get_best_model")

    def max_epochs(self) -> int | None:
        """The most epochs a fit can train (its MaxEpochs); None where other conditions alone end it."""
        limits = [c.max_epochs for c in self.epoch_conditions if isinstance(c, MaxEpochs)]
        return min(limits) if limits else None


@dataclass
class EarlyStoppingResult:
    termination_reason: str  # EpochTerminationCondition | IterationTerminationCondition | Error
    termination_details: str
    score_vs_epoch: dict[int, float]
    best_model_epoch: int  # -1 when no epoch was evaluated
    best_model_score: float
    total_epochs: int
    model_saver: object = field(repr=False, default=None)
    history: object = field(repr=False, default=None)  # the History of the epochs trained

    def best_model(self, into=None, backend=None):
        """The best model, rebuilt from the saver (``into``: a TorchModel to load it into) on
        ``backend`` (a name or the trained model's ``backend``; default: the process's choice)."""
        if backend is None:  # a saver of the user's own may not take a backend
            return self.model_saver.get_best_model(into=into)
        return self.model_saver.get_best_model(into=into, backend=backend)

    def to_dict(self) -> dict:
        return {
            "termination_reason": self.termination_reason,
            "termination_details": self.termination_details,
            "score_vs_epoch": {str(k): v for k, v in self.score_vs_epoch.items()},
            "best_model_epoch": self.best_model_epoch,
            "best_model_score": self.best_model_score,
            "total_epochs": self.total_epochs,
        }
