"""Memory rules of the layers in ``config/layers_conv.py``, and of Same-mode pooling and 1-D
windows, registered under their type names (``config/registry.py``) for ``operations.layer_ops``.

As the modules in ``nn/layers_conv.py`` run them: a depthwise convolution is one grouped
``conv2d`` keeping its input; a separable one is that and a 1x1 ``conv2d`` keeping the
depthwise result; cropping is a copy (the backward's zero gradient of the input's size) and
1-D zero padding a ``constant_pad_nd``; the CNN loss layer's module is the identity (its loss
is the loss head's). Same mode pads (a copy) only where the windows do not fit, then pools
(max keeps its input and int64 indices, average its input, and divides its result in place
by each window's real share).
"""

from __future__ import annotations

import math

from dl4py.config.layers_conv import same_padding
from dl4py.config.network import LayerShapes
from dl4py.config.registry import LAYERS
from dl4py.memory.op import Op, activation_ops, param_sizes, weight_decay
from dl4py.memory.sequence_ops import elements, steps


def same_pool_ops(index: int, pooling_type: str, sizes, channels: int, kernel, stride, n_out: int,
                  dims: str) -> list[Op]:
    """Same-mode pooling over spatial ``sizes`` (``dims``: "1d" or "2d") of ``channels``."""
    padded = [size + sum(same_padding(size, k, s)) for size, k, s in zip(sizes, kernel, stride)]
    ops = []
    if padded != list(sizes):
        ops.append(Op(index, "constant_pad_nd", channels * math.prod(padded), False, False))
    if pooling_type == "max":  # int64 indices of each maximum, kept for backward
        return ops + [Op(index, f"max_pool{dims}", n_out, True, False, extra_bytes=8.0 * n_out)]
    # Divided in place by each window's real share: no tensor of its own.
    return ops + [Op(index, f"avg_pool{dims}", n_out, True, False)]


def same_window_1d_ops(layer, index: int, shapes: LayerShapes, config, n_out: int) -> list[Op]:
    """A 1-D window's padding in Same mode: the pad copy, where the windows do not fit, of
    the transposed input ``[size, time]`` (the padding an estimate's sequence length takes)."""
    time = shapes.input.dims[0] or steps(config)
    span = getattr(layer, "dilation", 1) * (layer.kernel_size - 1) + 1
    pad = sum(same_padding(time, span, layer.stride))
    return [Op(index, "constant_pad_nd", shapes.input.dims[1] * (time + pad), False, False)] if pad else []


def _depthwise_op(layer, index: int, channels: int, n_out: int, bias: bool, config) -> Op:
    kh, kw = layer.kernel_size
    weights = channels * layer.depth_multiplier * kh * kw
    params = param_sizes(weights, channels * layer.depth_multiplier if bias else 0, weight_decay(layer, config))
    return Op(index, "conv2d", n_out, True, False, params=params, autocast=True, upcast_on_cpu=True)


# Rules (config/registry.py): (layer, index, LayerShapes, defaults, device) -> its Ops, per example.


@LAYERS.memory_rule("depthwise_convolution2d")
def _depthwise_convolution2d(layer, index: int, shapes: LayerShapes, config, device: str) -> list[Op]:
    n_out = elements(shapes.output, config)
    conv = _depthwise_op(layer, index, shapes.input.dims[0], n_out, layer.has_bias, config)
    return [conv] + activation_ops(index, layer.activation or config.activation, n_out)


@LAYERS.memory_rule("separable_convolution2d")
def _separable_convolution2d(layer, index: int, shapes: LayerShapes, config, device: str) -> list[Op]:
    n_out = elements(shapes.output, config)
    channels = shapes.input.dims[0] * layer.depth_multiplier
    _, h, w = shapes.output.dims
    depthwise = _depthwise_op(layer, index, shapes.input.dims[0], channels * h * w, False, config)
    params = param_sizes(channels * layer.n_out, layer.n_out if layer.has_bias else 0, weight_decay(layer, config))
    pointwise = Op(index, "conv2d", n_out, True, False, params=params, autocast=True, upcast_on_cpu=True)
    return [depthwise, pointwise] + activation_ops(index, layer.activation or config.activation, n_out)


@LAYERS.memory_rule("cropping2d", "cropping1d")
def _cropping(layer, index: int, shapes: LayerShapes, config, device: str) -> list[Op]:
    return [Op(index, "crop", elements(shapes.output, config), False, False)]


@LAYERS.memory_rule("zero_padding1d")
def _zero_padding1d(layer, index: int, shapes: LayerShapes, config, device: str) -> list[Op]:
    return [Op(index, "constant_pad_nd", elements(shapes.output, config), False, False)]


@LAYERS.memory_rule("cnn_loss")
def _cnn_loss(layer, index: int, shapes: LayerShapes, config, device: str) -> list[Op]:
    return []  # an identity module: the scores are its input, the loss is the loss head's
