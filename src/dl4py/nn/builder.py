"""Turn a NetworkConfig into torch modules, one ``nn.Module`` per configured layer.

Each layer type's module comes from the builder registered under its type name
(``config/registry.py``): the builders of ``config/layers.py``'s layers are here, the
others in ``nn/recurrent.py``, ``nn/layers_extra.py`` and ``nn/layers_conv.py``. Weights start as DL4J's
(``nn/layer_init.py``). The output layer's module yields pre-activation scores; its
activation is applied by ``output()`` and fused into the loss (``nn/output_loss.py``).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

# nn/layers_extra.py and nn/layers_conv.py register their builders when imported, as nn/recurrent.py does.
import dl4py.nn.layers_extra  # noqa: F401
from dl4py.config.frozen import is_frozen
from dl4py.config.layers import Layer, Shape
from dl4py.config.network import NetworkConfig
from dl4py.config.registry import LAYERS
from dl4py.nn.convolution import Conv2d
from dl4py.nn.layer_init import ACTIVATIONS, init_weight_and_bias
from dl4py.nn.layers_conv import SamePool2d
from dl4py.nn.pooling import AvgPool2d
from dl4py.nn.output_loss import OutputLoss  # noqa: F401  (nn/network.py and nn/graph.py take it from here)
from dl4py.nn.recurrent import SequenceMask


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
    """Max, mean or sum over every position of an image ``[n, c, h, w] -> [n, c]``, or over the
    steps of a sequence ``[n, time, size] -> [n, size]``; a padded batch's mask keeps its padding
    out (DL4J's ``MaskedReductionUtil``: the max of the real steps, their mean, their sum)."""

    def __init__(self, pooling_type: str, masks=None):
        super().__init__()
        self.pooling_type = pooling_type
        self.masks = masks

    def forward(self, x):
        dims = (2, 3) if x.dim() == 4 else (1,)
        mask = self.masks.current if self.masks is not None and x.dim() == 3 else None
        if mask is not None:
            real = mask.bool().unsqueeze(-1)
            if self.pooling_type == "max":
                return torch.amax(x.masked_fill(~real, float("-inf")), dim=1)
            total = torch.sum(x * real.to(x.dtype), dim=1)
            return total / mask.sum(dim=1, keepdim=True).to(x.dtype) if self.pooling_type == "avg" else total
        if self.pooling_type == "max":
            return torch.amax(x, dim=dims)
        if self.pooling_type == "avg":
            return torch.mean(x, dim=dims)
        return torch.sum(x, dim=dims)


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
    ``config`` gives the defaults (a NetworkConfig or a GraphConfig); ``masks`` is the model's
    SequenceMask, for the layers that read it (None: an empty one, no masking); ``where``
    names the layer in errors."""
    masks = SequenceMask() if masks is None else masks
    # Stable names (``4.op.weight``) whether or not a preprocessor is inserted.
    parts = OrderedDict()
    if received.kind == "ff" and shape.kind == "cnn":
        parts["preprocess"] = Reshape(shape.dims)
    elif received.kind == "cnn" and shape.kind == "ff":
        parts["preprocess"] = nn.Flatten(1)
    build = LAYERS.builder_for(layer_config)
    op, activation = build(layer_config, shape, config, generator, masks, where)
    parts["op"] = op
    if activation is not None:
        parts["activation"] = activation
    return FrozenSequential(parts) if is_frozen(layer_config) else nn.Sequential(parts)


# Builders: (layer, shape it takes, defaults, generator, masks, where) -> (op, activation or None).


@LAYERS.builder("frozen")
def _frozen(layer, shape: Shape, config, gen, masks, where: str):
    """The wrapped layer's parts, under the same names; layer_module freezes their container."""
    inner = layer.layer
    return LAYERS.builder_for(inner)(inner, shape, config, gen, masks, where)


@LAYERS.builder("dense")
def _dense(layer, shape: Shape, config, gen, masks, where: str):
    return _linear(layer, shape, config, gen), ACTIVATIONS[layer.activation or config.activation]()


@LAYERS.builder("output", "rnn_output")
def _output(layer, shape: Shape, config, gen, masks, where: str):
    return _linear(layer, shape, config, gen), None  # its activation is the loss's (OutputLoss)


def _linear(layer, shape: Shape, config, gen) -> nn.Linear:
    n_in = shape.dims[-1] if shape.kind == "rnn" else shape.size  # RnnOutputLayer: per step
    linear = nn.Linear(n_in, layer.n_out, bias=layer.has_bias)
    init_weight_and_bias(linear, layer.weight_init or config.weight_init, gen)
    return linear


@LAYERS.builder("convolution")
def _convolution(layer, shape: Shape, config, gen, masks, where: str):
    conv = Conv2d(
        shape.dims[0], layer.n_out, layer.kernel_size, layer.stride, layer.padding,
        layer.dilation, bias=layer.has_bias,
    )
    init_weight_and_bias(conv, layer.weight_init or config.weight_init, gen)
    return conv, ACTIVATIONS[layer.activation or config.activation]()


@LAYERS.builder("subsampling")
def _subsampling(layer, shape: Shape, config, gen, masks, where: str):
    if layer.convolution_mode == "same":
        return SamePool2d(layer.pooling_type, layer.kernel_size, layer.stride), None
    if layer.pooling_type == "max":
        return nn.MaxPool2d(layer.kernel_size, layer.stride, layer.padding), None
    return AvgPool2d(layer.kernel_size, layer.stride, layer.padding), None


@LAYERS.builder("batch_normalization")
def _batch_normalization(layer, shape: Shape, config, gen, masks, where: str):
    cls = nn.BatchNorm2d if shape.kind == "cnn" else nn.BatchNorm1d
    return cls(shape.dims[0], eps=layer.eps, momentum=1.0 - layer.decay), None


@LAYERS.builder("dropout")
def _dropout(layer, shape: Shape, config, gen, masks, where: str):
    return nn.Dropout(layer.rate), None


@LAYERS.builder("activation")
def _activation_layer(layer, shape: Shape, config, gen, masks, where: str):
    return ACTIVATIONS[layer.activation](), None


@LAYERS.builder("global_pooling")
def _global_pooling(layer, shape: Shape, config, gen, masks, where: str):
    return GlobalPool(layer.pooling_type, masks), None
