"""dl4py's own recurrent step loops, for the cells PyTorch's kernels lack: DL4J's GravesLSTM
(peepholes), an LSTM or SimpleRnn with any activation, and both directions of a Bidirectional.

Every module here holds its parameters under ``nn.LSTM``'s / ``nn.RNN``'s names (the backward
direction's end in ``_reverse``; ``dl4j/param_layout.py`` maps DL4J's to them) and has
``run(x, suffix)``: one direction over ``x`` ``[batch, time, size]`` from zero states, its
output ``[batch, time, n]``. Its ``forward(x)`` is ``(run(x), None)``, as ``nn.LSTM``'s is
``(output, states)``, so ``nn/recurrent.py``'s RecurrentOp runs it as it runs ``nn.LSTM``.

DL4J's equations (``LSTMHelpers.activateHelper``, ``SimpleRnn.activateHelper``), per step,
with x_t W + b computed for all steps at once (``x W`` here is ``x @ weight_ih.T``):

- LSTM: ``z = x_t W + h_{t-1} RW + b``, in torch's gate order i, f, g, o;
  ``i = gate(z_i + c_{t-1} * p_i)``, ``f = gate(z_f + c_{t-1} * p_f)``, ``g = act(z_g)``,
  ``c_t = f * c_{t-1} + i * g``, ``o = gate(z_o + c_t * p_o)``, ``h_t = o * act(c_t)``. The
  peephole vectors ``p`` are GravesLSTM's only (the output gate's sees the *new* cell state);
  ``gate`` is sigmoid or DL4J's HardSigmoid. DL4J's blocks (cell input, forget, output, input
  modulation) are torch's g, f, o, i.
- SimpleRnn: ``h_t = act(x_t W + h_{t-1} RW + b)``.

The loops run time-major (``[time, batch, size]``, as PyTorch's LSTM on a CPU does): their
result is a ``[batch, time, n]`` view of a time-major tensor, which a next recurrent layer
reads without a copy. ``memory/recurrent_cell_ops.py`` counts what autograd saves per step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dl4py.nn.convolution import cpu_autocast_upcasts
from dl4py.nn.layer_init import init_weight

DIRECTIONS = ("", "_reverse")


def hard_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """DL4J's HardSigmoid: ``min(1, max(0, 0.2 x + 0.5))`` (PyTorch's hardsigmoid is x/6 + 1/2)."""
    return torch.clamp(x * 0.2 + 0.5, 0.0, 1.0)


GATES = {"sigmoid": torch.sigmoid, "hardsigmoid": hard_sigmoid}


class _CellParameters(nn.Module):
    """Weights ``[gates n, size]``, recurrent weights ``[gates n, n]`` and two biases per
    direction, named as ``nn.LSTM``'s (``weight_ih_l0``, ..., ``bias_hh_l0_reverse``), and
    ``peephole_{gate}_l0`` vectors ``[n]`` for each of ``peepholes``."""

    def __init__(self, size: int, n: int, gates: int, directions: int, peepholes: tuple[str, ...] = ()):
        super().__init__()
        self.hidden_size = n
        self.peepholes = peepholes
        self.bidirectional = directions == 2  # as nn.LSTM's
        for suffix in DIRECTIONS[:directions]:
            self.register_parameter(f"weight_ih_l0{suffix}", nn.Parameter(torch.empty(gates * n, size)))
            self.register_parameter(f"weight_hh_l0{suffix}", nn.Parameter(torch.empty(gates * n, n)))
            self.register_parameter(f"bias_ih_l0{suffix}", nn.Parameter(torch.zeros(gates * n)))
            self.register_parameter(f"bias_hh_l0{suffix}", nn.Parameter(torch.zeros(gates * n)))
            for gate in self.peepholes:
                self.register_parameter(f"peephole_{gate}_l0{suffix}", nn.Parameter(torch.zeros(n)))

    def forward(self, x):
        return self.run(x, ""), None

    def _projected(self, x: torch.Tensor, suffix: str) -> tuple[torch.Tensor, ...]:
        """``x W + b`` for every step at once, time-major, one ``[batch, gates n]`` per step."""
        bias = getattr(self, f"bias_ih_l0{suffix}") + getattr(self, f"bias_hh_l0{suffix}")
        return F.linear(x.transpose(0, 1).contiguous(), getattr(self, f"weight_ih_l0{suffix}"), bias).unbind(0)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, bidirectional={self.bidirectional}"


class LoopLSTM(_CellParameters):
    """DL4J's LSTM (``peepholes=False``, any activation) or GravesLSTM (``peepholes=True``),
    one or two directions. ``activation``: a module of ``layer_init.ACTIVATIONS``; ``gate``
    a name of ``GATES``."""

    def __init__(self, size: int, n: int, directions: int, peepholes: bool, activation: nn.Module,
                 gate: str = "sigmoid"):
        super().__init__(size, n, 4, directions, ("f", "o", "i") if peepholes else ())
        self.activation = activation
        self.gate_name = gate

    def run(self, x: torch.Tensor, suffix: str) -> torch.Tensor:
        recurrent = getattr(self, f"weight_hh_l0{suffix}").t()
        peep = {g: getattr(self, f"peephole_{g}_l0{suffix}") for g in self.peepholes}
        h = x.new_zeros(x.shape[0], self.hidden_size)
        c = torch.zeros_like(h)
        outputs = []
        for projected in self._projected(x, suffix):
            h, c = self._step(torch.addmm(projected, h, recurrent), c, peep)
            outputs.append(h)
        return torch.stack(outputs).transpose(0, 1)

    def _step(self, z: torch.Tensor, c: torch.Tensor, peep: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """One step from its pre-activations ``z``; a function of its own, so that its views of
        ``z`` are gone when it returns (memory/recurrent_cell_ops.py counts on it)."""
        gate, act = GATES[self.gate_name], self.activation
        i, f, g, o = z.chunk(4, 1)
        if peep:  # the input and forget gates see the previous cell state
            i, f = i + c * peep["i"], f + c * peep["f"]
        c = gate(f) * c + gate(i) * act(g)
        if peep:  # the output gate sees the new one
            o = o + c * peep["o"]
        return gate(o) * act(c), c

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, peepholes={bool(self.peepholes)}, gate={self.gate_name}"


class LoopRnn(_CellParameters):
    """DL4J's SimpleRnn, one or two directions, any activation (a module)."""

    def __init__(self, size: int, n: int, directions: int, activation: nn.Module):
        super().__init__(size, n, 1, directions)
        self.activation = activation

    def run(self, x: torch.Tensor, suffix: str) -> torch.Tensor:
        recurrent = getattr(self, f"weight_hh_l0{suffix}").t()
        h = x.new_zeros(x.shape[0], self.hidden_size)  # DL4J's first step has no recurrent term: the same
        outputs = []
        for projected in self._projected(x, suffix):
            h = self.activation(torch.addmm(projected, h, recurrent))
            outputs.append(h)
        return torch.stack(outputs).transpose(0, 1)


