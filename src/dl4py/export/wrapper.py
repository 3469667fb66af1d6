"""The network as other runtimes should see it: raw features in, predictions out.

``InferenceModule`` holds a float32 CPU copy of a model's network in eval mode with, before
it, the model's normalizer (its statistics as buffers) and, after it, the output layer's
activation (softmax for a classifier), so an exported file answers what ``model.output``
answers, given the same raw features. The model itself is left as it was.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from dl4py.errors import DataError


class InferenceModule(nn.Module):
    """``forward(x)``: ``x`` raw features ``[n, *example_shape]`` (float32) -> ``model.output(x)``.

    >>> module = InferenceModule(model)            # doctest: +SKIP
    >>> module(torch.randn(4, 784)).shape          # doctest: +SKIP
    torch.Size([4, 10])
    """

    def __init__(self, model):
        super().__init__()
        model.init()
        model.set_mask(None)  # a training batch's sequence mask must not be copied along
        # A copy, so that exporting neither moves nor casts the model being trained or served.
        self.network = copy.deepcopy(model.module).to(device="cpu", dtype=torch.float32).eval()
        self._activate = model.activate  # stateless functions of the output layers
        self.example_shape = example_shape(model)
        normalizer = model.normalizer
        self.normalized = normalizer is not None
        if self.normalized:
            # transform(x) = (x - center) / divisor + offset, shaped to broadcast over one batch.
            probe = torch.zeros((1, *self.example_shape), dtype=torch.float32)
            center, divisor, offset = (t.detach().clone() for t in normalizer._affine(probe))
            self.register_buffer("center", center)
            self.register_buffer("divisor", divisor)
            self.register_buffer("offset", offset)
        self.train(False)

    def train(self, mode: bool = True):
        # Always inference: batch normalization on running statistics, dropout off.
        return super().train(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.float32)
        if self.normalized:
            x = (x - self.center) / self.divisor + self.offset
        return self._activate(self.network(x)).to(torch.float32)

    def example(self, batch: int = 2) -> torch.Tensor:
        """A batch of zeros of the input's shape, to trace or export with."""
        return torch.zeros((batch, *self.example_shape), dtype=torch.float32)


def example_shape(model) -> tuple[int, ...]:
    """One example's shape as the data carries it (several graph inputs: one packed row)."""
    shape = model.signature().input_shape
    if shape is None:
        raise DataError(f"a {type(model).__name__} has no config to read its input shape from; "
                        "export works on a MultiLayerNetwork or a ComputationGraph")
    if None in shape:
        raise DataError("the network takes sequences of any length; exporting and dl4py predict need "
                        "a fixed input shape (give the recurrent input its length)")
    return shape
