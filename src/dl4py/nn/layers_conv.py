"""Modules of the layers in ``config/layers_conv.py``, and DL4J's Same convolution mode for
pooling and 1-D windows.

Depthwise and separable convolutions are ``nn/convolution.py``'s ``Conv2d`` with
``groups=channels`` (its 16-bit handling included). torch's grouped convolution puts input
channel ``i``'s ``depth_multiplier`` outputs side by side (output ``i * dm + m``), as DL4J's
``depthwise_conv2d`` does; DL4J's depthwise weight ``[kH, kW, c, dm]`` is the module's
``weight`` ``[c * dm, 1, kH, kW]`` as ``W.permute(2, 3, 0, 1).reshape(c * dm, 1, kH, kW)``.

Same mode pads at run time, from the input's own size (a sequence's varies): the smaller
half before (``config/layers_conv.py``'s ``same_padding``). Max pooling pads with minus
infinity; average pooling divides each window by the real elements in it (DL4J's default,
``avgPoolIncludePadInDivisor`` false); a convolution pads with zeros. Layers that change a
sequence's length (cropping, 1-D zero padding) refuse masked batches with a DataError naming
the layer, as ``nn/layers_extra.py``'s windows do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dl4py.config.layers_conv import same_padding
from dl4py.config.registry import LAYERS
from dl4py.errors import DataError
from dl4py.nn.convolution import Conv1d, Conv2d
from dl4py.nn.layer_init import ACTIVATIONS, init_weight
from dl4py.nn.recurrent import SequenceMask


def _same_pads(sizes, kernel, stride, dilation=None) -> list[int]:
    """``F.pad``'s list (last axis first) of Same mode's padding for the trailing ``sizes``."""
    pads = []
    for axis in reversed(range(len(sizes))):
        span = (1 if dilation is None else dilation[axis]) * (kernel[axis] - 1) + 1
        pads += same_padding(sizes[axis], span, stride[axis])
    return pads


class SamePool2d(nn.Module):
    """Max or average pooling in DL4J's Same mode over ``[n, c, h, w]``."""

    def __init__(self, pooling_type: str, kernel_size, stride):
        super().__init__()
        self.pooling_type = pooling_type
        self.kernel_size, self.stride = tuple(kernel_size), tuple(stride)

    def forward(self, x):
        pads = _same_pads(x.shape[2:], self.kernel_size, self.stride)
        return _same_pool(x, pads, self.pooling_type, F.max_pool2d, F.avg_pool2d, self.kernel_size, self.stride)

    def extra_repr(self) -> str:
        return f"{self.pooling_type}, kernel_size={self.kernel_size}, stride={self.stride}, mode=same"


class SamePool1d(nn.Module):
    """Max or average pooling in DL4J's Same mode over ``[n, size, time]`` (inside a
    ``_SequenceWindow``). The average counts real steps only: steps the batch's mask marks
    as padding are no more real than Same mode's own padding."""

    def __init__(self, pooling_type: str, kernel_size: int, stride: int, masks: SequenceMask):
        super().__init__()
        self.pooling_type = pooling_type
        self.kernel_size, self.stride = (kernel_size,), (stride,)
        self.masks = masks

    def forward(self, x):
        pads = _same_pads(x.shape[2:], self.kernel_size, self.stride)
        mask = self.masks.current
        if self.pooling_type == "max" or mask is None:
            return _same_pool(x, pads, self.pooling_type, F.max_pool1d, F.avg_pool1d, self.kernel_size, self.stride)
        # The window's share of real steps, per sequence; at least one step's worth, so that
        # a window over padded steps only (whose output the window zeroes) divides by no zero.
        real = F.avg_pool1d(F.pad(mask.to(x.dtype).unsqueeze(1), pads), self.kernel_size, self.stride)
        share = real.clamp_min(1.0 / self.kernel_size[0])
        return F.avg_pool1d(F.pad(x, pads), self.kernel_size, self.stride).div_(share)

    def extra_repr(self) -> str:
        return f"{self.pooling_type}, kernel_size={self.kernel_size[0]}, stride={self.stride[0]}, mode=same"


def _same_pool(x, pads, pooling_type, max_pool, avg_pool, kernel, stride):
    if not any(pads):  # the windows fit: plain pooling, no copy
        pool = max_pool if pooling_type == "max" else avg_pool
        return pool(x, kernel, stride)
    if pooling_type == "max":
        return max_pool(F.pad(x, pads, value=float("-inf")), kernel, stride)
    # The padding's zeros add nothing to a window's sum; the divisor is its real elements:
    # the average of a padded window of ones is their share of the window. Divided in place
    # (pooling's backward does not read its result): no second tensor of the output's size.
    with torch.no_grad():
        ones = torch.ones((1, 1) + tuple(x.shape[2:]), dtype=x.dtype, device=x.device)
        share = avg_pool(F.pad(ones, pads), kernel, stride)
    return avg_pool(F.pad(x, pads), kernel, stride).div_(share)


class SameConv1d(Conv1d):
    """``Conv1d`` (without padding of its own) in DL4J's Same mode: zeros before and after
    the time axis as Same mode's padding takes, from each batch's length."""

    def forward(self, x):
        pads = _same_pads(x.shape[2:], self.kernel_size, self.stride, self.dilation)
        return super().forward(F.pad(x, pads) if any(pads) else x)


