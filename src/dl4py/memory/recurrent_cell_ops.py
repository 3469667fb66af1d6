"""What dl4py's own recurrent step loops (``nn/recurrent_cells.py``) keep for backward, per
example, in elements of the activations' dtype: the Ops that ``sequence_ops.py``'s rules for
GravesLSTM, SimpleRnn, a non-tanh LSTM and both directions of a Bidirectional return.

A loop is two operators: the input's projection for every step at once (``x W + b``, one
matrix product: it keeps its time-major input), then the steps. Each step's operators keep
(PyTorch's ``derivatives.yaml``) for an LSTM with sigmoid gates and a tanh (or sigmoid, relu,
softmax: they keep their result) activation: the three gates and ``act(z_g)``, the new cell
state and ``act(c)``, and ``h``, 7 n values; the pre-activation ``z`` (4 n) is freed. Where
the activation keeps its *input* (leakyrelu, gelu; softsign's ``abs``) ``z_g`` is a view of
``z``, which then lives on (4 n); softsign also keeps each ``1 + |x|`` (one n per use); an
identity keeps no ``act(c)`` but keeps ``z`` (through ``g``). DL4J's HardSigmoid keeps each
gate's ``0.2 x + 0.5`` (clamp keeps its input): 3 n. A SimpleRnn step keeps its result (n),
and ``z`` where its activation keeps its input. The outputs are stacked into one
``[time, batch, n]`` tensor (the steps' own stay saved for the next step).

Backward walks the steps in reverse, each freeing what it kept, while the input projection's
gradients pile up one per step until all are stacked (``4 n`` for an LSTM, ``n`` for a
SimpleRnn, per step, twice at the end).
"""

from __future__ import annotations

from dl4py.memory.op import Op

# Activations whose derivative autograd computes from their input (a view of the step's
# ``z`` where they read one), beyond the result every cell keeps anyway.
_SAVES_INPUT = {"leakyrelu", "gelu", "softsign"}


def lstm_loop_ops(index: int, time: int, size: int, h: int, params, activation: str, gate: str,
                  peepholes: bool, name: str) -> list[Op]:
    """The projection and steps of one LSTM direction (GravesLSTM's with ``peepholes``), after
    its time-major input copy. ``params``: (weight_ih, weight_hh, bias_ih, bias_hh) as
    ``(elements, l2)``, then the peephole vectors."""
    per_step = 7 + 3 * (gate == "hardsigmoid")
    if activation in _SAVES_INPUT or activation == "identity":
        per_step += 4  # z lives on, through act(z_g)'s input or g itself
    if activation == "identity":
        per_step -= 2  # act(z_g) is a view of z, act(c) is c
    if activation == "softsign":
        per_step += 2  # 1 + |z_g| and 1 + |c|
    # The last cell state is kept by the output gate's peephole, or by h = o * c; the last
    # output waits for the stacking.
    last = h * (1 + (peepholes or activation == "identity"))
    return _loop(index, time, h, 4, params, per_step * h * time + last, name)


def rnn_loop_ops(index: int, time: int, size: int, h: int, params, activation: str, name: str) -> list[Op]:
    """The projection and steps of one SimpleRnn direction, after its time-major input copy."""
    if activation in _SAVES_INPUT:
        # z and the result (kept by the next step), softsign's 1 + |z|; the zero h_0.
        kept = (2 + (activation == "softsign")) * h * time
    else:  # the result of each step (an identity's last is kept by nothing) and h_0
        kept = h * (time + (activation != "identity"))
    return _loop(index, time, h, 1, params, kept, name)


def _loop(index: int, time: int, h: int, gates: int, params, kept: float, name: str) -> list[Op]:
    weights_ih, weights_hh, bias_ih, bias_hh, *peepholes = params
    return [
        # F.linear(x, W_ih, b_ih + b_hh) over all steps: one product, keeping its input.
        Op(index, f"{name}_input_projection", time * gates * h, True, False, params=(weights_ih, bias_ih, bias_hh)),
        Op(index, f"{name}_steps", time * h, False, False, extra_bytes=4.0 * kept,
           params=(weights_hh, *peepholes), backward_scratch_elements=gates * h * time,
           stepwise_backward=True, time_major=True),
    ]
