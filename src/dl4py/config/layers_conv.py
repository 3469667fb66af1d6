"""DL4J's other convolutional layers: depthwise and separable 2-D convolution, cropping (2-D
and 1-D), 1-D zero padding and the CNN loss layer (DL4J's DepthwiseConvolution2D,
SeparableConvolution2D, Cropping2D, Cropping1D, ZeroPadding1DLayer, CnnLossLayer), and the
padding of DL4J's Same convolution mode that pooling and 1-D windows use.

As in ``layers.py``: every field is checked when the layer is made, ``n_in`` is inferred from
the layer before, and a shape the layer cannot take is a ConfigError naming the layer and the
field. Modules: ``nn/layers_conv.py``; memory rules: ``memory/layer_ops_conv.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

from dl4py.config.layers import (
    Activation,
    Layer,
    Loss,
    OutputLayer,
    Pair,
    Shape,
    WeightInit,
    _check_l2,
    _check_non_negative,
    _check_positive,
    _need_cnn,
    _ParamLayer,
    _show,
    _window_output,
)
from dl4py.config.layers_extra import Padding4
from dl4py.config.recurrent import need_sequences
from dl4py.config.schema import join
from dl4py.errors import ConfigError

Padding2 = tuple[int, int]


def same_padding(size: int, span: int, stride: int) -> tuple[int, int]:
    """(before, after) padding of DL4J's Same mode along one axis of ``size``, for a window
    spanning ``span`` (``dilation * (kernel - 1) + 1``): output ``ceil(size / stride)``, total
    ``max((out - 1) * stride + span - size, 0)``, the smaller half before
    (``ConvolutionUtils.getSameModeTopLeftPadding``). ``same_padding(5, 3, 2) == (1, 1)``;
    ``same_padding(4, 3, 2) == (0, 1)``."""
    out = -(-size // stride)
    total = max((out - 1) * stride + span - size, 0)
    return total // 2, total - total // 2


def _check_window(layer, where: str) -> None:
    _check_positive(layer, where, "depth_multiplier", "kernel_size", "stride", "dilation")
    _check_non_negative(layer, where, "padding")
    _check_l2(layer, where)


def _window(layer, shape: Shape, where: str) -> tuple[int, int]:
    _need_cnn(layer, shape, where)
    return _window_output(layer, shape, where, layer.kernel_size, layer.stride, layer.padding, layer.dilation)


@Layer.register("depthwise_convolution2d")
@dataclass(frozen=True)
class DepthwiseConvolution2D(_ParamLayer):
    """DL4J's ``DepthwiseConvolution2D``: each input channel convolved on its own with
    ``depth_multiplier`` kernels (DL4J's ``depthMultiplier``), ``[c, h, w] -> [c *
    depth_multiplier, h', w']``; output channel ``i * depth_multiplier + m`` is input channel
    ``i``'s ``m``-th, DL4J's order. Pairs as ConvolutionLayer's: one number means both."""

    depth_multiplier: int = 1
    kernel_size: Pair = (5, 5)
    stride: Pair = (1, 1)
    padding: Pair = (0, 0)
    dilation: Pair = (1, 1)
    activation: Optional[Activation] = None
    weight_init: Optional[WeightInit] = None
    l2: Optional[float] = None
    has_bias: bool = True

    def validate(self, where: str) -> None:
        _check_window(self, where)

    def output_shape(self, shape: Shape, where: str) -> Shape:
        h, w = _window(self, shape, where)
        return Shape("cnn", (shape.dims[0] * self.depth_multiplier, h, w))


@Layer.register("separable_convolution2d")
@dataclass(frozen=True)
class SeparableConvolution2D(_ParamLayer):
    """DL4J's ``SeparableConvolution2D``: a depthwise convolution (as DepthwiseConvolution2D,
    without bias), then a 1x1 convolution of its ``c * depth_multiplier`` channels to
    ``n_out`` with the bias, ``[c, h, w] -> [n_out, h', w']``; the activation comes last."""

    n_out: int
    depth_multiplier: int = 1
    kernel_size: Pair = (5, 5)
    stride: Pair = (1, 1)
    padding: Pair = (0, 0)
    dilation: Pair = (1, 1)
    activation: Optional[Activation] = None
    weight_init: Optional[WeightInit] = None
    l2: Optional[float] = None
    has_bias: bool = True

    def validate(self, where: str) -> None:
        _check_positive(self, where, "n_out")
        _check_window(self, where)

    def output_shape(self, shape: Shape, where: str) -> Shape:
        h, w = _window(self, shape, where)
        return Shape("cnn", (self.n_out, h, w))


