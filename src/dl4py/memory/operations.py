"""What each layer allocates in a training step, as autograd really does it.

A network's forward pass is a sequence of operators (``step_graph`` says which reads which:
a chain, or a computation graph's vertices). For each one we need the bytes of its
result, what autograd saves for the backward pass (its input, its result, or extras such
as max-pooling's int64 indices and dropout's mask), and the bytes of the gradients it
produces. ``Op`` holds that per example, so one list serves every batch size. The rules
follow PyTorch's derivative formulas (``derivatives.yaml``): ``relu``/``tanh``/``sigmoid``/
``softmax`` keep their result, ``linear``/``conv``/pooling/batch norm/``gelu``/``leaky_relu``
keep their input.

Each layer type's rule is registered under its type name (``config/registry.py``): the rules
of ``config/layers.py``'s layers are here, the others in ``sequence_ops.py`` and
``layer_ops_extra.py``; ``Op`` and what the rules share are in ``op.py``.
"""

from __future__ import annotations

import dataclasses

# Each registers its layers' memory rules when imported.
import dl4py.memory.sequence_ops  # noqa: F401
from dl4py.config.layers import Layer, Shape
from dl4py.config.network import LayerShapes, NetworkConfig
from dl4py.config.registry import LAYERS
from dl4py.memory.layer_ops_conv import same_pool_ops  # also registers layers_conv's rules
from dl4py.memory.layer_ops_extra import convolution_ops  # also registers the extra layers' rules
from dl4py.memory.op import Op, activation_ops, cuda_pooling_copy, param_sizes, weight_decay
from dl4py.memory.sequence_ops import elements

__all__ = ["Op", "layer_ops", "network_ops"]


def network_ops(config: NetworkConfig, device: str = "cuda") -> list[Op]:
    """The forward operators of ``config``'s network, in order, on ``device`` ("cuda" or "cpu")."""
    ops: list[Op] = []
    for shapes in config.layer_shapes():
        ops += layer_ops(shapes.layer, shapes.index, shapes.input, shapes.output, config, device)
    return ops


def layer_ops(layer: Layer, index: int, input_shape: Shape, output_shape: Shape, config,
              device: str = "cuda") -> list[Op]:
    """The forward operators of one layer (a FrozenLayer's too), numbered ``index``.

    ``input_shape`` is the shape the layer receives (a convolution's output already
    flattened for a dense layer: a view, no bytes); ``config`` (a NetworkConfig, or a
    graph's config: the same field names) gives the defaults: activation, l2, updater.
    ``device`` picks the kernels whose memory differs: an LSTM or GRU on a CPU or with cuDNN."""
    rule = LAYERS.memory_rule_for(layer)
    return rule(layer, index, LayerShapes(index, layer, input_shape, output_shape), config, device)


# Rules: (layer, index, LayerShapes, defaults, device) -> its Ops, per example.


@LAYERS.memory_rule("frozen")
def _frozen(layer, i: int, shapes: LayerShapes, config, device: str) -> list[Op]:
    """The wrapped layer's Ops, marked frozen: no gradient, no updater state for its parameters."""
    inner = layer.layer
    ops = LAYERS.memory_rule_for(inner)(inner, i, LayerShapes(i, inner, shapes.input, shapes.output), config, device)
    return [dataclasses.replace(op, frozen=True) for op in ops]


@LAYERS.memory_rule("dense")
def _dense(layer, i: int, shapes: LayerShapes, config, device: str) -> list[Op]:
    n_out = elements(shapes.output, config)
    return _linear(layer, i, shapes, config) + activation_ops(i, layer.activation or config.activation, n_out)


@LAYERS.memory_rule("output")
def _output(layer, i: int, shapes: LayerShapes, config, device: str) -> list[Op]:
    return _linear(layer, i, shapes, config)  # its activation is fused into the loss


