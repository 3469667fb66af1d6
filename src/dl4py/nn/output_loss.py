"""The output layer's loss on its pre-activation scores: its activation is fused into the
loss where that is exact and more stable (softmax + NLL, sigmoid + binary xent).

``mae`` is DL4J's LossMAE: each example's mean absolute error over its outputs, averaged over
the examples (the mean over all scores, as ``mse``). A CnnLossLayer takes the loss at every
pixel of ``[n, c, h, w]`` scores against ``[n, c, h, w]`` labels, each pixel's as an output
layer's over its ``c`` channels, and scores as DL4J's ``CnnLossLayer.computeScore``: summed
over the pixels, averaged over the examples (the mean over pixels times ``h * w``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dl4py.config.layers import OutputLayer
from dl4py.config.layers_conv import CnnLossLayer
from dl4py.nn.layer_init import ACTIVATIONS


class OutputLoss:
    """Loss of the output layer on its pre-activation scores.

    Labels are class indices ``[n]`` or target rows ``[n, k]``; indices are one-hot
    encoded where the loss needs rows (mse, xent).
    """

    def __init__(self, layer: OutputLayer):
        if layer.loss not in ("negativeloglikelihood", "mcxent", "xent", "mse", "mae"):
            # The config admits only canonical names; a loss without a branch below must
            # not quietly train as the last one (DL4J's "NEGATIVELOGLIKELIHOOD" once did).
            raise TypeError(f"OutputLoss has no rule for loss {layer.loss!r}")
        self.loss = layer.loss
        self.activation = layer.resolved_activation()
        self.n_out = layer.n_out
        self.per_pixel = isinstance(layer, CnnLossLayer)
        self._act = ACTIVATIONS[self.activation]()

    def __call__(self, scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.per_pixel:  # channels on axis 1 as the rows' classes: each loss below means over the rest
            return self._mean_loss(scores, labels) * scores[0, 0].numel()
        return self._mean_loss(scores, labels)

    def _mean_loss(self, scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.loss in ("negativeloglikelihood", "mcxent"):
            if self.activation == "softmax":
                return F.cross_entropy(scores, labels)
            probs = self._act(scores).clamp_min(1e-12)
            return -(self._rows(labels, probs) * probs.log()).sum(dim=1).mean()
        if self.loss == "xent":
            target = self._rows(labels, scores)
            if self.activation == "sigmoid":
                return F.binary_cross_entropy_with_logits(scores, target)
            probs = self._act(scores).clamp(1e-7, 1 - 1e-7)
            return F.binary_cross_entropy(probs, target)
        if self.loss == "mae":
            return F.l1_loss(self._act(scores), self._rows(labels, scores))
        assert self.loss == "mse"
        return F.mse_loss(self._act(scores), self._rows(labels, scores))

    def _rows(self, labels: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        if labels.dim() == 1:
            return F.one_hot(labels, self.n_out).to(like.dtype)
        return labels.to(like.dtype)

    def activate(self, scores: torch.Tensor) -> torch.Tensor:
        return self._act(scores)
