"""DL4J's recurrent layers mapped onto dl4py's: LSTM (any activation), GravesLSTM (peepholes),
GravesBidirectionalLSTM, SimpleRnn, and the Bidirectional and LastTimeStep wrappers around them.

DL4J's gates are sigmoid by default; GravesLSTM and GravesBidirectionalLSTM may also have its
HardSigmoid gates, dl4py's ``gate_activation``. dl4py's LSTM keeps PyTorch's kernel (cuDNN on a
GPU) for tanh and runs its own step loop for any other activation, with the same parameters.
Where each parameter goes is ``param_layout``'s (LSTM, GravesLSTM, SimpleRnn and Bidirectional
layouts): the modules hold them under ``rnn``, the backward direction's names ending in
``_reverse``.
"""

from __future__ import annotations

from dl4py.config.recurrent import LSTM, LastTimeStep
from dl4py.config.recurrent_extra import Bidirectional, GravesBidirectionalLSTM, GravesLSTM, SimpleRnn
from dl4py.dl4j.json_dialects import LayerFields, inner_layer, number, typed, wrapped_layer
from dl4py.dl4j.mapping_state import NetworkMapping

# DL4J's Bidirectional.Mode -> dl4py's mode.
_MODES = {"CONCAT": "concat", "ADD": "add", "MUL": "mul", "AVERAGE": "average"}


def map_lstm(mapping: NetworkMapping, fields: LayerFields) -> None:
    mapping.add_with_dropout(fields, recurrent_layer(fields, mapping), "op")


def map_bidirectional(mapping: NetworkMapping, fields: LayerFields) -> None:
    forward, backward = inner_layer(fields, "fwd"), inner_layer(fields, "bwd")
    if forward is None:
        raise fields.error("a Bidirectional without the layer it wraps (fwd)")
    if backward is not None and backward.layer.kind != forward.layer.kind:
        raise fields.error(f"a Bidirectional whose directions differ ({forward.layer.kind}, {backward.layer.kind}): "
                           "dl4py runs one layer both ways")
    mode = _MODES.get(str(fields.get("mode", "CONCAT")).upper())
    if mode is None:
        raise fields.error(f"Bidirectional mode {fields.get('mode')!r}: dl4py has CONCAT, ADD, MUL and AVERAGE")
    layer = Bidirectional(layer=recurrent_layer(forward, mapping), mode=mode)
    # Dropout on the input: the wrapper's, else its layer's (DL4J's Bidirectional hands the input to both copies).
    mapping.add_with_dropout(fields if fields.get("idropout") is not None else forward, layer, "op")


def map_last_time_step(mapping: NetworkMapping, fields: LayerFields) -> None:
    inner = wrapped_layer(fields)
    if inner.layer.kind not in _RECURRENT:
        raise inner.error(f"LastTimeStep around {inner.layer.kind}: dl4py wraps its recurrent layers only "
                          f"({', '.join(sorted(_RECURRENT))})")
    mapping.add_with_dropout(inner, LastTimeStep(layer=recurrent_layer(inner, mapping)), "op.op")


def recurrent_layer(fields: LayerFields, mapping: NetworkMapping):
    """The dl4py layer of a DL4J recurrent layer (the ones a wrapper may hold too)."""
    kind = fields.layer.kind
    if kind not in _RECURRENT:
        raise fields.error(f"dl4py has no recurrent counterpart for DL4J's {kind}")
    if fields.get("hasLayerNorm"):
        raise fields.error(f"a {kind} with layer normalization (hasLayerNorm) has no dl4py counterpart")
    activation = fields.activation(default="tanh")
    if kind == "SimpleRnn":
        return SimpleRnn(n_out=fields.n_out, activation=activation, l2=mapping.l2(fields), **mapping.common(fields))
    forget_bias = number(fields.raw.get("forgetGateBiasInit"), 1.0)
    gate = _gate_activation(fields)
    if kind == "LSTM":
        if gate != "sigmoid":
            raise fields.error(f"LSTM gate activation {gate}: dl4py's LSTM gates are sigmoid (GravesLSTM's may be "
                               "hardsigmoid)")
        mapping.l2_from_network(fields)  # dl4py's LSTM has no l2 field
        return LSTM(n_out=fields.n_out, activation=activation, forget_gate_bias_init=forget_bias,
                    **mapping.common(fields))
    cls = GravesLSTM if kind == "GravesLSTM" else GravesBidirectionalLSTM
    return cls(n_out=fields.n_out, activation=activation, gate_activation=gate, forget_gate_bias_init=forget_bias,
               l2=mapping.l2(fields), **mapping.common(fields))


def _gate_activation(fields: LayerFields) -> str:
    name, _ = typed(fields.raw.get("gateActivationFn"))
    key = (name or "sigmoid").lower().removeprefix("activation")
    if key not in ("sigmoid", "hardsigmoid"):
        raise fields.error(f"gate activation {name}: dl4py's recurrent gates are sigmoid or hardsigmoid")
    return key


# DL4J has no GRU layer: nothing maps onto dl4py's.
_RECURRENT = {"LSTM", "GravesLSTM", "GravesBidirectionalLSTM", "SimpleRnn"}
