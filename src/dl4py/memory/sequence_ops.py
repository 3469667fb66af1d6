"""Memory rules of the recurrent and embedding layers (config/recurrent.py), for operations.py.

Per example, a sequence of ``time`` steps (the input type's ``length``: an estimate needs
one; a variable-length input is estimated at the length it is given) costs ``time`` times a
step. What an LSTM or GRU keeps for backward, and its backward kernels' temporaries, are
counted per step as measured on a CPU with ``LiveTensorBytes`` (PyTorch's oneDNN LSTM kernel,
its step-by-step GRU): 15h float32 values for an LSTM, 8h for a GRU. With that, the peak of a
training step of one- and two-layer LSTM networks is estimated within 1-3% on a CPU, of a
one-layer GRU within 1%, of two GRU layers about 10% high. cuDNN keeps a different
reserve on a GPU: not yet measured. Parameters follow ``nn.LSTM``/``nn.GRU`` (two bias
vectors).
"""

from __future__ import annotations

from dl4py.config.layers import Shape
from dl4py.config.recurrent import GRU, LSTM, EmbeddingLayer, EmbeddingSequenceLayer, LastTimeStep, RnnOutputLayer
from dl4py.errors import ConfigError


def steps(config) -> int:
    """The sequence length an estimate uses: the recurrent input type's ``length``."""
    length = getattr(config.input_type, "length", None)
    if length is None:
        raise ConfigError(
            "network.input_type.length",
            "is needed to estimate memory for sequences: give the length (the longest, or a "
            "typical batch's) in InputType.recurrent(size, length)",
        )
    return length


def elements(shape: Shape, config) -> int:
    """Elements per example of ``shape``, a variable-length sequence at ``steps(config)``."""
    if shape.kind == "rnn" and shape.dims[0] is None:
        return steps(config) * shape.dims[1]
    return shape.size


def sequence_ops(layer, index: int, shapes, config, l2: float, op_type) -> list:
    """The Ops of one recurrent or embedding layer (``op_type`` is operations.Op)."""
    n_in, n_out = elements(shapes.input, config), elements(shapes.output, config)
    if isinstance(layer, LastTimeStep):
        inner = sequence_ops(layer.layer, index, _Shapes(shapes.input, layer.layer.output_shape(shapes.input, "")),
                             config, l2, op_type)
        return inner + [op_type(index, "last_time_step", n_out, False, False)]
    if isinstance(layer, (LSTM, GRU)):
        gates = 4 if isinstance(layer, LSTM) else 3
        h, size = layer.n_out, shapes.input.dims[1]
        time = n_out // h
        params = ((gates * h * size, l2), (gates * h * h, l2), (gates * h, 0.0), (gates * h, 0.0))
        # Saved per step for backward and the backward kernels' temporaries, float32, as
        # measured on a CPU (LiveTensorBytes): 15h for an LSTM, 8h for a GRU.
        saved = 4.0 * time * (15 if isinstance(layer, LSTM) else 8) * h
        # Its result, then the result times the mask (kept by the multiply): two outputs.
        return [op_type(index, layer.type_name, n_out, True, True, extra_bytes=saved, params=params),
                op_type(index, "mask", n_out, False, False)]
    if isinstance(layer, (EmbeddingLayer, EmbeddingSequenceLayer)):
        indices = 8.0 * (n_in)  # the int64 indices, kept for the weight's gradient
        ops = [op_type(index, "embedding", n_out, False, False, extra_bytes=indices,
                       params=((layer.vocab_size * layer.n_out, l2),))]
        if isinstance(layer, EmbeddingSequenceLayer):
            ops.append(op_type(index, "mask", n_out, False, False))
        return ops
    if isinstance(layer, RnnOutputLayer):
        size = shapes.input.dims[1]
        params = ((size * layer.n_out, l2),) + (((layer.n_out, 0.0),) if layer.has_bias else ())
        return [op_type(index, "linear", n_out, True, False, params=params, autocast=True)]
    raise TypeError(f"the memory estimator has no rule for layer type {type(layer).__name__}")


class _Shapes:
    def __init__(self, input: Shape, output: Shape):
        self.input, self.output = input, output
