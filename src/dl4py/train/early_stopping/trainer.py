"""EarlyStoppingTrainer: single-device training until a termination condition fires."""

from __future__ import annotations

import logging
import traceback

from dl4py.data.adapters import as_iterator
from dl4py.train.early_stopping.configuration import (
    EPOCH_CONDITION,
    ERROR,
    ITERATION_CONDITION,
    EarlyStoppingConfiguration,
    EarlyStoppingResult,
)
from dl4py.train.early_stopping.controller import EarlyStoppingController
from dl4py.train.history import History
from dl4py.train.listeners import TrainingListener
from dl4py.train.loop import TrainingInterrupted
from dl4py.train.progress import batches_of, console_listeners

log = logging.getLogger("dl4py")


class _IterationConditions(TrainingListener):
    """Asks the iteration conditions after every minibatch (reads the loss: one host sync)."""

    def __init__(self, controller: EarlyStoppingController):
        self.controller = controller
        self.reason: str | None = None

    def iteration_done(self, model, iteration, epoch, loss, batch_size):
        reason = self.controller.check_iteration(float(loss))
        if reason is not None:
            self.reason = reason
            model.request_stop(reason)


class EarlyStoppingTrainer:
    """Train ``model`` on ``train`` one epoch at a time until ``config`` says stop.

        result = EarlyStoppingTrainer(config, model, train_iterator).fit()
        best = result.best_model()

    Usable again: each ``fit`` starts the conditions afresh and continues training the model.
    ``fit(verbose=...)`` shows progress as ``Model.fit`` does, out of MaxEpochs' epochs.
    """

    def __init__(self, config: EarlyStoppingConfiguration, model, train, listeners=()):
        if not isinstance(config, EarlyStoppingConfiguration):
            raise TypeError(f"EarlyStoppingTrainer needs an EarlyStoppingConfiguration, got {type(config).__name__}")
        self.config, self.model, self.train, self.listeners = config, model, train, list(listeners)

    def fit(self, verbose="auto") -> EarlyStoppingResult:
        controller = EarlyStoppingController(self.config)
        self.model.init()
        controller.start(self.model.epoch_count)
        watcher = _IterationConditions(controller)
        # Without iteration conditions nothing need read the loss each step (a wait on a GPU).
        watching = [watcher] if self.config.iteration_conditions else []
        # One console listener for all the one-epoch fits, after the listeners that score the epoch.
        listeners = [*self.listeners, *progress_listeners(verbose, self.config, self.model, self.train, self.listeners)]
        history = History()
        try:
            while True:
                history.extend(self.model.fit(self.train, epochs=1, listeners=[*watching, *listeners], verbose=0))
                if watcher.reason is not None:
                    return controller.result(ITERATION_CONDITION, watcher.reason, history)
                reason = controller.end_of_epoch(self.model, self.model.epoch_count - 1)
                if reason is not None:
                    return controller.result(EPOCH_CONDITION, reason, history)
        except (TrainingInterrupted, KeyboardInterrupt):
            raise
        except Exception as exc:  # DL4J's contract: an error ends training with a result saying so
            log.error("early stopping: training failed:\n%s", traceback.format_exc())
            return controller.result(ERROR, f"{type(exc).__name__}: {exc}", history)


def progress_listeners(verbose, config: EarlyStoppingConfiguration, model, train, listeners) -> list:
    """The console listener ``verbose`` asks for, numbering epochs out of MaxEpochs' limit."""
    limit = config.max_epochs()
    iterator = as_iterator(train, None, seed=getattr(model, "seed", 0), training=True)
    return console_listeners(verbose, None if limit is None else model.epoch_count + limit, batches_of(iterator),
                             listeners)