def _copy(view: torch.Tensor) -> torch.Tensor:
    # A cropped copy, not a view: the layer after reads it contiguous (a convolution would
    # copy a view itself), and the memory estimate counts it as zero padding's result.
    return view.clone(memory_format=torch.contiguous_format)


class Crop2d(nn.Module):
    """Rows and columns off the edges of ``[n, c, h, w]``."""

    def __init__(self, top: int, bottom: int, left: int, right: int):
        super().__init__()
        self.top, self.bottom, self.left, self.right = top, bottom, left, right

    def forward(self, x):
        h, w = x.shape[2:]
        return _copy(x[:, :, self.top : h - self.bottom, self.left : w - self.right])

    def extra_repr(self) -> str:
        return f"top={self.top}, bottom={self.bottom}, left={self.left}, right={self.right}"


class SeparableConv2d(nn.Module):
    """DL4J's separable convolution: ``depthwise`` (a grouped convolution, no bias) then
    ``pointwise`` (1x1, with the bias). Keys ``depthwise.weight`` ``[c * dm, 1, kH, kW]``,
    ``pointwise.weight`` ``[n_out, c * dm, 1, 1]``, ``pointwise.bias``."""

    def __init__(self, depthwise: nn.Conv2d, pointwise: nn.Conv2d):
        super().__init__()
        self.depthwise, self.pointwise = depthwise, pointwise

    def forward(self, x):
        return self.pointwise(self.depthwise(x))


class SequenceEdges(nn.Module):
    """Cropping (negative ``start`` and ``end``) or zero padding (positive) of the time axis of
    ``[n, time, size]``; a masked batch is refused, its mask would not fit the result."""

    def __init__(self, start: int, end: int, masks: SequenceMask, where: str):
        super().__init__()
        self.start, self.end = start, end
        self.masks, self.where = masks, where

    def forward(self, x):
        if self.masks.current is not None:
            raise DataError(
                f"{self.where}: this layer changes the sequence length ({self.start:+d} steps at the "
                f"start, {self.end:+d} at the end), so the batch's mask would not fit the layers after "
                "it; give batches of equal-length sequences without a mask"
            )
        if x.shape[1] + self.start + self.end <= 0:  # a length the config could not check
            raise DataError(f"{self.where}: cropping {-self.start} + {-self.end} steps leaves nothing of "
                            f"sequences of {x.shape[1]} steps")
        if self.start <= 0 and self.end <= 0:
            return _copy(x[:, -self.start : x.shape[1] + self.end])
        return F.pad(x, (0, 0, self.start, self.end))

    def extra_repr(self) -> str:
        return f"start={self.start:+d}, end={self.end:+d}"


def _depthwise(channels: int, layer, bias: bool, gen, scheme: str) -> Conv2d:
    dm = layer.depth_multiplier
    conv = Conv2d(channels, channels * dm, layer.kernel_size, layer.stride, layer.padding, layer.dilation,
                  groups=channels, bias=bias)
    # Seen as DL4J's [dm, c, kH, kW]: its fans (c*kH*kW in, dm*kH*kW out), not torch's of a
    # one-channel kernel; the draws are the same in number.
    kh, kw = layer.kernel_size
    init_weight(conv.weight.view(channels, dm, kh, kw).transpose(0, 1), scheme, gen)
    if conv.bias is not None:
        nn.init.zeros_(conv.bias)
    return conv


# Builders (config/registry.py): (layer, shape, config, generator, masks, where) -> (op, activation or None).


@LAYERS.builder("depthwise_convolution2d")
def _depthwise_convolution2d(layer, shape, config, gen, masks: SequenceMask, where: str):
    conv = _depthwise(shape.dims[0], layer, layer.has_bias, gen, layer.weight_init or config.weight_init)
    return conv, ACTIVATIONS[layer.activation or config.activation]()


@LAYERS.builder("separable_convolution2d")
def _separable_convolution2d(layer, shape, config, gen, masks: SequenceMask, where: str):
    scheme = layer.weight_init or config.weight_init
    channels = shape.dims[0] * layer.depth_multiplier
    depthwise = _depthwise(shape.dims[0], layer, False, gen, scheme)
    pointwise = Conv2d(channels, layer.n_out, 1, bias=layer.has_bias)
    init_weight(pointwise.weight, scheme, gen)
    if pointwise.bias is not None:
        nn.init.zeros_(pointwise.bias)
    return SeparableConv2d(depthwise, pointwise), ACTIVATIONS[layer.activation or config.activation]()


@LAYERS.builder("cropping2d")
def _cropping2d(layer, shape, config, gen, masks: SequenceMask, where: str):
    return Crop2d(*layer.cropping), None


@LAYERS.builder("cropping1d")
def _cropping1d(layer, shape, config, gen, masks: SequenceMask, where: str):
    start, end = layer.cropping
    return SequenceEdges(-start, -end, masks, where), None


@LAYERS.builder("zero_padding1d")
def _zero_padding1d(layer, shape, config, gen, masks: SequenceMask, where: str):
    start, end = layer.padding
    return SequenceEdges(start, end, masks, where), None


@LAYERS.builder("cnn_loss")
def _cnn_loss(layer, shape, config, gen, masks: SequenceMask, where: str):
    return nn.Identity(), None  # its activation is the loss's (OutputLoss), as the output layer's


__all__ = ["Crop2d", "SameConv1d", "SamePool1d", "SamePool2d", "SeparableConv2d", "SequenceEdges"]
