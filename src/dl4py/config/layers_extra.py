"""More layer configurations: 1-D convolution and pooling over sequences, upsampling,
transposed convolution, zero padding, layer normalization and self-attention (DL4J's
Convolution1DLayer, Subsampling1DLayer, Upsampling2D, Deconvolution2D, ZeroPaddingLayer,
LayerNormalization, SelfAttentionLayer).

As in ``layers.py``: every field is checked when the layer is made, ``n_in`` is inferred
from the layer before, and a shape the layer cannot take is a ConfigError naming the layer
and the field. Sequences are ``[time, size]`` (batch first, ``config/recurrent.py``);
windows follow DL4J's "truncate" convolution mode, or its "same" (``convolution_mode``).
Modules: ``nn/layers_extra.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, Optional

from dl4py.config.layers import (
    Activation,
    ConvolutionMode,
    Layer,
    Pair,
    Shape,
    WeightInit,
    _check_l2,
    _check_non_negative,
    _check_positive,
    _check_same_mode,
    _need_cnn,
    _ParamLayer,
    _show,
    same_size,
)
from dl4py.config.recurrent import need_sequences
from dl4py.config.schema import join
from dl4py.errors import ConfigError

Padding4 = tuple[int, int, int, int]


def _window_1d(shape: Shape, where: str, kernel: int, stride: int, padding: int, dilation: int) -> int | None:
    """Output length of a 1-D window over ``shape``'s time axis (None stays None: any length)."""
    time = shape.dims[0]
    if time is None:
        return None
    span = dilation * (kernel - 1) + 1
    if span > time + 2 * padding:
        raise ConfigError(
            join(where, "kernel_size"),
            f"kernel {kernel} (dilation {dilation}) spans {span} steps but the sequence length is "
            f"{time} (+{2 * padding} padding); input shape is {shape} [time x size]",
        )
    return (time + 2 * padding - span) // stride + 1


@Layer.register("convolution1d")
@dataclass(frozen=True)
class Convolution1DLayer(_ParamLayer):
    """DL4J's ``Convolution1DLayer``: a convolution along the time axis of a sequence,
    ``[time, size] -> [time', n_out]``. ``kernel_size``, ``stride``, ``padding`` and
    ``dilation`` are single numbers (steps). ``convolution_mode`` "same": ceil(time / stride)
    steps, zero-padded as DL4J's Same mode (``config/layers_conv.py``'s ``same_padding``)."""

    takes_sequences: ClassVar[bool] = True
    n_out: int
    kernel_size: int = 3
    stride: int = 1
    padding: int = 0
    dilation: int = 1
    activation: Optional[Activation] = None
    weight_init: Optional[WeightInit] = None
    l2: Optional[float] = None
    has_bias: bool = True
    convolution_mode: ConvolutionMode = "truncate"

    def validate(self, where: str) -> None:
        _check_positive(self, where, "n_out", "kernel_size", "stride", "dilation")
        _check_non_negative(self, where, "padding")
        _check_same_mode(self, where)
        _check_l2(self, where)

    def output_shape(self, shape: Shape, where: str) -> Shape:
        need_sequences(self, shape, where)
        if self.convolution_mode == "same":
            return Shape("rnn", (same_size(shape.dims[0], self.stride), self.n_out))
        time = _window_1d(shape, where, self.kernel_size, self.stride, self.padding, self.dilation)
        return Shape("rnn", (time, self.n_out))


