"""What each layer allocates in a training step, as autograd really does it.

A network's forward pass is a sequence of operators (``step_graph`` says which reads which:
a chain, or a computation graph's vertices). For each one we need the bytes of its
result, what autograd saves for the backward pass (its input, its result, or extras such
as max-pooling's int64 indices and dropout's mask), and the bytes of the gradients it
produces. ``Op`` holds that per example, so one list serves every batch size. The rules
follow PyTorch's derivative formulas (``derivatives.yaml``): ``relu``/``tanh``/``sigmoid``/
``softmax`` keep their result, ``linear``/``conv``/pooling/batch norm/``gelu``/``leaky_relu``
keep their input.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dl4py.config.frozen import is_frozen, unfrozen
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
from dl4py.config.network import LayerShapes, NetworkConfig
from dl4py.config.recurrent import SEQUENCE_MODULES, RnnOutputLayer
from dl4py.config.layers_extra import EXTRA_LAYERS
from dl4py.memory.layer_ops_extra import extra_layer_ops
from dl4py.memory.sequence_ops import elements, sequence_ops

# Activations that autograd differentiates from their result, and from their input.
_SAVES_RESULT = {"relu", "tanh", "sigmoid", "softmax"}
_SAVES_INPUT = {"gelu", "leakyrelu"}


@dataclass(frozen=True)
class Op:
    """One forward operator. Sizes in elements per example unless named ``bytes``."""

    layer: int  # index of the configured layer it belongs to (of a graph's vertex, in computation order)
    name: str
    out_elements: int  # its result, in the compute dtype
    saves_input: bool  # autograd keeps the operator's input for backward
    saves_result: bool  # ... or its result
    extra_bytes: float = 0.0  # more saved per example: pooling indices, dropout mask
    extra_fixed_bytes: int = 0  # saved, not per example: batch-norm statistics
    # Its parameter tensors: (elements, the weight decay of its optimizer param group:
    # coupled L2, or AdamW's own). The optimizer steps one group at a time
    # (nn.optimizers.param_groups); its temporaries follow these sizes and groups.
    params: tuple[tuple[int, float], ...] = ()
    autocast: bool = False  # autocast runs it in 16 bits (casting its input and parameters)
    frozen: bool = False  # a FrozenLayer's: its parameters take no gradient and no updater state
    # More saved, in blocks each rounded up to ``aligned_to`` bytes at the batch's size:
    # oneDNN's LSTM workspace, whose parts each start on a 4096-byte page. Per example.
    aligned_bytes: tuple[float, ...] = ()
    aligned_to: int = 1
    # Temporaries its backward makes beside its inputs' gradients, per example: elements in
    # the activations' dtype, and bytes (boolean masks).
    backward_scratch_elements: float = 0.0
    backward_scratch_bytes: float = 0.0
    # What its backward gives its input: "new" (a tensor of the input's size) or "same"
    # (the gradient it received, or a view of it: a copy's backward).
    input_gradient: str = "new"
    # Its backward is one kernel that returns every input's gradient, needed or not
    # (oneDNN's LSTM): an input that needs none still gets one, dropped at once.
    fused_backward: bool = False
    # Its backward runs step by step (a GRU's cells), each step freeing what it saved: by
    # the time its inputs' gradients are whole, ``extra_bytes`` are gone.
    stepwise_backward: bool = False
    # Its result is laid out [time, batch, size] under a [batch, time, size] view (an LSTM's
    # or GRU's on a CPU, and what multiplies it): a next LSTM/GRU reads it without a copy.
    time_major: bool = False
    # A convolution: on a CPU without native kernels for its 16-bit dtype, dl4py computes it
    # in float32 from the 16-bit values (nn/convolution.py), with float32 copies around it.
    upcast_on_cpu: bool = False

    @property
    def param_elements(self) -> int:
        return sum(n for n, _ in self.params)

    def saved_extra_bytes(self, n: int) -> float:
        """What it saves besides its input and result, at batch size ``n``."""
        align = self.aligned_to
        aligned = sum(-(-int(n * b) // align) * align for b in self.aligned_bytes)
        return n * self.extra_bytes + self.extra_fixed_bytes + aligned


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
    inner = unfrozen(layer)
    ops = _unfrozen_layer_ops(inner, index, LayerShapes(index, inner, input_shape, output_shape), config, device)
    if is_frozen(layer):
        ops = [dataclasses.replace(op, frozen=True) for op in ops]
    return ops


def _unfrozen_layer_ops(layer: Layer, i: int, shapes: LayerShapes, config, device: str) -> list[Op]:
    n_in, n_out = elements(shapes.input, config), elements(shapes.output, config)
    l2 = _l2(layer, config)
    if isinstance(layer, SEQUENCE_MODULES + (RnnOutputLayer,)):
        return sequence_ops(layer, i, shapes, config, l2, Op, device)
    if isinstance(layer, DenseLayer):
        params = _params(n_in * layer.n_out, layer.n_out if layer.has_bias else 0, l2)
        ops = [Op(i, "linear", n_out, True, False, params=params, autocast=True)]
        if not isinstance(layer, OutputLayer):  # the output's activation is fused into the loss
            ops += _activation(i, layer.activation or config.activation, n_out)
        return ops
    if isinstance(layer, ConvolutionLayer):
        kh, kw = layer.kernel_size
        weights = shapes.input.dims[0] * layer.n_out * kh * kw
        params = _params(weights, layer.n_out if layer.has_bias else 0, l2)
        conv = Op(i, "conv2d", n_out, True, False, params=params, autocast=True, upcast_on_cpu=True)
        return [conv] + _activation(i, layer.activation or config.activation, n_out)
    if isinstance(layer, SubsamplingLayer):
        if layer.pooling_type == "max":  # int64 indices of each maximum, kept for backward
            return [Op(i, "max_pool2d", n_out, True, False, extra_bytes=8.0 * n_out)]
        return [Op(i, "avg_pool2d", n_out, True, False)]
    if isinstance(layer, BatchNormalization):
        channels = shapes.input.dims[0]  # saved mean and inverse std, float32
        return [Op(i, "batch_norm", n_out, True, False, extra_fixed_bytes=8 * channels,
                   params=((channels, 0.0), (channels, 0.0)))]
    if isinstance(layer, DropoutLayer):  # one bool of mask per element
        return [Op(i, "dropout", n_out, False, False, extra_bytes=1.0 * n_out)]
    if isinstance(layer, ActivationLayer):
        return _activation(i, layer.activation, n_out)
    if isinstance(layer, GlobalPoolingLayer):
        keeps = layer.pooling_type == "max"  # amax keeps input and result; mean/sum keep sizes
        # amax's backward (scale_grad_by_count): (grad / (input == result).sum()) * mask: a
        # boolean mask of the input's size, the count and the quotient beside the gradient.
        return [Op(i, f"global_{layer.pooling_type}_pool", n_out, keeps, keeps,
                   backward_scratch_elements=2 * n_out * keeps, backward_scratch_bytes=1.0 * n_in * keeps)]
    if isinstance(layer, EXTRA_LAYERS):
        return extra_layer_ops(layer, i, shapes, config, l2, Op, _activation)
    raise TypeError(f"the memory estimator has no rule for layer type {type(layer).__name__}")


def _activation(layer: int, name: str, elements: int) -> list[Op]:
    if name == "identity":
        return []
    return [Op(layer, name, elements, name in _SAVES_INPUT, name in _SAVES_RESULT)]


def _params(weights: int, biases: int, l2: float) -> tuple[tuple[int, float], ...]:
    return ((weights, l2),) + (((biases, 0.0),) if biases else ())


def _l2(layer, config: NetworkConfig) -> float:
    """The weight decay of the layer's weights: its L2, or AdamW's (decoupled) decay."""
    from dl4py.config.updaters import AdamW

    if isinstance(config.updater, AdamW):
        return config.updater.weight_decay
    own = getattr(layer, "l2", None)
    return config.l2 if own is None else own
