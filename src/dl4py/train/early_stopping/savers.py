"""What keeps the best (and latest) model: the contract of ``EarlyStoppingConfiguration.model_saver``.

DL4J's two savers, ``InMemoryModelSaver`` and ``LocalFileModelSaver``, write and read model
files, so they live in ``dl4py.nn.savers``, above this floor; ``dl4py.train.early_stopping``
still names them.
"""

from __future__ import annotations


class EarlyStoppingModelSaver:
    """DL4J's interface of this name: keeps the best and the latest model as training goes,
    and gives them back (None when none was kept). Any object with these methods will do."""

    def save_best(self, model, score: float) -> None:
        raise NotImplementedError

    def save_latest(self, model, score: float) -> None:
        raise NotImplementedError

    def get_best_model(self, into=None, backend=None):
        raise NotImplementedError

    def get_latest_model(self, into=None, backend=None):
        raise NotImplementedError
