"""What each layer allocates in a training step, as autograd really does it.

A network's forward pass is a chain of operators. For each one we need the bytes of its
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
    OutputLayer,
    SubsamplingLayer,
)
from dl4py.config.network import NetworkConfig
from dl4py.config.recurrent import SEQUENCE_MODULES, RnnOutputLayer
from dl4py.memory.sequence_ops import elements, sequence_ops

# Activations that autograd differentiates from their result, and from their input.
_SAVES_RESULT = {"relu", "tanh", "sigmoid", "softmax"}
_SAVES_INPUT = {"gelu", "leakyrelu"}


@dataclass(frozen=True)
class Op:
    """One forward operator. Sizes in elements per example unless named ``bytes``."""

    layer: int  # index of the configured layer it belongs to
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

    @property
    def param_elements(self) -> int:
        return sum(n for n, _ in self.params)


def network_ops(config: NetworkConfig) -> list[Op]:
    """The forward operators of ``config``'s network, in order."""
    ops: list[Op] = []
    for shapes in config.layer_shapes():
        layer, i = unfrozen(shapes.layer), shapes.index
        first = len(ops)
        n_in, n_out = elements(shapes.input, config), elements(shapes.output, config)
        l2 = _l2(layer, config)
        if isinstance(layer, SEQUENCE_MODULES + (RnnOutputLayer,)):
            ops += sequence_ops(layer, i, shapes, config, l2, Op)
        elif isinstance(layer, DenseLayer):
            params = _params(n_in * layer.n_out, layer.n_out if layer.has_bias else 0, l2)
            ops.append(Op(i, "linear", n_out, True, False, params=params, autocast=True))
            if not isinstance(layer, OutputLayer):  # the output's activation is fused into the loss
                ops += _activation(i, layer.activation or config.activation, n_out)
        elif isinstance(layer, ConvolutionLayer):
            kh, kw = layer.kernel_size
            weights = shapes.input.dims[0] * layer.n_out * kh * kw
            params = _params(weights, layer.n_out if layer.has_bias else 0, l2)
            ops.append(Op(i, "conv2d", n_out, True, False, params=params, autocast=True))
            ops += _activation(i, layer.activation or config.activation, n_out)
        elif isinstance(layer, SubsamplingLayer):
            if layer.pooling_type == "max":  # int64 indices of each maximum, kept for backward
                ops.append(Op(i, "max_pool2d", n_out, True, False, extra_bytes=8.0 * n_out))
            else:
                ops.append(Op(i, "avg_pool2d", n_out, True, False))
        elif isinstance(layer, BatchNormalization):
            channels = shapes.input.dims[0]  # saved mean and inverse std, float32
            ops.append(Op(i, "batch_norm", n_out, True, False, extra_fixed_bytes=8 * channels,
                          params=((channels, 0.0), (channels, 0.0))))
        elif isinstance(layer, DropoutLayer):  # one bool of mask per element
            ops.append(Op(i, "dropout", n_out, False, False, extra_bytes=1.0 * n_out))
        elif isinstance(layer, ActivationLayer):
            ops += _activation(i, layer.activation, n_out)
        elif isinstance(layer, GlobalPoolingLayer):
            keeps = layer.pooling_type == "max"  # amax keeps input and result; mean/sum keep sizes
            ops.append(Op(i, f"global_{layer.pooling_type}_pool", n_out, keeps, keeps))
        else:
            raise TypeError(f"the memory estimator has no rule for layer type {type(layer).__name__}")
        if is_frozen(shapes.layer):
            ops[first:] = [dataclasses.replace(op, frozen=True) for op in ops[first:]]
    return ops


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
