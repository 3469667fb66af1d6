"""Training accuracy: History's ``accuracy``, beside ``val_accuracy``, as Keras shows it.

Counted from the outputs each training step computed anyway (``Model.train_step(...,
observe=)``): no second forward pass. Like Keras' ``accuracy``, it is the share of the
epoch's training examples the model classified right as it met them (during the epoch,
with dropout on, before each batch's update), not a score of the epoch's final weights.

It counts what validation's ``Evaluation`` counts: outputs ``[n, k]`` with ``k >= 2``
columns (the highest is the prediction) against class indices ``[n]`` or rows ``[n, k]``
(one-hot: their highest is the class), for a model that ``evaluate`` calls a classifier.
Other outputs (one column, sequences, a regressor's values, a graph's several outputs)
record no training accuracy. Only class indices are computed from the outputs, so nothing
here enters the autograd graph.
"""

from __future__ import annotations

import torch

from dl4py.eval.evaluation import Evaluation
from dl4py.eval.select import new_evaluation

# Batches whose hits are held before one sum adds them to the count: two small operations
# a step instead of four (the step of a small network is a few hundred microseconds), in
# memory bounded by this many batches' booleans.
FOLD_EVERY = 256


class RunningAccuracy:
    """Correct examples over examples of one epoch's training batches on one model.
    Nothing here reads the device: the count stays there until ``value()``."""

    def __init__(self, model):
        self.model = model
        self.correct = torch.zeros((), dtype=torch.int64, device=model.backend.device)
        self.hits: list[torch.Tensor] = []  # per batch, whether each example was classified right
        self.examples = 0
        self.applies: bool | None = None  # decided at the first batch, from its outputs and labels

    def observe(self, outputs, labels: torch.Tensor) -> None:
        """One batch's outputs and labels, as the step had them."""
        if self.applies is None:
            self.applies = _counts_classes(self.model, outputs, labels)
        if not self.applies:
            return
        actual = labels if labels.dim() == 1 else labels.argmax(dim=1)
        self.hits.append(outputs.argmax(dim=1) == actual)
        self.examples += outputs.shape[0]
        if len(self.hits) == FOLD_EVERY:
            self._fold()

    def value(self) -> float | None:
        """The epoch's training accuracy so far; None where it does not apply or saw no batch."""
        right, judged = self.counts()
        return right / judged if judged else None

    def counts(self) -> tuple[int, int]:
        """(examples classified right, examples judged) so far: (0, 0) where it does not apply.
        Workers of a parallel fit add theirs up."""
        if not self.applies or not self.examples:
            return 0, 0
        self._fold()
        return int(self.correct), self.examples

    def _fold(self) -> None:
        if self.hits:
            self.correct += torch.cat(self.hits).sum()
            self.hits.clear()


def _counts_classes(model, outputs, labels: torch.Tensor) -> bool:
    if not isinstance(outputs, torch.Tensor) or outputs.dim() != 2 or outputs.shape[1] < 2:
        return False
    if labels.dim() == 1:
        class_indices = not (labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool)
    else:
        class_indices = labels.dim() == 2 and labels.shape[1] == outputs.shape[1]
    return class_indices and isinstance(new_evaluation(model, labels), Evaluation)