class KernelLSTM(nn.LSTM):
    """``nn.LSTM`` (tanh; cuDNN on a GPU) whose directions a Bidirectional runs one at a time
    (``run``), each over its own (reversed) input."""

    def run(self, x: torch.Tensor, suffix: str) -> torch.Tensor:
        if x.device.type == "cpu" and cpu_autocast_upcasts():
            # As RecurrentOp: oneDNN's 16-bit LSTM fails on a CPU without native 16-bit kernels.
            with torch.autocast("cpu", enabled=False):
                return self._run(x.float(), suffix)
        return self._run(x, suffix)

    def _run(self, x: torch.Tensor, suffix: str) -> torch.Tensor:
        zeros = x.new_zeros(1, x.shape[0], self.hidden_size)
        return torch.lstm(x, (zeros, zeros), _weights(self, suffix), True, 1, 0.0, self.training, False, True)[0]


class KernelGRU(nn.GRU):
    """``nn.GRU`` whose directions a Bidirectional runs one at a time (``run``)."""

    def run(self, x: torch.Tensor, suffix: str) -> torch.Tensor:
        zeros = x.new_zeros(1, x.shape[0], self.hidden_size)
        return torch.gru(x, zeros, _weights(self, suffix), True, 1, 0.0, self.training, False, True)[0]


def _weights(rnn: nn.RNNBase, suffix: str) -> list[torch.Tensor]:
    return [getattr(rnn, f"{name}_l0{suffix}") for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]


def init_cell(rnn: nn.Module, scheme: str, gen: torch.Generator, forget_gate_bias: float | None = None) -> None:
    """Weights (and peephole vectors) by ``scheme``, biases zero; an LSTM's forget gate bias
    (torch's second block of ``bias_ih``) set to ``forget_gate_bias``."""
    for name, param in rnn.named_parameters():
        if name.startswith("weight"):
            init_weight(param, scheme, gen)
        elif name.startswith("peephole"):
            _init_vector(param, scheme, gen)
        else:
            nn.init.zeros_(param)
    if forget_gate_bias is not None:
        n = rnn.hidden_size
        with torch.no_grad():
            for suffix in DIRECTIONS[: 2 if rnn.bidirectional else 1]:
                getattr(rnn, f"bias_ih_l0{suffix}")[n:2 * n] = forget_gate_bias


def _init_vector(vector: torch.Tensor, scheme: str, gen: torch.Generator) -> None:
    """A peephole vector as one column of the recurrent weights (DL4J initialises ``RW`` with
    its peephole columns as one matrix): fans n and 4n."""
    n = vector.shape[0]
    column = torch.empty(4 * n, n, dtype=vector.dtype)
    init_weight(column, scheme, gen)
    with torch.no_grad():
        vector.copy_(column[:n, 0])
