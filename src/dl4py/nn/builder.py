"""Turn a NetworkConfig into torch modules, one ``nn.Module`` per configured layer.

Weight initialisation follows DL4J's definitions (biases start at zero):
xavier N(0, 2/(fan_in+fan_out)), relu N(0, 2/fan_in), normal N(0, 1/fan_in),
uniform U(-1/sqrt(fan_in), 1/sqrt(fan_in)), zero. The output layer's module yields
pre-activation scores; its activation is applied by ``output()`` and fused into the
loss where that is exact and more stable (softmax + NLL, sigmoid + binary xent).
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from dl4py.config.layers import (
    ActivationLayer,
    BatchNormalization,
    ConvolutionLayer,
    DenseLayer,
    DropoutLayer,
    GlobalPoolingLayer,
    Layer,
    OutputLayer,
    Shape,
    SubsamplingLayer,
)
from dl4py.config.frozen import is_frozen, unfrozen
from dl4py.config.layers_extra import EXTRA_LAYERS
from dl4py.config.network import NetworkConfig
from dl4py.nn.convolution import Conv2d
from dl4py.nn.layers_extra import extra_parts

ACTIVATIONS = {
    "identity": nn.Identity,
    "relu": nn.ReLU,
    "leakyrelu": lambda: nn.LeakyReLU(0.01),  # DL4J's default alpha
    "tanh": nn.Tanh,
    "sigmoid": nn.Sigmoid,
    "softmax": lambda: nn.Softmax(dim=1),
    "gelu": nn.GELU,
}


class Reshape(nn.Module):
    """Flat rows -> [channels, height, width] (DL4J's FeedForwardToCnnPreProcessor)."""

    def __init__(self, dims: tuple[int, ...]):
        super().__init__()
        self.dims = tuple(dims)

    def forward(self, x):
        return x.view(x.shape[0], *self.dims)

    def extra_repr(self) -> str:
        return f"dims={self.dims}"


class GlobalPool(nn.Module):
    def __init__(self, pooling_type: str):
        super().__init__()
        self.pooling_type = pooling_type

    def forward(self, x):
        if self.pooling_type == "max":
            return torch.amax(x, dim=(2, 3))
        if self.pooling_type == "avg":
            return torch.mean(x, dim=(2, 3))
        return torch.sum(x, dim=(2, 3))


class FrozenSequential(nn.Sequential):
    """A FrozenLayer's parts: parameters without gradients, always in inference mode
    (DL4J's FrozenLayer): batch norm keeps its running statistics, dropout drops nothing.
    Its parameter names are those of an unfrozen layer (``4.op.weight``), so weights move
    between a network and its transferred copy by name."""

    def __init__(self, parts):
        super().__init__(parts)
        self.requires_grad_(False)
        super().train(False)

    def train(self, mode: bool = True):
        return super().train(False)


def build_module(config: NetworkConfig, generator: torch.Generator, masks=None) -> nn.Sequential:
    """All layers as ``nn.Sequential(layer0, layer1, ...)``, initialised from ``generator``.
    ``masks``: the ``SequenceMask`` the model sets per batch, for layers that read it."""
    from dl4py.nn.recurrent import SequenceMask

    masks = SequenceMask() if masks is None else masks
    modules = []
    data_shape = Shape("ff", config.input_type.example_shape())
    if len(data_shape.dims) == 3:
        data_shape = Shape("cnn", data_shape.dims)
    elif len(data_shape.dims) == 2:
        data_shape = Shape("rnn", data_shape.dims)
    for shapes in config.layer_shapes():
        where = f"network.layers[{shapes.index}]"
        modules.append(layer_module(shapes.layer, data_shape, shapes.input, config, generator, masks, where))
        data_shape = shapes.output
    return nn.Sequential(*modules)


def layer_module(layer_config: Layer, received: Shape, shape: Shape, config, generator: torch.Generator,
                 masks, where: str) -> nn.Sequential:
    """One configured layer as ``nn.Sequential(preprocess?, op, activation?)``: ``received``
    is what the layer is given, ``shape`` what it takes (a flattened or reshaped view of it).
    ``config`` gives the defaults (a NetworkConfig or a GraphConfig)."""
    from dl4py.config.recurrent import SEQUENCE_MODULES
    from dl4py.nn.recurrent import recurrent_parts

    # Stable names (``4.op.weight``) whether or not a preprocessor is inserted.
    parts = OrderedDict()
    if received.kind == "ff" and shape.kind == "cnn":
        parts["preprocess"] = Reshape(shape.dims)
    elif received.kind == "cnn" and shape.kind == "ff":
        parts["preprocess"] = nn.Flatten(1)
    layer = unfrozen(layer_config)
    if isinstance(layer, SEQUENCE_MODULES):
        op, activation = recurrent_parts(layer, shape, config, generator, masks, where, _init_weight)
    else:
        op, activation = _layer_parts(layer, shape, config, generator, masks, where)
    parts["op"] = op
    if activation is not None:
        parts["activation"] = activation
    return FrozenSequential(parts) if is_frozen(layer_config) else nn.Sequential(parts)


def _activation(layer: Layer, config: NetworkConfig) -> nn.Module:
    name = getattr(layer, "activation", None) or config.activation
    return ACTIVATIONS[name]()


def _layer_parts(
    layer: Layer, shape: Shape, config: NetworkConfig, gen, masks=None, where: str = "layer"
) -> tuple[nn.Module, nn.Module | None]:
    """The layer's operation and its activation (None where it has none). ``masks``: the
    model's SequenceMask, for the layers that read it; ``where`` names the layer in errors."""
    if isinstance(layer, EXTRA_LAYERS):
        return extra_parts(layer, shape, config, gen, masks, where, _init_weight)
    if isinstance(layer, DenseLayer):  # OutputLayer included
        n_in = shape.dims[-1] if shape.kind == "rnn" else shape.size  # RnnOutputLayer: per step
        linear = nn.Linear(n_in, layer.n_out, bias=layer.has_bias)
        _init_weight(linear.weight, layer.weight_init or config.weight_init, gen)
        if linear.bias is not None:
            nn.init.zeros_(linear.bias)
        if isinstance(layer, OutputLayer):
            return linear, None
        return linear, _activation(layer, config)
    if isinstance(layer, ConvolutionLayer):
        conv = Conv2d(
            shape.dims[0], layer.n_out, layer.kernel_size, layer.stride, layer.padding,
            layer.dilation, bias=layer.has_bias,
        )
        _init_weight(conv.weight, layer.weight_init or config.weight_init, gen)
        if conv.bias is not None:
            nn.init.zeros_(conv.bias)
        return conv, _activation(layer, config)
    if isinstance(layer, SubsamplingLayer):
        if layer.pooling_type == "max":
            return nn.MaxPool2d(layer.kernel_size, layer.stride, layer.padding), None
        return nn.AvgPool2d(layer.kernel_size, layer.stride, layer.padding), None
    if isinstance(layer, BatchNormalization):
        cls = nn.BatchNorm2d if shape.kind == "cnn" else nn.BatchNorm1d
        return cls(shape.dims[0], eps=layer.eps, momentum=1.0 - layer.decay), None
    if isinstance(layer, DropoutLayer):
        return nn.Dropout(layer.rate), None
    if isinstance(layer, ActivationLayer):
        return ACTIVATIONS[layer.activation](), None
    if isinstance(layer, GlobalPoolingLayer):
        return GlobalPool(layer.pooling_type), None
    raise TypeError(f"no module builder for layer type {type(layer).__name__}")


def _init_weight(weight: torch.Tensor, scheme: str, gen: torch.Generator) -> None:
    fan_in, fan_out = nn.init._calculate_fan_in_and_fan_out(weight)
    with torch.no_grad():
        if scheme == "xavier":
            weight.normal_(0.0, math.sqrt(2.0 / (fan_in + fan_out)), generator=gen)
        elif scheme == "relu":
            weight.normal_(0.0, math.sqrt(2.0 / fan_in), generator=gen)
        elif scheme == "normal":
            weight.normal_(0.0, 1.0 / math.sqrt(fan_in), generator=gen)
        elif scheme == "uniform":
            bound = 1.0 / math.sqrt(fan_in)
            weight.uniform_(-bound, bound, generator=gen)
        elif scheme == "zero":
            weight.zero_()
        else:
            raise ValueError(f"unknown weight init {scheme!r}")


class OutputLoss:
    """Loss of the output layer on its pre-activation scores.

    Labels are class indices ``[n]`` or target rows ``[n, k]``; indices are one-hot
    encoded where the loss needs rows (mse, xent).
    """

    def __init__(self, layer: OutputLayer):
        if layer.loss not in ("negativeloglikelihood", "mcxent", "xent", "mse"):
            # The config admits only canonical names; a loss without a branch below must
            # not quietly train as the last one (DL4J's "NEGATIVELOGLIKELIHOOD" once did).
            raise TypeError(f"OutputLoss has no rule for loss {layer.loss!r}")
        self.loss = layer.loss
        self.activation = layer.resolved_activation()
        self.n_out = layer.n_out
        self._act = ACTIVATIONS[self.activation]()

    def __call__(self, scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
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
        assert self.loss == "mse"
        return F.mse_loss(self._act(scores), self._rows(labels, scores))

    def _rows(self, labels: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        if labels.dim() == 1:
            return F.one_hot(labels, self.n_out).to(like.dtype)
        return labels.to(like.dtype)

    def activate(self, scores: torch.Tensor) -> torch.Tensor:
        return self._act(scores)
