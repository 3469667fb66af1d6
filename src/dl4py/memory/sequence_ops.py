"""Memory rules of the recurrent and embedding layers (config/recurrent.py), registered under
their type names (``config/registry.py``) for ``operations.layer_ops``.

Per example, a sequence of ``time`` steps (the input type's ``length``: an estimate needs
one; a variable-length input is estimated at the length it is given) costs ``time`` times a
step. Each LSTM/GRU layer is one single-layer ``nn.LSTM``/``nn.GRU`` (batch first, two bias
vectors); its result is multiplied by the batch's mask (SequenceDataSetIterator always gives
one), a second result.

On a CPU (``device="cpu"``), as PyTorch runs them and ``LiveTensorBytes`` sees them:

- LSTM: oneDNN's kernel (``mkldnn_rnn_layer``). It reads a time-major contiguous copy of the
  input (``[time, batch, size]``, saved for backward) and saves its output, zero initial
  states, final states and a workspace. The workspace is oneDNN's (``rnn_utils``): gates
  ``time*4h``, ``time*h`` for h_t, states of the input's and the output's width
  ``2(time+1)*max(size, h)``, cell states ``2(time+1)*h``, and for training the diff states
  (two of ``2(time+1)*max(size, h)``, one of ``2(time+1)*h``), float32 per example, rows padded
  to 16 floats, each part starting on a 4096-byte page. Wide inputs cost more because the
  states are as wide as the input.
- GRU: ATen's step-by-step cells. The time-major copy of the input (saved by the input
  projection), the projection ``time*3h`` for all steps (alive in the layer only), and per
  step the hidden projection (3h: the gates, updated in place), and four h-sized results
  (``r*n``'s copy, ``n``, ``h - n``, the new ``h``), all saved for backward.

With cuDNN (``device="cuda"``) the reserve is not yet measured: the rule there is the older
per-step count (15h float32 values for an LSTM, 8h for a GRU, no input copy).

dl4py's own step loops (GravesLSTM, SimpleRnn, an LSTM whose activation is not tanh) are the
same operators on both devices: the time-major input copy, then ``recurrent_cell_ops``'s
projection and steps. A Bidirectional (and GravesBidirectionalLSTM) is its forward direction,
the input reversed in its real steps (a gather, keeping its int64 step order), the backward
direction, its output reversed back, and the combination (``mode``); the forward direction's
output waits for the combination.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from dl4py.config.layers import Shape
from dl4py.config.network import LayerShapes
from dl4py.config.registry import LAYERS
from dl4py.errors import ConfigError
from dl4py.memory.op import Op, param_sizes, weight_decay
from dl4py.memory.recurrent_cell_ops import lstm_loop_ops, rnn_loop_ops


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


# Rules (config/registry.py): (layer, index, LayerShapes, defaults, device) -> its Ops, per example.


@LAYERS.memory_rule("last_time_step")
def _last_time_step(layer, index: int, shapes: LayerShapes, config, device: str) -> list[Op]:
    inner = layer.layer
    inner_shapes = LayerShapes(index, inner, shapes.input, inner.output_shape(shapes.input, ""))
    ops = LAYERS.memory_rule_for(inner)(inner, index, inner_shapes, config, device)
    return ops + [Op(index, "last_time_step", elements(shapes.output, config), False, False)]


class _Cell(NamedTuple):
    """What differs between an LSTM and a GRU here."""

    gates: int  # weight blocks
    cpu_rule: Callable[..., list[Op]]  # its CPU kernel's Ops: _cpu_lstm or _cpu_gru
    # cuDNN: saved per step and unit for backward and the backward kernels' temporaries,
    # float32 (measured on a CPU before its kernels were modelled).
    cudnn_floats: int


@LAYERS.memory_rule("lstm", "gru", "graves_lstm", "simple_rnn")
def _recurrent(layer, index: int, shapes: LayerShapes, config, device: str) -> list[Op]:
    time = elements(shapes.output, config) // layer.n_out
    ops = _direction_ops(layer, index, time, shapes.input.dims[1], config, device)
    # The result times the batch's mask (kept by the multiply): a second output. Every kernel
    # but cuDNN's gives a time-major result.
    return ops + [Op(index, "mask", time * layer.n_out, False, False, time_major=ops[-1].time_major)]


@LAYERS.memory_rule("graves_bidirectional_lstm", "bidirectional")
def _bidirectional(layer, index: int, shapes: LayerShapes, config, device: str) -> list[Op]:
    inner, mode = (layer.layer, layer.mode) if layer.type_name == "bidirectional" else (layer, "add")
    size, h = shapes.input.dims[1], inner.n_out
    time = elements(shapes.output, config) // shapes.output.dims[1]
    forward = _direction_ops(inner, index, time, size, config, device)
    order = 8.0 * time  # reverse_steps' int64 step order, kept by its gather
    # The forward direction's result, held until the combination.
    ops = forward + [Op(index, "reverse_input", time * size, False, False, extra_bytes=order + 4.0 * time * h)]
    ops += _direction_ops(inner, index, time, size, config, device)
    # Gather keeps its input (the backward direction's result) besides the step order.
    ops.append(Op(index, "reverse_output", time * h, True, False, extra_bytes=order))
    if mode == "concat":  # its backward hands on slices of the gradient
        ops.append(Op(index, "concat", 2 * time * h, False, False, input_gradient="same"))
    elif mode == "mul":  # each direction's result kept for the other's gradient
        ops.append(Op(index, "mul", time * h, True, False, extra_bytes=4.0 * time * h))
    else:
        ops.append(Op(index, "add", time * h, False, False, input_gradient="same"))
        if mode == "average":
            ops.append(Op(index, "half", time * h, False, False))
    # The combination follows the forward direction's layout (time-major); a concatenation's is new.
    width = shapes.output.dims[1]
    return ops + [Op(index, "mask", time * width, False, False, time_major=mode != "concat" and forward[-1].time_major)]


def _direction_ops(layer, index: int, time: int, size: int, config, device: str) -> list[Op]:
    """One direction of a recurrent layer, from its input to its (unmasked) result."""
    h, l2 = layer.n_out, weight_decay(layer, config)
    activation = layer.activation or "tanh"
    kernel = _GRU if layer.type_name == "gru" else _LSTM if layer.type_name == "lstm" and activation == "tanh" else None
    if kernel is not None:
        gates = kernel.gates
        params = ((gates * h * size, l2), (gates * h * h, l2), (gates * h, 0.0), (gates * h, 0.0))
        if device == "cpu":
            return kernel.cpu_rule(index, time, size, h, params)
        saved = 4.0 * time * kernel.cudnn_floats * h
        return [Op(index, layer.type_name, time * h, True, True, extra_bytes=saved, params=params)]
    copy = _time_major_copy(index, time, size)
    if layer.type_name == "simple_rnn":
        params = ((h * size, l2), (h * h, l2), (h, 0.0), (h, 0.0))
        return [copy] + rnn_loop_ops(index, time, size, h, params, activation, layer.type_name)
    peepholes = layer.type_name != "lstm"
    params = ((4 * h * size, l2), (4 * h * h, l2), (4 * h, 0.0), (4 * h, 0.0)) + ((h, l2),) * 3 * peepholes  # DL4J decays them as part of RW
    gate = "sigmoid" if layer.type_name == "lstm" else layer.gate_activation
    return [copy] + lstm_loop_ops(index, time, size, h, params, activation, gate, peepholes, layer.type_name)


@LAYERS.memory_rule("embedding")
def _embedding(layer, index: int, shapes: LayerShapes, config, device: str) -> list[Op]:
    return [_lookup(layer, index, shapes, config)]


@LAYERS.memory_rule("embedding_sequence")
def _embedding_sequence(layer, index: int, shapes: LayerShapes, config, device: str) -> list[Op]:
    # The looked-up vectors times the batch's mask: a second output.
    return [_lookup(layer, index, shapes, config), Op(index, "mask", elements(shapes.output, config), False, False)]


def _lookup(layer, index: int, shapes: LayerShapes, config) -> Op:
    indices = 8.0 * elements(shapes.input, config)  # the int64 indices, kept for the weight's gradient
    return Op(index, "embedding", elements(shapes.output, config), False, False, extra_bytes=indices,
              params=((layer.vocab_size * layer.n_out, weight_decay(layer, config)),))


@LAYERS.memory_rule("rnn_output")
def _rnn_output(layer, index: int, shapes: LayerShapes, config, device: str) -> list[Op]:
    """A dense layer at each step: its weights are the step's size by n_out."""
    size = shapes.input.dims[1]
    params = param_sizes(size * layer.n_out, layer.n_out if layer.has_bias else 0, weight_decay(layer, config))
    return [Op(index, "linear", elements(shapes.output, config), True, False, params=params, autocast=True)]


