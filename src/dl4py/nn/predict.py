"""``Model.predict`` and ``predict_proba``: ``output`` as numpy, classes for a classifier;
and ``InferenceState``, what a model's inference passes keep between calls.

A model is a regressor when its output's loss is a regression loss (mse, l1, ...: the
same test ``evaluate`` uses to choose ``RegressionEvaluation``), as ``model.signature()``
tells per output; else a classifier, whose prediction is the class with the highest output,
or for a one-column output (a sigmoid's probability of class 1) whether it reaches 0.5. A
graph with several outputs gives a list, one array per output, each judged by its own loss.
"""

from __future__ import annotations

from operator import attrgetter

import numpy as np
import torch

from dl4py.data.adapters import as_iterator

# As Model.output: at most this many examples in one forward pass.
CHUNK = 4096
# Kinds of input (dtype, shape past the first axis) an InferenceState remembers as checked;
# sequences of many lengths start the set over rather than grow it without end.
CHECKED_KINDS = 64
_TRAINING = attrgetter("training")


class InferenceState:
    """What a model's inference passes (``output``, ``predict``, ``score``, ``evaluate``) keep
    between calls, for one built module under one precision policy: the module's parts, and
    the kinds of input already checked. ``Model`` makes a new one when the module or the
    policy is another object (``fits``).

    It does not see a part put into the module after it was made (``module[2] = nn.Dropout()``):
    replacing parts of a built network's module is outside dl4py's API."""

    def __init__(self, module: torch.nn.Module, precision):
        self.module, self.precision = module, precision
        self.parts = tuple(module.modules())
        self.checked: set = set()
        # The policy decides once whether a forward needs its context (autocast) at all.
        self.autocast = precision.autocast_dtype is not None

    def fits(self, module: torch.nn.Module, precision) -> bool:
        return self.module is module and self.precision is precision

    def enter_eval(self) -> bool:
        """Put the module in eval mode unless every part of it already is; True when it switched.
        One flag read per part rather than ``eval()``'s recursive walk (with ``train()`` after
        it, a quarter of a one-image ``output``): a user may have switched the module, or one
        layer of it, to training since the last pass, and dropout or batch statistics must
        not reach an inference output."""
        if any(map(_TRAINING, self.parts)):
            self.module.eval()
            return True
        return False

    def check(self, model, features: torch.Tensor, where: str) -> None:
        """``model.check_features`` once per kind of input: the checks read the dtype and the
        shape past the first axis, so a later input of the same kind passes them too."""
        kind = (features.dtype, features.shape[1:])
        if kind in self.checked:
            return
        model.check_features(features, where)  # raises: a refused kind is never remembered
        if len(self.checked) >= CHECKED_KINDS:
            self.checked.clear()
        self.checked.add(kind)


def probabilities(model, data, batch_size: int | None, label=None):
    """``model.output(data)`` as numpy (a list of arrays for several outputs)."""
    outputs = model.output(_features(model, data, batch_size, label), batch_size or CHUNK)
    if isinstance(outputs, (list, tuple)):
        return [_numpy(o) for o in outputs]
    return _numpy(outputs)


def predictions(model, data, batch_size: int | None, label=None):
    """Class indices (int64, one per example, or per step of a sequence) for a classifier's
    output, the output values for a regressor's."""
    outputs = probabilities(model, data, batch_size, label)
    signature = model.signature()
    if isinstance(outputs, list):
        return [_decide(o, output.classifier) for o, output in zip(outputs, signature.outputs)]
    return _decide(outputs, signature.classifier)


def _features(model, data, batch_size: int | None, label):
    """Arrays (and a graph's list of arrays) as they are; other data's features, read in its
    own batches unless ``batch_size`` is given (an iterator or a DataLoader takes none)."""
    several_inputs = model.signature().several_inputs
    if isinstance(data, (torch.Tensor, np.ndarray)) or (several_inputs and isinstance(data, list)):
        return data
    batches = [b.features for b in as_iterator(data, batch_size, label=label, labelled=False)]
    return torch.cat(batches) if batches else torch.empty(0)


def _decide(values: np.ndarray, classifier: bool) -> np.ndarray:
    if not classifier:
        return values
    if values.ndim == 1 or values.shape[-1] == 1:  # one column: the probability of class 1
        return (values.reshape(values.shape[:-1] if values.ndim > 1 else values.shape) >= 0.5).astype(np.int64)
    return values.argmax(axis=-1).astype(np.int64)


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16
        tensor = tensor.float()
    return tensor.numpy()