@Layer.register("cropping2d")
@dataclass(frozen=True)
class Cropping2D(Layer):
    """DL4J's ``Cropping2D``: rows and columns off an image's edges, ``cropping`` = (top,
    bottom, left, right). One number crops all four sides; a pair (height, width) crops top
    and bottom by the first, left and right by the second (as ZeroPaddingLayer). Stored as four."""

    cropping: Padding4

    def __post_init__(self) -> None:
        object.__setattr__(self, "cropping", _four(self.cropping))
        super().__post_init__()

    def validate(self, where: str) -> None:
        _check_non_negative(self, where, "cropping")

    def output_shape(self, shape: Shape, where: str) -> Shape:
        _need_cnn(self, shape, where)
        top, bottom, left, right = self.cropping
        c, h, w = shape.dims
        if top + bottom >= h or left + right >= w:
            raise ConfigError(
                join(where, "cropping"),
                f"{_show(self.cropping)} (top, bottom, left, right) crops away the whole input of "
                f"{h}x{w} [height x width]; input shape is {shape} [channels x height x width]",
            )
        return Shape("cnn", (c, h - top - bottom, w - left - right))


def _four(value):
    """A pair (height, width) as (top, bottom, left, right); anything else as given (one number
    the schema repeats; a wrong length the schema names)."""
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return (value[0], value[0], value[1], value[1])
    return value


@Layer.register("cropping1d")
@dataclass(frozen=True)
class Cropping1D(Layer):
    """DL4J's ``Cropping1D``: steps off a sequence's start and end, ``cropping`` = (start,
    end); one number crops both. ``[time, size] -> [time - start - end, size]``."""

    takes_sequences: ClassVar[bool] = True
    cropping: Padding2

    def validate(self, where: str) -> None:
        _check_non_negative(self, where, "cropping")

    def output_shape(self, shape: Shape, where: str) -> Shape:
        need_sequences(self, shape, where)
        time, size = shape.dims
        start, end = self.cropping
        if time is not None and start + end >= time:
            raise ConfigError(
                join(where, "cropping"),
                f"{_show(self.cropping)} (start, end) crops away the whole sequence of {time} steps; "
                f"input shape is {shape} [time x size]",
            )
        return Shape("rnn", (None if time is None else time - start - end, size))


@Layer.register("zero_padding1d")
@dataclass(frozen=True)
class ZeroPadding1DLayer(Layer):
    """DL4J's ``ZeroPadding1DLayer``: zero steps before and after a sequence, ``padding`` =
    (start, end); one number pads both. ``[time, size] -> [time + start + end, size]``."""

    takes_sequences: ClassVar[bool] = True
    padding: Padding2

    def validate(self, where: str) -> None:
        _check_non_negative(self, where, "padding")

    def output_shape(self, shape: Shape, where: str) -> Shape:
        need_sequences(self, shape, where)
        time, size = shape.dims
        return Shape("rnn", (None if time is None else time + sum(self.padding), size))


@Layer.register("cnn_loss")
@dataclass(frozen=True)
class CnnLossLayer(OutputLayer):
    """DL4J's ``CnnLossLayer``: no parameters; ``activation`` (default identity; softmax is
    over the channels) and ``loss`` (default mcxent, DL4J's) at every pixel of ``[c, h, w]``.
    Labels are ``[n, c, h, w]``, the output's shape. The score is DL4J's: the loss summed
    over the pixels (each pixel's as the output layer's over its channels), averaged over the
    examples. The network's last layer, as an output layer is.

    The dense output layer's fields (``n_out``, ``weight_init``, ``l2``, ``has_bias``) are no
    fields of this one: not in its YAML, not in its constructor (n_out is None: the channels
    come from the layer before)."""

    has_params: ClassVar[bool] = False
    loss: Loss = "mcxent"
    n_out: Optional[int] = field(default=None, init=False, repr=False)
    weight_init: Optional[WeightInit] = field(default=None, init=False, repr=False)
    l2: Optional[float] = field(default=None, init=False, repr=False)
    has_bias: bool = field(default=False, init=False, repr=False)
    gradient_normalization: None = field(default=None, init=False, repr=False)
    gradient_normalization_threshold: None = field(default=None, init=False, repr=False)

    def validate(self, where: str) -> None:
        pass  # nothing of the dense layer's to check

    def to_dict(self) -> dict:
        return Layer.to_dict(self)  # _ParamLayer's moves fields this layer does not have

    def resolved_activation(self) -> str:
        return self.activation or "identity"

    def output_shape(self, shape: Shape, where: str) -> Shape:
        _need_cnn(self, shape, where)
        return shape