@Layer.register("subsampling1d")
@dataclass(frozen=True)
class Subsampling1DLayer(Layer):
    """DL4J's ``Subsampling1DLayer``: max or average pooling along the time axis,
    ``[time, size] -> [time', size]``. ``convolution_mode`` "same" as SubsamplingLayer's:
    ceil(time / stride) steps; padding never wins a maximum, an average counts real steps."""

    takes_sequences: ClassVar[bool] = True
    pooling_type: Literal["max", "avg"] = "max"
    kernel_size: int = 2
    stride: int = 2
    padding: int = 0
    convolution_mode: ConvolutionMode = "truncate"

    def validate(self, where: str) -> None:
        _check_positive(self, where, "kernel_size", "stride")
        _check_non_negative(self, where, "padding")
        _check_same_mode(self, where)
        if 2 * self.padding > self.kernel_size:
            raise ConfigError(
                join(where, "padding"),
                f"must be at most half the kernel size {self.kernel_size}, got {self.padding}",
            )

    def output_shape(self, shape: Shape, where: str) -> Shape:
        need_sequences(self, shape, where)
        if self.convolution_mode == "same":
            return Shape("rnn", (same_size(shape.dims[0], self.stride), shape.dims[1]))
        time = _window_1d(shape, where, self.kernel_size, self.stride, self.padding, 1)
        return Shape("rnn", (time, shape.dims[1]))


@Layer.register("upsampling2d")
@dataclass(frozen=True)
class Upsampling2D(Layer):
    """DL4J's ``Upsampling2D``: repeats each pixel ``size`` = (rows, columns) times,
    ``[c, h, w] -> [c, h*size[0], w*size[1]]`` (nearest neighbour)."""

    size: Pair = (2, 2)

    def validate(self, where: str) -> None:
        _check_positive(self, where, "size")

    def output_shape(self, shape: Shape, where: str) -> Shape:
        _need_cnn(self, shape, where)
        c, h, w = shape.dims
        return Shape("cnn", (c, h * self.size[0], w * self.size[1]))


@Layer.register("deconvolution2d")
@dataclass(frozen=True)
class Deconvolution2D(_ParamLayer):
    """DL4J's ``Deconvolution2D``: a transposed 2-D convolution. Output size per axis is
    DL4J's for its truncate mode, ``(in - 1) * stride + dilation * (kernel - 1) + 1 -
    2 * padding`` (with dilation 1: ``(in - 1) * stride + kernel - 2 * padding``)."""

    n_out: int
    kernel_size: Pair = (5, 5)
    stride: Pair = (1, 1)
    padding: Pair = (0, 0)
    dilation: Pair = (1, 1)
    activation: Optional[Activation] = None
    weight_init: Optional[WeightInit] = None
    l2: Optional[float] = None
    has_bias: bool = True

    def validate(self, where: str) -> None:
        _check_positive(self, where, "n_out", "kernel_size", "stride", "dilation")
        _check_non_negative(self, where, "padding")
        _check_l2(self, where)

    def output_shape(self, shape: Shape, where: str) -> Shape:
        _need_cnn(self, shape, where)
        out = []
        for axis, name in enumerate(("height", "width")):
            size = shape.dims[1 + axis]
            span = self.dilation[axis] * (self.kernel_size[axis] - 1) + 1
            full = (size - 1) * self.stride[axis] + span
            if full - 2 * self.padding[axis] <= 0:
                raise ConfigError(
                    join(where, "padding"),
                    f"{_show(self.padding)} crops away the whole output {name}: it would be "
                    f"{full} - 2*{self.padding[axis]} from input {name} {size}; input shape is "
                    f"{shape} [channels x height x width]",
                )
            out.append(full - 2 * self.padding[axis])
        return Shape("cnn", (self.n_out, out[0], out[1]))


@Layer.register("zero_padding")
@dataclass(frozen=True)
class ZeroPaddingLayer(Layer):
    """DL4J's ``ZeroPaddingLayer``: zeros around an image, ``padding`` = (top, bottom, left,
    right). One number pads all four sides; a pair (height, width) pads top and bottom by
    the first, left and right by the second (DL4J's two-value form). Stored as four."""

    padding: Padding4

    def __post_init__(self) -> None:
        if isinstance(self.padding, (list, tuple)) and len(self.padding) == 2:
            top_bottom, left_right = self.padding
            object.__setattr__(self, "padding", (top_bottom, top_bottom, left_right, left_right))
        super().__post_init__()

    def validate(self, where: str) -> None:
        _check_non_negative(self, where, "padding")

    def output_shape(self, shape: Shape, where: str) -> Shape:
        _need_cnn(self, shape, where)
        top, bottom, left, right = self.padding
        c, h, w = shape.dims
        return Shape("cnn", (c, h + top + bottom, w + left + right))