def _linear(layer, i: int, shapes: LayerShapes, config) -> list[Op]:
    n_in, n_out = elements(shapes.input, config), elements(shapes.output, config)
    params = param_sizes(n_in * layer.n_out, layer.n_out if layer.has_bias else 0, weight_decay(layer, config))
    return [Op(i, "linear", n_out, True, False, params=params, autocast=True)]


@LAYERS.memory_rule("convolution")
def _convolution(layer, i: int, shapes: LayerShapes, config, device: str) -> list[Op]:
    return convolution_ops(layer, i, shapes, config, "conv2d")



@LAYERS.memory_rule("subsampling")
def _subsampling(layer, i: int, shapes: LayerShapes, config, device: str) -> list[Op]:
    n_out = elements(shapes.output, config)
    if layer.convolution_mode == "same":
        c, h, w = shapes.input.dims
        return same_pool_ops(i, layer.pooling_type, (h, w), c, layer.kernel_size, layer.stride, n_out, "2d")
    if layer.pooling_type == "max":  # int64 indices of each maximum, kept for backward
        return [Op(i, "max_pool2d", n_out, True, False, extra_bytes=8.0 * n_out)]
    return cuda_pooling_copy(i, elements(shapes.input, config), layer.padding, device) + [
        Op(i, "avg_pool2d", n_out, True, False)]


@LAYERS.memory_rule("batch_normalization")
def _batch_normalization(layer, i: int, shapes: LayerShapes, config, device: str) -> list[Op]:
    channels = shapes.input.dims[0]  # saved mean and inverse std, float32
    return [Op(i, "batch_norm", elements(shapes.output, config), True, False, extra_fixed_bytes=8 * channels,
               params=((channels, 0.0), (channels, 0.0)))]


@LAYERS.memory_rule("dropout")
def _dropout(layer, i: int, shapes: LayerShapes, config, device: str) -> list[Op]:
    n_out = elements(shapes.output, config)  # one bool of mask per element
    return [Op(i, "dropout", n_out, False, False, extra_bytes=1.0 * n_out)]


@LAYERS.memory_rule("activation")
def _activation_layer(layer, i: int, shapes: LayerShapes, config, device: str) -> list[Op]:
    return activation_ops(i, layer.activation, elements(shapes.output, config))


@LAYERS.memory_rule("global_pooling")
def _global_pooling(layer, i: int, shapes: LayerShapes, config, device: str) -> list[Op]:
    n_in, n_out = elements(shapes.input, config), elements(shapes.output, config)
    keeps = layer.pooling_type == "max"  # amax keeps input and result; mean/sum keep sizes
    if shapes.input.kind == "rnn":  # with the batch's mask, as sequences come (nn/builder.GlobalPool)
        steps = n_in // shapes.input.dims[1]
        if keeps:  # the padding filled with -inf: a copy, which amax keeps; the fill keeps its bool mask
            return [Op(i, "masked_fill", n_in, False, False, extra_bytes=1.0 * steps),
                    Op(i, "global_max_pool", n_out, True, True,
                       backward_scratch_elements=2 * n_out, backward_scratch_bytes=1.0 * n_in)]
        # x * mask: its backward needs the mask's float copy only (the mask takes no gradient);
        # then the sum, and the mean's divide by each sequence's length
        ops = [Op(i, "masked_product", n_in, False, False, extra_bytes=4.0 * steps),
               Op(i, "global_sum_pool", n_out, False, False)]
        return ops + ([Op(i, "mean_divide", n_out, False, False, extra_bytes=4.0)] if layer.pooling_type == "avg" else [])
    # amax's backward (scale_grad_by_count): (grad / (input == result).sum()) * mask: a
    # boolean mask of the input's size, the count and the quotient beside the gradient.
    return [Op(i, f"global_{layer.pooling_type}_pool", n_out, keeps, keeps,
               backward_scratch_elements=2 * n_out * keeps, backward_scratch_bytes=1.0 * n_in * keeps)]
