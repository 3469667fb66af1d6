"""Layer configurations: what each layer is, as plain data, and the shape it produces.

Names follow DL4J (DenseLayer, ConvolutionLayer, SubsamplingLayer, ...); fields are
snake_case. Every layer is checked and canonicalised when constructed, whether in code or
from a dict (``schema.ConfigBase.__post_init__``): ``activation="RELU"`` is stored as "relu". ``n_in`` is never needed: it is inferred from the previous layer's output
shape, as DL4J's ``setInputType`` does. Building the torch modules lives in ``dl4py.nn``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, Optional

from dl4py.config.schema import TaggedConfig, join
from dl4py.errors import ConfigError

Activation = Literal["identity", "relu", "leakyrelu", "tanh", "sigmoid", "softmax", "gelu", "softsign"]
WeightInit = Literal["xavier", "relu", "normal", "uniform", "zero"]
Loss = Literal["negativeloglikelihood", "mcxent", "mse", "xent", "mae"]
# DL4J's ConvolutionMode: "truncate" drops what a window cannot reach; "same" pads so the
# output size is ceil(input / stride) (config/layers_conv.py's same_padding).
ConvolutionMode = Literal["truncate", "same"]
# DL4J's GradientNormalization enum (its names match in any spelling: "ClipL2PerLayer").
GradientNormalization = Literal[
    "none",
    "renormalize_l2_per_layer",
    "renormalize_l2_per_param_type",
    "clip_element_wise_absolute_value",
    "clip_l2_per_layer",
    "clip_l2_per_param_type",
]
Pair = tuple[int, int]


@dataclass(frozen=True)
class Shape:
    """Shape of one example between layers: ``("ff", (n,))``, ``("cnn", (c, h, w))`` or
    ``("rnn", (time, size))``, where time is None for sequences of any length."""

    kind: Literal["ff", "cnn", "rnn"]
    dims: tuple[Optional[int], ...]

    @property
    def size(self) -> int:
        if None in self.dims:
            raise ValueError(f"a {self.kind} shape of variable length ({self}) has no fixed size")
        n = 1
        for d in self.dims:
            n *= d
        return n

    def flat(self) -> "Shape":
        return Shape("ff", (self.size,))

    def __str__(self) -> str:
        return "x".join("?" if d is None else str(d) for d in self.dims)


class Layer(TaggedConfig):
    """A layer type: registered by its type name (``@Layer.register("dense")``); its module
    builder and memory rule register under the same name (``config/registry.py``)."""

    registry: ClassVar[dict[str, type]] = {}
    type_name: ClassVar[str | None] = None
    has_params: ClassVar[bool] = False
    # It may take a sequence [time, size]: any other layer after a recurrent one is an error
    # naming it (NetworkConfig's sequence rules).
    takes_sequences: ClassVar[bool] = False

    def output_shape(self, shape: Shape, where: str) -> Shape:
        """Shape this layer produces from ``shape``; ConfigError when it cannot take it."""
        raise NotImplementedError


def _check_positive(layer, where: str, *names: str) -> None:
    for name in names:
        value = getattr(layer, name)
        values = value if isinstance(value, tuple) else (value,)
        if any(v <= 0 for v in values):
            raise ConfigError(join(where, name), f"must be positive, got {_show(value)}")


def _check_l2(layer, where: str) -> None:
    if layer.l2 is not None and layer.l2 < 0:
        raise ConfigError(join(where, "l2"), f"must be zero or more, got {layer.l2}")


def _check_same_mode(layer, where: str) -> None:
    """Same mode computes its own padding from the input size: a padding beside it is refused."""
    if layer.convolution_mode == "same" and any(p != 0 for p in _as_tuple(layer.padding)):
        raise ConfigError(join(where, "padding"), f"must be 0 in convolution_mode 'same' (which pads "
                                                  f"by itself), got {_show(layer.padding)}")


def _as_tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def same_size(size: int | None, stride: int) -> int | None:
    """Output size of DL4J's Same mode along one axis: ceil(size / stride) (None stays None)."""
    return None if size is None else -(-size // stride)


def _check_non_negative(layer, where: str, *names: str) -> None:
    for name in names:
        value = getattr(layer, name)
        values = value if isinstance(value, tuple) else (value,)
        if any(v < 0 for v in values):
            raise ConfigError(join(where, name), f"must be zero or more, got {_show(value)}")


def _show(value) -> str:
    return list(value).__repr__() if isinstance(value, tuple) else repr(value)


def _need_cnn(layer: Layer, shape: Shape, where: str) -> None:
    if shape.kind != "cnn":
        raise ConfigError(
            where,
            f"{layer.type_name} needs convolutional input [channels, height, width], but the "
            f"previous layer gives a flat vector of {shape.size}; use InputType.convolutional "
            "or convolutional_flat, or move this layer before any dense layer",
        )


def _window_output(
    layer, shape: Shape, where: str, kernel: Pair, stride: Pair, padding: Pair, dilation: Pair
) -> tuple[int, int]:
    """Spatial output of a convolution or pooling window (DL4J's 'truncate' mode)."""
    out = []
    for axis, name in enumerate(("height", "width")):
        size = shape.dims[1 + axis] + 2 * padding[axis]
        span = dilation[axis] * (kernel[axis] - 1) + 1
        if span > size:
            raise ConfigError(
                join(where, "kernel_size"),
                f"kernel {_show(kernel)} (dilation {_show(dilation)}) spans {span} but the input "
                f"{name} is {shape.dims[1 + axis]} (+{2 * padding[axis]} padding); input shape is "
                f"{shape} [channels x height x width]",
            )
        out.append((size - span) // stride[axis] + 1)
    return out[0], out[1]


# Keyword-only, so that a layer's own required fields (n_out) may still come first.
@dataclass(frozen=True, kw_only=True)
class _ParamLayer(Layer):
    """Fields shared by layers with weights; None means 'use the network default'.

    ``gradient_normalization`` and its threshold are DL4J's per-layer
    ``gradientNormalization``/``gradientNormalizationThreshold``: set on a layer, they win
    over the network's (``train/gradient_normalization.py``); NetworkConfig checks the threshold."""

    has_params: ClassVar[bool] = True
    gradient_normalization: Optional[GradientNormalization] = None
    gradient_normalization_threshold: Optional[float] = None

    def to_dict(self) -> dict:
        data = super().to_dict()
        for key in ("gradient_normalization", "gradient_normalization_threshold"):
            data[key] = data.pop(key)  # after the layer's own fields, where a reader looks last
        return data


@Layer.register("dense")
@dataclass(frozen=True)
class DenseLayer(_ParamLayer):
    n_out: int
    activation: Optional[Activation] = None
    weight_init: Optional[WeightInit] = None
    l2: Optional[float] = None
    has_bias: bool = True

    def validate(self, where: str) -> None:
        _check_positive(self, where, "n_out")
        _check_l2(self, where)

    def output_shape(self, shape: Shape, where: str) -> Shape:
        return Shape("ff", (self.n_out,))


@Layer.register("output")
@dataclass(frozen=True)
class OutputLayer(DenseLayer):
    """Dense layer with a loss. Activation defaults to the loss's natural one:
    softmax for negativeloglikelihood/mcxent, sigmoid for xent, identity for mse."""

    loss: Loss = "negativeloglikelihood"

    def resolved_activation(self) -> str:
        if self.activation is not None:
            return self.activation
        return {"negativeloglikelihood": "softmax", "mcxent": "softmax", "xent": "sigmoid"}.get(
            self.loss, "identity"
        )


@Layer.register("convolution")
@dataclass(frozen=True)
class ConvolutionLayer(_ParamLayer):
    """2-D convolution. A single number for ``kernel_size``, ``stride``, ``padding`` or
    ``dilation`` means the same in both dimensions (``kernel_size=5`` is ``(5, 5)``), as in
    DL4J's ``ConvolutionLayer.Builder(5)`` and Keras."""

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
        h, w = _window_output(
            self, shape, where, self.kernel_size, self.stride, self.padding, self.dilation
        )
        return Shape("cnn", (self.n_out, h, w))


@Layer.register("subsampling")
@dataclass(frozen=True)
class SubsamplingLayer(Layer):
    """Max or average pooling over a window (DL4J's SubsamplingLayer). ``convolution_mode``
    "same" (DL4J's Same): output ceil(size / stride), padded as DL4J pads (the smaller half
    before); padding never wins a maximum and an average counts the real elements only."""

    pooling_type: Literal["max", "avg"] = "max"
    kernel_size: Pair = (2, 2)
    stride: Pair = (2, 2)
    padding: Pair = (0, 0)
    convolution_mode: ConvolutionMode = "truncate"

    def validate(self, where: str) -> None:
        _check_positive(self, where, "kernel_size", "stride")
        _check_non_negative(self, where, "padding")
        _check_same_mode(self, where)
        for axis in range(2):
            if 2 * self.padding[axis] > self.kernel_size[axis]:
                raise ConfigError(
                    join(where, "padding"),
                    f"must be at most half the kernel size {_show(self.kernel_size)}, "
                    f"got {_show(self.padding)}",
                )

    def output_shape(self, shape: Shape, where: str) -> Shape:
        _need_cnn(self, shape, where)
        if self.convolution_mode == "same":
            c, h, w = shape.dims
            return Shape("cnn", (c, same_size(h, self.stride[0]), same_size(w, self.stride[1])))
        h, w = _window_output(self, shape, where, self.kernel_size, self.stride, self.padding, (1, 1))
        return Shape("cnn", (shape.dims[0], h, w))


@Layer.register("batch_normalization")
@dataclass(frozen=True)
class BatchNormalization(_ParamLayer):
    """Batch normalisation over features (flat input) or channels (convolutional input).
    ``decay`` is DL4J's running-average decay: PyTorch's momentum is ``1 - decay``."""

    has_params: ClassVar[bool] = True
    eps: float = 1e-5
    decay: float = 0.9

    def validate(self, where: str) -> None:
        if not self.eps > 0:
            raise ConfigError(join(where, "eps"), f"must be positive, got {self.eps}")
        if not 0.0 <= self.decay < 1.0:
            raise ConfigError(join(where, "decay"), f"must be in [0, 1), got {self.decay}")

    def output_shape(self, shape: Shape, where: str) -> Shape:
        return shape


@Layer.register("dropout")
@dataclass(frozen=True)
class DropoutLayer(Layer):
    """Zeroes each activation with probability ``rate`` while training (PyTorch's meaning;
    DL4J's ``dropOut(p)`` takes the probability of *keeping* it, i.e. ``1 - rate``)."""

    takes_sequences: ClassVar[bool] = True  # each step's activations alike
    rate: float = 0.5

    def validate(self, where: str) -> None:
        if not 0.0 <= self.rate < 1.0:
            raise ConfigError(join(where, "rate"), f"must be in [0, 1), got {self.rate}")

    def output_shape(self, shape: Shape, where: str) -> Shape:
        return shape


@Layer.register("activation")
@dataclass(frozen=True)
class ActivationLayer(Layer):
    activation: Activation

    def output_shape(self, shape: Shape, where: str) -> Shape:
        return shape


@Layer.register("global_pooling")
@dataclass(frozen=True)
class GlobalPoolingLayer(Layer):
    """Pools each channel over all positions, ``[c, h, w] -> [c]``, or each feature of a
    sequence over its steps, ``[time, size] -> [size]`` (DL4J's GlobalPoolingLayer on RNN data:
    a padded batch's padding is left out of the max, the mean and the sum)."""

    takes_sequences: ClassVar[bool] = True
    pooling_type: Literal["max", "avg", "sum"] = "max"

    def output_shape(self, shape: Shape, where: str) -> Shape:
        if shape.kind == "rnn":
            return Shape("ff", (shape.dims[1],))
        _need_cnn(self, shape, where)
        return Shape("ff", (shape.dims[0],))