@Layer.register("layer_normalization")
@dataclass(frozen=True)
class LayerNormalization(_ParamLayer):
    """Layer normalization (Ba et al.; DL4J's ``layerNorm``): each example normalised to
    mean 0 and variance 1, then scaled by a learned gain and shifted by a learned bias.
    Over the features of a flat input ``[n]`` (a gain and bias per feature); over each step
    of a sequence ``[time, size]`` (per feature of the step); over all of ``[c, h, w]`` of a
    convolutional input (a gain and bias per channel, as ``nn.GroupNorm(1, c)``). Shapes
    do not change. Its gain and bias take no L2, as batch normalization's."""

    takes_sequences: ClassVar[bool] = True
    eps: float = 1e-5

    def validate(self, where: str) -> None:
        if not self.eps > 0:
            raise ConfigError(join(where, "eps"), f"must be positive, got {self.eps}")

    def output_shape(self, shape: Shape, where: str) -> Shape:
        return shape


@Layer.register("self_attention")
@dataclass(frozen=True)
class SelfAttentionLayer(_ParamLayer):
    """DL4J's ``SelfAttentionLayer``: multi-head dot-product self-attention over a
    sequence, ``[time, n_in] -> [time, n_out]``, every step attending to every real step.

    ``project_input`` (DL4J's default, true): queries, keys and values are learned
    projections of the input to ``n_heads`` heads of ``head_size`` (default ``n_out //
    n_heads``), and the heads' concatenation is projected to ``n_out``; no biases, as DL4J.
    False: the input itself is split into ``n_heads`` heads, so ``n_heads * head_size``
    must equal ``n_in``, and ``n_out`` must equal ``n_in``. Padded steps (the batch's mask)
    are never attended to, and their outputs are zero."""

    takes_sequences: ClassVar[bool] = True
    n_out: int
    n_heads: int = 1
    head_size: Optional[int] = None
    project_input: bool = True
    weight_init: Optional[WeightInit] = None

    def validate(self, where: str) -> None:
        _check_positive(self, where, "n_out", "n_heads")
        if self.head_size is not None:
            _check_positive(self, where, "head_size")
        if self.project_input and self.head_size is None and self.n_out % self.n_heads:
            raise ConfigError(
                join(where, "n_heads"),
                f"{self.n_heads} heads do not divide n_out {self.n_out}; give head_size, or an "
                "n_heads that divides n_out",
            )

    def resolved_head_size(self, n_in: int) -> int:
        if self.head_size is not None:
            return self.head_size
        return (self.n_out if self.project_input else n_in) // self.n_heads

    def output_shape(self, shape: Shape, where: str) -> Shape:
        need_sequences(self, shape, where)
        n_in = shape.dims[1]
        if not self.project_input:
            if self.n_out != n_in:
                raise ConfigError(
                    join(where, "n_out"),
                    f"must equal the input size {n_in} when project_input is false (the output is "
                    f"the heads' concatenation), got {self.n_out}",
                )
            if self.head_size is None and n_in % self.n_heads:
                raise ConfigError(
                    join(where, "n_heads"),
                    f"{self.n_heads} heads do not divide the input size {n_in} (project_input is false)",
                )
            if self.n_heads * self.resolved_head_size(n_in) != n_in:
                raise ConfigError(
                    join(where, "head_size"),
                    f"n_heads * head_size = {self.n_heads} * {self.head_size} = "
                    f"{self.n_heads * self.resolved_head_size(n_in)}, but without projection the "
                    f"heads split the input, of size {n_in}",
                )
        return Shape("rnn", (shape.dims[0], self.n_out))
