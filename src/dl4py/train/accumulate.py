"""Gradient accumulation: the gradients of ``k`` consecutive batches make one update.

``training.accumulate_batches: k`` (``Model.fit(..., accumulate_batches=k)``): each batch's
forward and backward add its gradient to what the window holds; the ``k``-th applies the
update, as one step on the union of the ``k`` batches would. Each batch's mean loss is
weighted by its share of the window's examples (``n / (k * b)``, ``b`` the window's first
batch size: ``1/k`` for equal batches), so the gradient is the mean over all the examples.
A window cut short (the end of an epoch, a stop) is rescaled to the mean over the examples
it did see before its update: the last update of an epoch uses what was accumulated.

Everything else of the step runs once per window, on the summed gradient: a parallel
trainer's gradient sharing, the loss scaler's unscale / step / update (an overflow in any
batch of the window skips the whole update), gradient normalization, the scheduled
learning rate. ``update_count`` counts the updates, ``iteration_count`` the batches.
"""

from __future__ import annotations

from typing import Callable

import torch

# Model.fit checks its accumulate_batches by the run config's rule (accumulate.checked_batches).
from dl4py.config.run import checked_batches  # noqa: F401


class AccumulatingStep:
    """``step(features, labels)``, updating every ``batches``-th call; made by ``train.step.make_train_step``.

    ``backward(features, labels, weight, observe)`` adds a batch's weighted gradient to the
    stepped parameters' ``.grad``, shows ``observe`` (when given) the batch's outputs, and
    returns its (unweighted) loss; ``update(took_part)`` applies
    the gradients held there. ``step(None, None)`` is a round without a batch of a parallel
    worker: it counts towards the window (every worker updates in the same round, as the
    gradient sharing's collective needs) and adds nothing.
    """

    def __init__(self, batches: int, backward: Callable, update: Callable, clear: Callable, gradients: Callable):
        self.batches = batches
        self._backward, self._update, self._clear, self._gradients = backward, update, clear, gradients
        self.pending = 0  # rounds in the open window (0: the last one was applied)
        self._examples = 0
        self._first = 0  # the window's first batch size: the weights' denominator is batches * first
        self._took_part = False  # a batch was given in the window (a hybrid rank's may have no rows)

    def __call__(self, features: torch.Tensor | None, labels: torch.Tensor | None,
                 observe=None) -> torch.Tensor | None:
        if self.pending == 0:
            self._clear()  # a new window: the last update's gradients go
        loss = None
        if features is not None:
            size = int(features.shape[0])
            self._first = self._first or size
            # A window of one batch needs no weight: its gradient is the batch's own, untouched.
            weight = size / (self.batches * self._first) if self.batches > 1 else None
            loss = self._backward(features, labels, weight, observe)
            self._examples += size
            self._took_part = True
        self.pending += 1
        if self.pending == self.batches:
            self._apply()
        return loss

    def flush(self) -> bool:
        """Apply a window cut short (the end of an epoch); True if there was one."""
        if self.pending == 0:
            return False
        self._apply()
        return True

    def discard(self) -> None:
        """Forget the open window (a fit that failed part-way): the next batch starts a new one."""
        self.pending = self._examples = self._first = 0
        self._took_part = False

    def _apply(self) -> None:
        expected, seen = self.batches * self._first, self._examples
        if seen and seen != expected:  # weights summed to seen / expected: back to a mean over `seen`
            with torch.no_grad():
                grads = [g for g in self._gradients() if g is not None]
                # One foreach call per kind: a tensor-parallel model's split weights have
                # DTensor gradients, which torch will not scale in one call with plain ones.
                for kind in {type(g) for g in grads}:
                    torch._foreach_mul_([g for g in grads if type(g) is kind], expected / seen)
        took_part = self._took_part
        self.discard()
        self._update(took_part)


def finish(model) -> bool:
    """Apply ``model``'s open window, if any (the end of an epoch, a stop); True if it did."""
    step = getattr(model, "_train_step", None)
    return isinstance(step, AccumulatingStep) and step.flush()


def discard(model) -> None:
    """Drop ``model``'s open window: its parameters stay those of the last update."""
    step = getattr(model, "_train_step", None)
    if isinstance(step, AccumulatingStep):
        step.discard()


def pending(model) -> int:
    """Batches (rounds) in ``model``'s open window: 0 right after an update."""
    step = getattr(model, "_train_step", None)
    return step.pending if isinstance(step, AccumulatingStep) else 0
