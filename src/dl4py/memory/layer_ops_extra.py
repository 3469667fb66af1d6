"""Memory rules of the layers in ``config/layers_extra.py``, registered under their type names
(``config/registry.py``) for ``operations.layer_ops``.

Each layer is a short chain of ``Op``s, with what autograd saves for backward as PyTorch's
derivative formulas have it (``derivatives.yaml``): a 1-D convolution or a transposed one
keeps its input, like a 2-D convolution; max pooling keeps its input and int64 indices;
average pooling its input; nearest upsampling and zero padding keep nothing but sizes;
layer normalization keeps its input and a mean and inverse deviation per normalised row.
Self-attention is its input projection (a matrix product keeping its input), the attention
kernel (keeping queries, keys, values, its result and a log-sum-exp per query and head),
the heads' concatenation (a copy) and the output projection; without projection the
kernel's backward returns a gradient for each of queries, keys and values, all the
input's. Estimated without a mask, as ``measure_training_step`` runs them by default; a
masked batch adds the mask's multiplications.
"""

from __future__ import annotations

from dl4py.config.network import LayerShapes
from dl4py.config.registry import LAYERS
from dl4py.memory.layer_ops_conv import same_pool_ops, same_window_1d_ops
from dl4py.memory.op import Op, activation_ops, cuda_pooling_copy, param_sizes, weight_decay
from dl4py.memory.sequence_ops import elements, steps

# Rules (config/registry.py): (layer, index, LayerShapes, defaults, device) -> its Ops, per example.


@LAYERS.memory_rule("convolution1d")
def _convolution1d(layer, index: int, shapes: LayerShapes, config, device: str) -> list[Op]:
    n_out = elements(shapes.output, config)
    weights = shapes.input.dims[1] * layer.n_out * layer.kernel_size
    params = param_sizes(weights, layer.n_out if layer.has_bias else 0, weight_decay(layer, config))
    conv = Op(index, "conv1d", n_out, True, False, params=params, autocast=True, upcast_on_cpu=True)
    pad = same_window_1d_ops(layer, index, shapes, config, n_out) if layer.convolution_mode == "same" else []
    return pad + [conv, _contiguous(index, n_out)] + activation_ops(index, layer.activation or config.activation, n_out)


@LAYERS.memory_rule("subsampling1d")
def _subsampling1d(layer, index: int, shapes: LayerShapes, config, device: str) -> list[Op]:
    n_out = elements(shapes.output, config)
    if layer.convolution_mode == "same":
        time = shapes.input.dims[0] or steps(config)
        pool = same_pool_ops(index, layer.pooling_type, (time,), shapes.input.dims[1], (layer.kernel_size,),
                             (layer.stride,), n_out, "1d")
        return pool + [_contiguous(index, n_out)]
    if layer.pooling_type == "max":  # int64 indices of each maximum, kept for backward
        return [Op(index, "max_pool1d", n_out, True, False, extra_bytes=8.0 * n_out), _contiguous(index, n_out)]
    return cuda_pooling_copy(index, elements(shapes.input, config), layer.padding, device) + [
        Op(index, "avg_pool1d", n_out, True, False), _contiguous(index, n_out)]


@LAYERS.memory_rule("upsampling2d")
def _upsampling2d(layer, index: int, shapes: LayerShapes, config, device: str) -> list[Op]:
    return [Op(index, "upsample_nearest2d", elements(shapes.output, config), False, False)]


@LAYERS.memory_rule("zero_padding")
def _zero_padding(layer, index: int, shapes: LayerShapes, config, device: str) -> list[Op]:
    return [Op(index, "constant_pad_nd", elements(shapes.output, config), False, False)]


def convolution_ops(layer, i: int, shapes: LayerShapes, config, kernel: str) -> list[Op]:
    """A 2-D convolution's ``kernel`` (``conv2d``, ``conv_transpose2d``: the same weights,
    ``n_in * n_out * kh * kw``) and its activation."""
    n_out = elements(shapes.output, config)
    kh, kw = layer.kernel_size
    weights = shapes.input.dims[0] * layer.n_out * kh * kw
    params = param_sizes(weights, layer.n_out if layer.has_bias else 0, weight_decay(layer, config))
    conv = Op(i, kernel, n_out, True, False, params=params, autocast=True, upcast_on_cpu=True)
    return [conv] + activation_ops(i, layer.activation or config.activation, n_out)


@LAYERS.memory_rule("deconvolution2d")
def _deconvolution2d(layer, index: int, shapes: LayerShapes, config, device: str) -> list[Op]:
    return convolution_ops(layer, index, shapes, config, "conv_transpose2d")


@LAYERS.memory_rule("layer_normalization")
def _layer_normalization(layer, index: int, shapes: LayerShapes, config, device: str) -> list[Op]:
    n_in, n_out = elements(shapes.input, config), elements(shapes.output, config)
    kind = shapes.input.kind
    features = shapes.input.dims[0] if kind == "cnn" else shapes.input.dims[-1]
    rows = n_in // shapes.input.dims[-1] if kind == "rnn" else 1  # one per step, or per example
    # Its mean and inverse deviation per row (float32), kept for backward. No L2 (as batch norm).
    return [Op(index, "group_norm" if kind == "cnn" else "layer_norm", n_out, True, False,
               extra_bytes=8.0 * rows, params=((features, 0.0), (features, 0.0)))]


def _contiguous(index: int, n_out: int) -> Op:
    """The copy that turns a 1-D window's [batch, size, time] result into [batch, time, size]."""
    return Op(index, "contiguous", n_out, False, False)


@LAYERS.memory_rule("self_attention")
def _self_attention(layer, index: int, shapes: LayerShapes, config, device: str) -> list[Op]:
    n_in, n_out = elements(shapes.input, config), elements(shapes.output, config)
    l2 = weight_decay(layer, config)
    size = shapes.input.dims[1]
    time = n_in // size
    heads = layer.n_heads * layer.resolved_head_size(size)
    ops = []
    if layer.project_input:
        ops.append(Op(index, "linear", 3 * heads * time, True, False, params=((3 * heads * size, l2),),
                      autocast=True))
    # The attention's result; it keeps queries, keys and values (the projection's result, or
    # the input) and its result, and a float32 log-sum-exp per query and head. Its result
    # is laid out [batch, time, heads, head_size]: the heads' concatenation is a view.
    saved = 4.0 * time * layer.n_heads
    # Without projection, queries, keys and values are all the input, and the kernel's
    # backward returns a gradient for each before they are summed: two more input-sized
    # tensors, alive in that backward only.
    scratch = 0 if layer.project_input else 2 * n_in
    ops.append(Op(index, "scaled_dot_product_attention", heads * time, True, True, extra_bytes=saved,
                  backward_scratch_elements=scratch))
    if layer.project_input:
        ops.append(Op(index, "linear", n_out, True, False, params=((heads * layer.n_out, l2),), autocast=True))
    return ops
