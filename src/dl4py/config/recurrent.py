"""Recurrent and embedding layer configurations: LSTM, GRU, LastTimeStep, RnnOutputLayer,
EmbeddingLayer, EmbeddingSequenceLayer (DL4J's names); DL4J's other recurrent layers are in
``recurrent_extra.py``.

Sequences are ``Shape("rnn", (time, size))``, time None for any length, and travel as
``[batch, time, size]`` tensors (batch first). A layer that needs sequences says so, naming
the layer and what to put before it, when it gets anything else; ``docs/layers.md`` has the
data layout and how masks for padded sequences flow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, Optional

from dl4py.config.layers import (
    Activation,
    Layer,
    OutputLayer,
    Shape,
    WeightInit,
    _check_positive,
    _ParamLayer,
)
from dl4py.config.schema import join
from dl4py.errors import ConfigError


def need_sequences(layer: Layer, shape: Shape, where: str) -> None:
    if shape.kind != "rnn":
        given = "a flat vector" if shape.kind == "ff" else "convolutional [channels, height, width]"
        raise ConfigError(
            where,
            f"{layer.type_name} needs recurrent input [time, size], but the previous layer gives "
            f"{given} input of shape {shape}; use InputType.recurrent(size, length) or put it "
            "after a recurrent or embedding_sequence layer",
        )


class SequenceRecurrent(Layer):
    """A layer that runs over a sequence step by step, ``[time, size] -> [time, n]``: what
    LastTimeStep may wrap (LSTM, GRU and ``recurrent_extra.py``'s layers)."""


@dataclass(frozen=True, kw_only=True)
class _RecurrentLayer(_ParamLayer, SequenceRecurrent):
    """Fields of a one-direction recurrent layer. ``activation`` is the cell's output
    activation, None for DL4J's default tanh (the network's default does not apply here).
    GRU's is tanh only (PyTorch's kernels have no other); LSTM and ``recurrent_extra.py``'s
    layers take any."""

    takes_sequences: ClassVar[bool] = True
    n_out: int
    activation: Optional[Literal["tanh"]] = None
    weight_init: Optional[WeightInit] = None

    def validate(self, where: str) -> None:
        _check_positive(self, where, "n_out")

    def output_shape(self, shape: Shape, where: str) -> Shape:
        need_sequences(self, shape, where)
        return Shape("rnn", (shape.dims[0], self.n_out))


@Layer.register("lstm")
@dataclass(frozen=True, kw_only=True)
class LSTM(_RecurrentLayer):
    """DL4J's ``LSTM`` (no peepholes), as PyTorch's ``nn.LSTM``: cuDNN on a GPU. Another
    ``activation`` than tanh (DL4J allows any, e.g. ReLU) runs dl4py's own step loop
    (``nn/recurrent_cells.py``) with the same parameters; the gates stay sigmoid.
    ``forget_gate_bias_init`` is DL4J's (1.0): the forget gate starts open."""

    activation: Optional[Activation] = None
    forget_gate_bias_init: float = 1.0


@Layer.register("gru")
@dataclass(frozen=True, kw_only=True)
class GRU(_RecurrentLayer):
    """A gated recurrent unit, as PyTorch's ``nn.GRU`` (cuDNN on a GPU)."""


@Layer.register("last_time_step")
@dataclass(frozen=True)
class LastTimeStep(Layer):
    """DL4J's ``LastTimeStep`` wrapper: the wrapped recurrent layer's output at each
    sequence's last real step (the mask says which), ``[time, size] -> [size]``. In YAML
    ``{type: last_time_step, layer: {type: lstm, n_out: 32}}``."""

    layer: Layer

    has_params: ClassVar[bool] = True  # the wrapped layer's
    takes_sequences: ClassVar[bool] = True

    def validate(self, where: str) -> None:
        if not isinstance(self.layer, SequenceRecurrent):
            raise ConfigError(
                join(where, "layer"),
                "must be a recurrent layer (lstm, gru, graves_lstm, graves_bidirectional_lstm, "
                f"simple_rnn or bidirectional), got {self.layer.type_name!r}",
            )

    def output_shape(self, shape: Shape, where: str) -> Shape:
        inner = self.layer.output_shape(shape, join(where, "layer"))
        return Shape("ff", (inner.dims[1],))


@Layer.register("rnn_output")
@dataclass(frozen=True)
class RnnOutputLayer(OutputLayer):
    """DL4J's ``RnnOutputLayer``: a dense layer and a loss at every time step. Labels are
    ``[batch, time]`` class indices or ``[batch, time, n_out]`` targets; with a mask the
    loss is the mean over real steps only."""

    takes_sequences: ClassVar[bool] = True

    def output_shape(self, shape: Shape, where: str) -> Shape:
        if shape.kind != "rnn":
            raise ConfigError(
                where,
                f"rnn_output needs recurrent input [time, size] (one output per step), but the "
                f"previous layer gives {shape.kind} input of shape {shape}; for one output per "
                "example use an output layer (after LastTimeStep for sequences)",
            )
        return Shape("rnn", (shape.dims[0], self.n_out))


def _need_indices(layer: Layer, shape: Shape, where: str, kind: str) -> None:
    if shape.kind != kind or shape.dims[-1] != 1:
        want = "feed_forward(1)" if kind == "ff" else "recurrent(1, length)"
        raise ConfigError(
            where,
            f"{layer.type_name} takes integer indices, one per {'example' if kind == 'ff' else 'step'} "
            f"(input type {want}, the first layer), but its input is {shape.kind} of shape {shape}",
        )


@dataclass(frozen=True, kw_only=True)
class _Embedding(_ParamLayer):
    """``vocab_size`` is DL4J's ``nIn`` (the number of distinct indices): it cannot be
    inferred from the input, which holds one index per example or step."""

    vocab_size: int
    n_out: int
    activation: Optional[Activation] = None  # None: identity (not the network's default)
    weight_init: Optional[WeightInit] = None

    def validate(self, where: str) -> None:
        _check_positive(self, where, "vocab_size", "n_out")


@Layer.register("embedding")
@dataclass(frozen=True, kw_only=True)
class EmbeddingLayer(_Embedding):
    """DL4J's ``EmbeddingLayer``: one index per example -> a vector of ``n_out``."""

    def output_shape(self, shape: Shape, where: str) -> Shape:
        _need_indices(self, shape, where, "ff")
        return Shape("ff", (self.n_out,))


@Layer.register("embedding_sequence")
@dataclass(frozen=True, kw_only=True)
class EmbeddingSequenceLayer(_Embedding):
    """DL4J's ``EmbeddingSequenceLayer``: one index per step -> a sequence of vectors."""

    takes_sequences: ClassVar[bool] = True

    def output_shape(self, shape: Shape, where: str) -> Shape:
        _need_indices(self, shape, where, "rnn")
        return Shape("rnn", (shape.dims[0], self.n_out))
