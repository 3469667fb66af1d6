"""DL4J's other recurrent layers: GravesLSTM, GravesBidirectionalLSTM, SimpleRnn and the
Bidirectional wrapper (DL4J's names; ``config/recurrent.py`` has LSTM and GRU).

Each computes what DL4J's layer computes (``nn/recurrent_cells.py`` has the equations), so
that a DL4J model using them imports as it is. Sequences are ``[time, size]``; with padded
sequences the outputs at padded steps are zero, as for LSTM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, Optional

from dl4py.config.layers import Activation, Layer, Shape, _check_l2
from dl4py.config.recurrent import LSTM, GRU, SequenceRecurrent, _RecurrentLayer, need_sequences
from dl4py.config.schema import join
from dl4py.errors import ConfigError

# DL4J's gate activations: sigmoid, or its HardSigmoid min(1, max(0, 0.2 x + 0.5)).
GateActivation = Literal["sigmoid", "hardsigmoid"]
BidirectionalMode = Literal["concat", "add", "mul", "average"]


@dataclass(frozen=True, kw_only=True)
class _OwnLoopLayer(_RecurrentLayer):
    """A recurrent layer dl4py runs in its own step loop: any activation, and an L2 of its own."""

    activation: Optional[Activation] = None  # None: tanh, DL4J's default
    l2: Optional[float] = None

    def validate(self, where: str) -> None:
        super().validate(where)
        _check_l2(self, where)


@dataclass(frozen=True, kw_only=True)
class _GravesFields(_OwnLoopLayer):
    gate_activation: GateActivation = "sigmoid"
    forget_gate_bias_init: float = 1.0


@Layer.register("graves_lstm")
@dataclass(frozen=True, kw_only=True)
class GravesLSTM(_GravesFields):
    """DL4J's ``GravesLSTM``: an LSTM with peephole connections (Graves 2013; Greff et al.'s
    "vanilla" LSTM). The forget and input gates also see the previous cell state, the output
    gate the new one, each through a vector of weights (``peephole_f/i/o_l0``)."""


@Layer.register("graves_bidirectional_lstm")
@dataclass(frozen=True, kw_only=True)
class GravesBidirectionalLSTM(_GravesFields):
    """DL4J's ``GravesBidirectionalLSTM``: a forward and a backward GravesLSTM over the same
    input, their outputs *added* (DL4J sums them): ``[time, size] -> [time, n_out]``."""


@Layer.register("simple_rnn")
@dataclass(frozen=True, kw_only=True)
class SimpleRnn(_OwnLoopLayer):
    """DL4J's ``SimpleRnn``: ``out_t = activation(x_t W + out_{t-1} RW + b)``."""


# What a Bidirectional may wrap (DL4J's BidirectionalParamInitializer knows these and GRU).
_WRAPPABLE = (LSTM, GravesLSTM, SimpleRnn, GRU)


@Layer.register("bidirectional")
@dataclass(frozen=True)
class Bidirectional(SequenceRecurrent):
    """DL4J's ``Bidirectional`` wrapper: two copies of ``layer`` (own parameters), one over the
    sequence and one over it reversed (each sequence's real steps, from its last one), their
    outputs combined by ``mode`` (DL4J's ``Bidirectional.Mode``): ``concat`` (forward's then
    backward's: ``2 n_out``), ``add``, ``mul`` or ``average``. In YAML
    ``{type: bidirectional, mode: add, layer: {type: lstm, n_out: 32}}``."""

    layer: Layer
    mode: BidirectionalMode = "concat"

    has_params: ClassVar[bool] = True  # the wrapped layer's
    takes_sequences: ClassVar[bool] = True

    @property
    def l2(self) -> Optional[float]:
        """The wrapped layer's L2 (None: the network's), which the updater reads from here."""
        return getattr(self.layer, "l2", None)

    def validate(self, where: str) -> None:
        if not isinstance(self.layer, _WRAPPABLE):
            raise ConfigError(
                join(where, "layer"),
                f"must be a one-direction recurrent layer (lstm, graves_lstm, simple_rnn or gru), "
                f"got {self.layer.type_name!r}",
            )

    def output_shape(self, shape: Shape, where: str) -> Shape:
        need_sequences(self, shape, where)
        inner = self.layer.output_shape(shape, join(where, "layer"))
        width = inner.dims[1] * (2 if self.mode == "concat" else 1)
        return Shape("rnn", (inner.dims[0], width))
