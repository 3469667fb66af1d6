"""The early-stopping logic both trainers share: conditions, scoring, keeping the best model.

The single-device trainer calls it from a listener and after each epoch. In parallel
training it lives where the run directory is written (the coordinating process, or rank 0
under torchrun) and makes the epoch decisions, which every worker follows; the workers
ask only the iteration conditions (``first_firing``), each about its own losses. Keras'
``EarlyStopping`` listener runs one inside ``Model.fit``; its ``ModelCheckpoint`` keeps
the best model with the controller's ``BestModel`` (``train/keras_callbacks.py``).
"""

from __future__ import annotations

import logging
import math

from dl4py.train.early_stopping.configuration import EarlyStoppingConfiguration, EarlyStoppingResult
from dl4py.train.numbering import epoch_name

log = logging.getLogger("dl4py")


class BestModel:
    """The best score so far, the epoch that scored it, and the saver that keeps that model:
    a score strictly better than the best (NaN never is) goes to ``saver.save_best``."""

    def __init__(self, saver, minimize: bool, initial: float = math.nan):
        """``initial``: a score the first kept model must beat (NaN: none)."""
        self.saver, self.minimize = saver, minimize
        self.epoch, self.score = -1, initial

    def offer(self, model, epoch: int, score: float) -> bool:
        """Keep ``model`` when ``score`` is the best yet; True if it was kept."""
        if not self.better(score):
            return False
        self.epoch, self.score = epoch, score
        self.saver.save_best(model, score)
        return True

    def better(self, score: float) -> bool:
        if math.isnan(score):
            return False
        if math.isnan(self.score):
            return True
        return score < self.score if self.minimize else score > self.score


class EarlyStoppingController:
    def __init__(self, config: EarlyStoppingConfiguration):
        self.config = config
        self.start()

    def start(self, first_epoch: int = 0) -> None:
        """Begin a fit whose first epoch is the model's epoch ``first_epoch``. Conditions
        count this fit's epochs (MaxEpochs(3): three more); scores keep the model's numbers."""
        for condition in (*self.config.epoch_conditions, *self.config.iteration_conditions):
            condition.initialize()
        self.first_epoch = first_epoch
        self.score_vs_epoch: dict[int, float] = {}
        self.best = BestModel(self.config.model_saver, self.minimize)
        self.epochs_done = 0
        self.last_score = math.nan

    @property
    def minimize(self) -> bool:
        return self.config.score_calculator.minimize_score

    @property
    def best_epoch(self) -> int:
        return self.best.epoch

    @property
    def best_score(self) -> float:
        return self.best.score

    def check_iteration(self, loss: float) -> str | None:
        """The first iteration condition that fires on this minibatch loss, described; else None."""
        return first_firing(self.config.iteration_conditions, loss)

    def end_of_epoch(self, model, epoch: int) -> str | None:
        """Score (every n epochs), keep the best model, and ask the epoch conditions."""
        local = epoch - self.first_epoch
        self.epochs_done = local + 1
        evaluated = (local + 1) % self.config.evaluate_every_n_epochs == 0
        if evaluated:
            score = float(self.config.score_calculator.calculate_score(model))
            self.score_vs_epoch[epoch] = score
            self.last_score = score
            self.best.offer(model, epoch, score)
            if self.config.save_last_model:
                self.config.model_saver.save_latest(model, score)
            log.info("%s: score %.6f (%s)", epoch_name(epoch), score, self._best_in_words())
        for condition in self.config.epoch_conditions:
            if (evaluated or not condition.needs_score) and condition.terminate(local, self.last_score, self.minimize):
                return str(condition)
        return None

    def _best_in_words(self) -> str:
        """The best so far for the log, its epoch counted from 1 as the console's lines count
        (the result's ``best_model_epoch`` stays DL4J's 0-based index)."""
        if self.best_epoch < 0:  # every score so far NaN
            return "no best yet"
        return f"best {self.best_score:.6f} at {epoch_name(self.best_epoch)}"

    def result(self, reason: str, details: str, history=None) -> EarlyStoppingResult:
        return EarlyStoppingResult(
            termination_reason=reason, termination_details=details,
            score_vs_epoch=dict(self.score_vs_epoch), best_model_epoch=self.best_epoch,
            best_model_score=self.best_score, total_epochs=self.epochs_done,
            model_saver=self.config.model_saver, history=history,
        )


def first_firing(conditions, loss: float) -> str | None:
    """The first of the iteration ``conditions`` that fires on this minibatch loss, described."""
    for condition in conditions:
        if condition.terminate(loss):
            return str(condition)
    return None
