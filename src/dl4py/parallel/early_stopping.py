"""EarlyStoppingParallelTrainer: early stopping while a ParallelWrapper trains.

The same controller as the single-device trainer decides: every worker asks the
iteration conditions (time, NaN) after each round and all stop in the same round if any
fires; after each epoch the coordinating process (rank 0 under torchrun) scores the
averaged model, saves the best (and latest) one and asks the epoch conditions, and every
worker follows its decision: only that process writes the saver's files. Unlike DL4J's,
the trainer can be used again: each ``fit`` reuses its wrapper's workers, which end with
``close()`` (or ``with``, or the end of the program). The best model is chosen the right
way round for maximised scores (DL4J compared with ``<``).
"""

from __future__ import annotations

import logging

from dl4py.parallel.wrapper import ParallelWrapper
from dl4py.train.early_stopping.configuration import ERROR, EarlyStoppingConfiguration, EarlyStoppingResult
from dl4py.train.early_stopping.controller import EarlyStoppingController
from dl4py.train.early_stopping.trainer import progress_listeners
from dl4py.train.loop import TrainingInterrupted

log = logging.getLogger("dl4py")
UNTIL_A_CONDITION_FIRES = 10**9  # epochs: the conditions end training, not a count


class EarlyStoppingParallelTrainer:
    """``EarlyStoppingParallelTrainer(config, model, train, workers=2, averaging_frequency=3).fit()``;
    other keyword arguments are the ParallelWrapper's (``options=``: a ParallelOptions)."""

    def __init__(self, config: EarlyStoppingConfiguration, model, train, listeners=(), **wrapper_options):
        if not isinstance(config, EarlyStoppingConfiguration):
            raise TypeError(f"EarlyStoppingParallelTrainer needs an EarlyStoppingConfiguration, got {type(config).__name__}")
        self.config, self.train, self.listeners = config, train, list(listeners)
        self.wrapper = ParallelWrapper(model, **wrapper_options)

    def fit(self, verbose="auto") -> EarlyStoppingResult:
        """Train until a condition fires; ``verbose`` as ``Model.fit``'s (this process draws)."""
        controller = EarlyStoppingController(self.config)
        model = self.wrapper.model
        listeners = [*self.listeners, *progress_listeners(verbose, self.config, model, self.train, self.listeners)]
        try:
            # verbose=0: the progress shown is the listeners' above, out of MaxEpochs' limit, not ``epochs``.
            history = self.wrapper.fit(self.train, UNTIL_A_CONDITION_FIRES, listeners, verbose=0,
                                       controller=controller)
        except (TrainingInterrupted, KeyboardInterrupt):
            raise
        except Exception as exc:
            log.error("early stopping: parallel training failed: %s", exc)
            return controller.result(ERROR, f"{type(exc).__name__}: {exc}")
        # The controller decided in this process (under torchrun: on rank 0 only).
        kind, details = self.wrapper.last_report.stop
        return controller.result(kind, details, history)

    def close(self) -> None:
        """End the wrapper's worker processes."""
        self.wrapper.close()

    def __enter__(self) -> "EarlyStoppingParallelTrainer":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False