def _time_major_copy(index: int, time: int, size: int):
    """``input.transpose(0, 1).contiguous()``: a copy (a view where the input is an LSTM's or
    GRU's result, time-major already); its backward hands the gradient on."""
    return Op(index, "time_major_copy", time * size, False, False, input_gradient="same")


def _good_ld(width: int) -> int:
    """oneDNN's row length for float32 (``get_good_ld``): a multiple of 16, never of 256."""
    ld = -(-width // 16) * 16
    return ld + 16 if ld % 256 == 0 else ld


def _cpu_lstm(index: int, time: int, size: int, h: int, params) -> list:
    """oneDNN's LSTM (PyTorch's ``mkldnn_rnn_layer``) in training: what it saves, in float32
    values per example; its workspace parts are each page aligned (``set_offsets``)."""
    states = _good_ld(max(size, h))  # the states' rows hold the input's or the output's width
    workspace = (time * _good_ld(4 * h),  # gates
                 time * _good_ld(h),  # h_t
                 2 * (time + 1) * states,  # states (layer input and output)
                 2 * (time + 1) * h,  # cell states
                 2 * (time + 1) * states,  # diff states, of the layer
                 2 * (time + 1) * states,  # ... of the iteration
                 2 * (time + 1) * h)  # ... of the cell
    return [_time_major_copy(index, time, size),
            # It also keeps the zero initial h and c, and the final h and c.
            Op(index, "mkldnn_lstm", time * h, True, True, extra_bytes=4.0 * 4 * h, params=params,
               aligned_bytes=tuple(4.0 * w for w in workspace), aligned_to=4096,
               backward_scratch_elements=2 * h,  # the gradients of the initial h and c
               fused_backward=True, time_major=True)]


def _cpu_gru(index: int, time: int, size: int, h: int, params) -> list:
    """ATen's GRU on a CPU (``_rnn_impl`` over ``GRUCell``s): the input's projection for every
    step at once, then one cell per step."""
    weights_ih, weights_hh, bias_ih, bias_hh = params
    return [_time_major_copy(index, time, size),
            # x @ W_ih^T, then + b_ih: a new tensor; the product is gone after the addition.
            Op(index, "gru_input_projection", time * 3 * h, True, False, params=(weights_ih, bias_ih)),
            # Per step: the gates (3h, updated in place) and four h-sized results; the zero
            # initial h. All saved for backward, and freed step by step in backward, which
            # stacks the projection's gradient while each step's part (3h) is alive.
            Op(index, "gru_cells", time * h, False, False, extra_bytes=4.0 * (7 * h * time + h),
               params=(weights_hh, bias_hh), backward_scratch_elements=3 * h * time,
               stepwise_backward=True, time_major=True)]


# The kernels PyTorch has (their CPU rules are above).
_LSTM, _GRU = _Cell(4, _cpu_lstm, 15), _Cell(3, _cpu_gru, 8)
