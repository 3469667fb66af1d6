"""One forward operator of a training step (``Op``), and what every layer's memory rule
shares: the activation rule, parameter sizes and their weight decay.

The rules themselves register under their layer's type name (``config/registry.py``):
``operations.py``, ``sequence_ops.py`` and ``layer_ops_extra.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from dl4py.config.updaters import AdamW

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


def cuda_pooling_copy(layer: int, in_elements: int, padding, device: str) -> list[Op]:
    """The contiguous copy of a padded average pooling's input on CUDA (``nn/pooling.py``: the
    CUDA kernel's channels-last backward is wrong with padding); kept for the pooling's backward
    in place of the input. Counted for every padded average pooling on CUDA: a 1-D window's input
    is a transposed sequence, copied always; a 2-D pooling's in a convolutional network is
    channels-last by default there. A 2-D pooling of a network's contiguous input is copied by
    no one, and so counted high, on the safe side."""
    padded = any(padding) if isinstance(padding, (tuple, list)) else bool(padding)
    if device != "cuda" or not padded:
        return []
    return [Op(layer, "contiguous", in_elements, False, False, input_gradient="same")]


def activation_ops(layer: int, name: str, elements: int) -> list[Op]:
    """The operator of activation ``name`` in layer ``layer`` (none for the identity)."""
    if name == "identity":
        return []
    if name == "softsign":
        # x / (1 + |x|): three operators; the quotient keeps x and 1 + |x|, and its backward
        # (grad / d and -grad * x / d**2) makes three temporaries of the output's size (measured)
        return [Op(layer, "softsign_abs", elements, True, False),
                Op(layer, "softsign_denominator", elements, False, True),
                Op(layer, "softsign_divide", elements, True, False, backward_scratch_elements=3 * elements)]
    return [Op(layer, name, elements, name in _SAVES_INPUT, name in _SAVES_RESULT)]


def param_sizes(weights: int, biases: int, l2: float) -> tuple[tuple[int, float], ...]:
    """``Op.params`` of a weight decayed by ``l2`` and its biases (none when 0), not decayed."""
    return ((weights, l2),) + (((biases, 0.0),) if biases else ())


def weight_decay(layer, config) -> float:
    """The weight decay of the layer's weights: its L2, or AdamW's (decoupled) decay."""
    if isinstance(config.updater, AdamW):
        return config.updater.weight_decay
    own = getattr(layer, "l2", None)
    return config.l2 if own is None else own
