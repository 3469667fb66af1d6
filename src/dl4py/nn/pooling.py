"""Average pooling whose CUDA gradient is right whatever the input's memory format.

PyTorch's CUDA backward of ``avg_pool2d`` for a channels-last input (NHWC) leaves the
padding out of each input pixel's coordinates, so with ``padding > 0`` it returns wrong
input gradients, silently (pytorch/pytorch#188344; the forward is right, and so is the
NCHW kernel). dl4py meets that kernel twice: a convolutional network on CUDA runs
channels-last by default (``nn/memory_format.py``), and ``avg_pool1d`` is ``avg_pool2d``
over a height of 1, whose input (a ``[batch, time, size]`` sequence transposed to
``[batch, size, time]``) PyTorch takes for channels-last. The GPU check found it: a
padded 1-D average pooling's input gradient on an H200 missed finite differences by 0.03.

These modules give the CUDA kernel a contiguous (NCHW) input where it has padding: one
copy of the layer's input, only on CUDA and only with padding. Elsewhere they are
``nn.AvgPool1d``/``nn.AvgPool2d`` unchanged (the same ``isinstance`` answers; pooling has no
parameters, so files do not change).
"""

from __future__ import annotations

import torch
from torch import nn


def _kernel_safe(x: torch.Tensor, padding) -> torch.Tensor:
    padded = any(padding) if isinstance(padding, tuple) else bool(padding)
    return x.contiguous() if padded and x.is_cuda else x


class AvgPool1d(nn.AvgPool1d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(_kernel_safe(x, self.padding))


class AvgPool2d(nn.AvgPool2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(_kernel_safe(x, self.padding))
