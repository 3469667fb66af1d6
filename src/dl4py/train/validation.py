"""Held-out data during training: the validation split, and the score after each epoch.

    model.fit(train, epochs=10, validation=(x_val, y_val))    # anything fit accepts
    model.fit(train, epochs=10, validation_split=0.1)         # taken from train, by seed

``validation_split`` takes a fraction of the training examples before any epoch's
shuffling, chosen by a seeded permutation (the data's own order may be sorted by class, so
the last rows, Keras' choice, can be one class); the rest keep their order and are shuffled
per epoch as before. After each epoch the model is scored on the held-out data: ``val_loss``
and ``val_<metric>`` for each metric asked for (default: accuracy for a classifier, the
evaluation's first metric otherwise).
"""

from __future__ import annotations

import math

import torch

from dl4py.data import ArrayDataSetIterator
from dl4py.errors import ConfigError, DataError
from dl4py.eval.select import new_evaluation
from dl4py.train.listeners import TrainingListener

SPLIT_SEED_OFFSET = 7919  # the split's permutation is not the first epoch's shuffle order


def split_validation(iterator, fraction: float, seed: int | None = None):
    """``(train, validation)`` iterators from an in-memory iterator: ``fraction`` of its
    examples held out, chosen by a permutation seeded with ``seed`` (default: the iterator's)."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise ConfigError("validation_split", f"must be a fraction between 0 and 1 (exclusive), got {fraction!r}")
    features, labels = getattr(iterator, "features", None), getattr(iterator, "labels", None)
    if not isinstance(features, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise DataError(f"validation_split needs data held in memory (arrays, a DataSetIterator over arrays); "
                        f"{type(iterator).__name__} streams its examples: pass validation= with held-out data")
    n = features.shape[0]
    held = math.ceil(n * fraction)
    if held >= n:
        raise DataError(f"validation_split={fraction} of {n} examples leaves none to train on")
    seed = getattr(iterator, "seed", 0) if seed is None else seed
    generator = torch.Generator().manual_seed(int(seed) + SPLIT_SEED_OFFSET)
    order = torch.randperm(n, generator=generator)
    held_out, kept = order[:held].sort().values, order[held:].sort().values
    batch = iterator.batch_size
    classes = iterator.num_classes() if labels.dim() == 1 else None
    train = ArrayDataSetIterator(features[kept], labels[kept], batch, shuffle=getattr(iterator, "shuffle", True),
                                 seed=getattr(iterator, "seed", 0), num_classes=classes)
    validation = ArrayDataSetIterator(features[held_out], labels[held_out], batch, shuffle=False,
                                      num_classes=classes)
    return train, validation


def validation_record(model, data, metrics=None) -> dict:
    """``{"val_loss": ..., "val_accuracy": ...}``: the model scored on ``data``."""
    evaluation, loss = model.evaluate_and_score(data)
    record = {"val_loss": loss}
    for name in metrics or default_metrics(evaluation):
        record[f"val_{name}"] = metric_value(evaluation, name)
    return record


def fit_metrics(model, metrics=None) -> tuple[str, ...]:
    """The metrics a fit records, known before its first batch: those asked for, else the
    default of the evaluation the model's loss calls for (accuracy for a classifier). The
    training accuracy is recorded when they include accuracy; validation scores each."""
    return tuple(metrics) if metrics else default_metrics(new_evaluation(model))


class EpochValidation(TrainingListener):
    """Scores the model on ``data`` at each epoch end, where a trainer's epochs end (in a
    parallel fit: the coordinator, after the epoch's average). Put it first, so that the
    listeners after it (``metrics.jsonl``) see the summary's ``validation``."""

    def __init__(self, data, metrics=None):
        self.data, self.metrics = data, metrics
        self.records: dict[int, dict] = {}

    def on_epoch_end(self, model, summary):
        summary.validation = validation_record(model, self.data, self.metrics)
        self.records[summary.epoch] = summary.validation
        model.module.train()

    def apply(self, summaries) -> list:
        """The trainer's own summaries (a parallel fit returns worker 0's) with the scores."""
        for summary in summaries:
            summary.validation = self.records.get(summary.epoch)
        return list(summaries)


def default_metrics(evaluation) -> tuple[str, ...]:
    if callable(getattr(evaluation, "accuracy", None)):
        return ("accuracy",)
    for name in ("r2", "r_squared", "mse"):
        if callable(getattr(evaluation, name, None)):
            return (name,)
    return ()


def metric_value(evaluation, name: str) -> float:
    method = getattr(evaluation, name, None)
    if name.startswith("_") or not callable(method):
        names = sorted(n for n in dir(evaluation) if not n.startswith("_") and callable(getattr(evaluation, n))
                       and n not in ("eval", "merge", "stats", "to_dict", "reset"))
        raise ConfigError("metrics", f"{name!r} is not a metric of {type(evaluation).__name__}; "
                                     f"choose from {', '.join(names)}")
    value = method()
    return float(value) if value is not None else None
