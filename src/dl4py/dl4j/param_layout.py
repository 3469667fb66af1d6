"""Where each value of DL4J's flat parameter vector goes in dl4py's torch modules, and back.

DL4J keeps all of a MultiLayerNetwork's parameters in one row vector (``coefficients.bin``):
layer after layer, each layer's part laid out by its ``ParamInitializer`` (DL4J's
``org.deeplearning4j.nn.params``). ``param_slots`` lists them in that order, one ``ParamSlot`` per
DL4J parameter: the layer index and DL4J's key, where it starts and how many values it has, its
shape and order in DL4J, the torch ``state_dict`` entries it fills, and the two functions between
the flat segment and those entries. The updater state (``updaterState.bin``) is laid out by the
same slots, each of its blocks in this order, so it is split with the same list.

The layouts, as DL4J's sources write them:

- ``DefaultParamInitializer`` (dense, output, RNN output, most custom layers): ``W`` [nIn, nOut]
  in Fortran order, then ``b`` [nOut]. ``nn.Linear.weight`` is [nOut, nIn]: W transposed.
- ``EmbeddingLayerParamInitializer``: the same ``W`` [nIn = vocabulary, nOut], which is already
  ``nn.Embedding.weight``'s [vocabulary, nOut]; its ``b`` has no dl4py place (the import refuses it).
- ``ConvolutionParamInitializer``: ``b`` [nOut] *first*, then ``W`` [nOut, nIn, kH, kW] in C
  order: ``nn.Conv2d.weight`` as it is.
- ``BatchNormalizationParamInitializer``: ``gamma``, ``beta``, then the running ``mean`` and
  ``var`` (or, with ``useLogStd``, ``log10stdev``: var = (10 ** log10stdev) ** 2), each [nOut].
- ``LSTMParamInitializer``: ``W`` [nIn, 4n], ``RW`` [n, 4n] (Fortran order), ``b`` [4n]. The four
  column blocks are, by ``LSTMHelpers``, 0: the cell input (activation fn: torch's g), 1: the
  forget gate (f), 2: the output gate (o), 3: the "input modulation" gate that scales the cell
  input (torch's i). ``nn.LSTM`` stacks its rows i, f, g, o: DL4J's blocks 3, 1, 0, 2. DL4J has one
  bias, torch two (``bias_ih``, ``bias_hh``, which it adds): ``b`` goes to ``bias_ih``, zeros to
  ``bias_hh``; back, DL4J's ``b`` is their sum.
- ``GravesLSTMParamInitializer``: as LSTM, ``RW`` [n, 4n + 3]: its last three columns are the
  peephole weights wFF (forget gate, from the previous cell state), wOO (output gate, from the
  current one), wGG (input modulation gate, from the previous one). dl4py has no peephole
  LSTM: these slots name the entries such a module would hold (``peephole_f/o/i_l0``).
- ``GravesBidirectionalLSTMParamInitializer``: forward ``WF, RWF, bF``, then backward ``WB, RWB,
  bB``, each as GravesLSTM's; torch's names for the backward direction end in ``_reverse``.
- ``ConvolutionParamInitializer`` for a 1-D convolution (``Convolution1DLayer``): a 2-D one over
  ``[time, 1]``: ``b``, then ``W`` [nOut, nIn, k, 1] in C order, ``nn.Conv1d.weight`` [nOut, nIn, k]
  with the unit axis dropped (``kernelSize`` is ``[k, 1]`` in the file: only its first value counts).
- ``DepthwiseConvolutionParamInitializer``: ``b`` [nIn * depthMultiplier] first, then ``W`` [kH, kW, nIn,
  depthMultiplier] in C order. Output channel ``c * depthMultiplier + m`` is input channel ``c``'s
  ``m``-th map (libnd4j's ``depthwise_conv2d``), which is a grouped ``nn.Conv2d``'s order: its weight
  [nIn * depthMultiplier, 1, kH, kW] is W moved to [nIn, depthMultiplier, kH, kW].
- ``SeparableConvolutionParamInitializer``: ``b`` [nOut] first, then the depthwise ``W``
  [depthMultiplier, nIn, kH, kW] and the pointwise ``pW`` [nOut, nIn * depthMultiplier, 1, 1], both in C
  order. The depthwise maps are ordered as above (``c * depthMultiplier + m``), so ``depthwise.weight``
  is W moved to [nIn, depthMultiplier, kH, kW]; ``pointwise.weight`` is pW as it is, and the bias is
  the pointwise convolution's.
- ``DeconvolutionParamInitializer``: ``b`` first, then ``W`` [nIn, nOut, kH, kW] in C order, which
  is ``nn.ConvTranspose2d.weight`` as it is (DL4J permutes it to libnd4j's [kH, kW, nOut, nIn]).
- ``SimpleRnnParamInitializer``: ``W`` [nIn, nOut], ``RW`` [nOut, nOut] (Fortran order), ``b``
  [nOut], and with ``hasLayerNorm`` the gains ``g`` [2 nOut]. ``nn.RNN``'s ``weight_ih_l0`` and
  ``weight_hh_l0`` are W and RW transposed; its two biases as the LSTM's. dl4py has no simple RNN
  layer: these are the entries an ``nn.RNN`` module under ``rnn`` would hold.
- ``BidirectionalParamInitializer``: the wrapped layer's parameters twice, the forward copy's keys
  prefixed ``f``, then the backward copy's prefixed ``b`` (``fW, fRW, fb, bW, bRW, bb`` around an
  LSTM); torch's names for the backward direction end in ``_reverse``.
- ``SameDiffParamInitializer`` for ``SelfAttentionLayer`` (its ``defineParameters``): with
  ``projectInput``, ``Wq``, ``Wk``, ``Wv`` [nHeads, headSize, nIn] then ``Wo`` [nHeads headSize,
  nOut], all in C order (``paramReshapeOrder`` 'c'). The three input projections lie back to back,
  head after head, as the rows of dl4py's fused ``qkv`` projection (query, key, value; within each,
  head by head): they are one slot here, ``Wq+Wk+Wv``. ``Wo`` is ``out.weight`` transposed.
  Without ``projectInput``: none.
- Layers without parameters (pooling, dropout, activation, padding): none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from dl4py.dl4j import custom_layers
from dl4py.dl4j.config_json import DL4JConfiguration, DL4JLayer, LayerFields, wrapped_layer
from dl4py.dl4j.json_dialects import inner_layer
from dl4py.dl4j.ndarray import DL4JFileError

# DL4J's layer classes -> their parameter initializer.
_INITIALIZER_OF = {
    "DenseLayer": "DefaultParamInitializer", "OutputLayer": "DefaultParamInitializer",
    "RnnOutputLayer": "DefaultParamInitializer", "CenterLossOutputLayer": "DefaultParamInitializer",
    "EmbeddingLayer": "EmbeddingLayerParamInitializer", "EmbeddingSequenceLayer": "EmbeddingLayerParamInitializer",
    "ConvolutionLayer": "ConvolutionParamInitializer", "Convolution2D": "ConvolutionParamInitializer",
    "BatchNormalization": "BatchNormalizationParamInitializer", "LSTM": "LSTMParamInitializer",
    "GravesLSTM": "GravesLSTMParamInitializer",
    "GravesBidirectionalLSTM": "GravesBidirectionalLSTMParamInitializer",
    "Convolution1DLayer": "ConvolutionParamInitializer", "Convolution1D": "ConvolutionParamInitializer",
    "Deconvolution2D": "DeconvolutionParamInitializer", "SimpleRnn": "SimpleRnnParamInitializer",
    "Bidirectional": "BidirectionalParamInitializer", "SelfAttentionLayer": "SameDiffParamInitializer",
    "DepthwiseConvolution2D": "DepthwiseConvolutionParamInitializer",
    "SeparableConvolution2D": "SeparableConvolutionParamInitializer",
}
for _kind in ("SubsamplingLayer", "Pooling2D", "DropoutLayer", "ActivationLayer", "GlobalPoolingLayer",
              "ZeroPaddingLayer", "Upsampling2D", "LossLayer", "Cropping2D", "Subsampling1DLayer", "Pooling1D",
              "ZeroPadding1DLayer", "Cropping1D", "Upsampling1D", "RnnLossLayer", "CnnLossLayer"):
    _INITIALIZER_OF[_kind] = "EmptyParamInitializer"
# nn.LSTM's gate rows i, f, g, o are DL4J's column blocks 3, 1, 0, 2 (see the module docstring).
LSTM_BLOCKS = (3, 1, 0, 2)


@dataclass(frozen=True)
class ParamSlot:
    """One DL4J parameter: ``count`` values from ``offset`` of the flat vector, DL4J's array of
    ``shape`` in ``order`` ('f' or 'c'), filling the torch entries ``torch_names`` (full
    ``state_dict`` names, e.g. ``"0.op.weight"``). ``to_torch(segment)`` gives one array per
    name, in torch's shape; ``from_torch(arrays)`` gives the flat segment back."""

    layer: int
    key: str
    offset: int
    count: int
    shape: tuple[int, ...]
    order: str
    torch_names: tuple[str, ...]
    to_torch: Callable[[np.ndarray], tuple[np.ndarray, ...]]
    from_torch: Callable[[tuple[np.ndarray, ...]], np.ndarray]


def param_slots(conf: DL4JConfiguration, prefixes: dict[int, str] | None = None) -> list[ParamSlot]:
    """Every DL4J parameter of ``conf`` in the flat vector's order. ``prefixes[i]`` is the
    module path of layer i's parameters in dl4py's network (``MappedNetwork.prefixes``; without
    it, ``"{i}.op"``: DL4J's and dl4py's layer indices taken as equal)."""
    slots: list[ParamSlot] = []
    offset = 0
    for layer in conf.layers:
        fields = LayerFields(layer, conf.where)
        prefix = (prefixes or {}).get(layer.index, f"{layer.index}.op")
        try:
            layout = _layout(fields, prefix)
        except (KeyError, TypeError, ValueError) as exc:  # a size or kernel field DL4J writes, malformed
            raise fields.error(f"its parameters cannot be laid out: {exc!r}") from None
        for key, shape, order, names, to_torch, from_torch in layout:
            count = int(np.prod(shape))
            slots.append(ParamSlot(layer.index, key, offset, count, tuple(shape), order, tuple(names),
                                   to_torch, from_torch))
            offset += count
    return slots


def initializer_of(layer: DL4JLayer) -> str | None:
    """DL4J's parameter initializer for ``layer``: a registered custom class's, else its class's."""
    registered = custom_layers.custom_layer(layer.java_class)
    if registered is not None:
        return registered.initializer
    return _INITIALIZER_OF.get(layer.kind)


def split_parameters(slots: list[ParamSlot], flat: np.ndarray, where: str) -> dict[str, np.ndarray]:
    """The flat vector cut into the torch entries the slots name; a DL4JFileError naming the
    first layer it runs short for, or the surplus."""
    flat = np.asarray(flat).reshape(-1)
    check_count(slots, flat.size, where)
    out = {}
    for slot in slots:
        arrays = slot.to_torch(flat[slot.offset:slot.offset + slot.count])
        out.update(zip(slot.torch_names, arrays))
    return out


def check_count(slots: list[ParamSlot], size: int, where: str) -> None:
    """A DL4JFileError unless a flat vector of ``size`` values is exactly what ``slots`` take:
    named by the first layer it runs short for, or by the surplus."""
    need = slots[-1].offset + slots[-1].count if slots else 0
    if size != need:
        short = next((s for s in slots if s.offset + s.count > size), None)
        what = (f"runs out in layer {short.layer}'s {short.key} (values {short.offset} to "
                f"{short.offset + short.count - 1})" if short else f"has {size - need} values more")
        raise DL4JFileError(where, f"holds {size} parameters, the configuration's layers take {need}: it {what}")


def join_parameters(slots: list[ParamSlot], tensors: dict[str, np.ndarray]) -> np.ndarray:
    """The flat vector back from torch entries (numpy arrays by name): ``split_parameters``' inverse."""
    parts = [slot.from_torch(tuple(np.asarray(tensors[name]) for name in slot.torch_names)) for slot in slots]
    return np.concatenate(parts) if parts else np.zeros(0)


# ---- the layouts ---------------------------------------------------------------------------------

def _layout(fields: LayerFields, prefix: str) -> list:
    inner = wrapped_layer(fields)  # a FrozenLayer's or LastTimeStep's layer holds the parameters
    if inner is not fields:
        return _layout(inner, prefix)
    initializer = initializer_of(fields.layer)
    if initializer is None:
        raise fields.error("dl4py does not know how DL4J lays out this layer's parameters")
    registered = custom_layers.custom_layer(fields.java_class)
    names = registered.torch_names if registered is not None else {}
    return _LAYOUTS[initializer](fields, prefix, names)


def _name(prefix: str, names: dict, key: str, default: str) -> str:
    return f"{prefix}.{names.get(key, default)}"


def _sizes(fields: LayerFields, *keys: str) -> list[int]:
    values = {"nIn": fields.n_in, "nOut": fields.n_out}
    missing = [key for key in keys if not values[key] or values[key] <= 0]
    if missing:
        raise fields.error(f"{' and '.join(missing)} missing or not positive: its parameters cannot be laid out")
    return [values[key] for key in keys]


def _default(fields: LayerFields, prefix: str, names: dict) -> list:
    n_in, n_out = _sizes(fields, "nIn", "nOut")
    slots = [("W", (n_in, n_out), "f", [_name(prefix, names, "W", "weight")],
              lambda seg: (seg.reshape(n_in, n_out, order="F").T,),
              lambda arrays: arrays[0].T.reshape(-1, order="F"))]
    if fields.get("hasBias", True):
        slots.append(_vector("b", n_out, _name(prefix, names, "b", "bias")))
    return slots


def _embedding(fields: LayerFields, prefix: str, names: dict) -> list:
    n_in, n_out = _sizes(fields, "nIn", "nOut")
    slots = [("W", (n_in, n_out), "f", [_name(prefix, names, "W", "embedding.weight")],
              lambda seg: (seg.reshape(n_in, n_out, order="F"),),
              lambda arrays: arrays[0].reshape(-1, order="F"))]
    if fields.get("hasBias", fields.layer.kind != "EmbeddingSequenceLayer"):
        slots.append(_vector("b", n_out, _name(prefix, names, "b", "embedding.bias")))
    return slots


def _convolution(fields: LayerFields, prefix: str, names: dict) -> list:
    n_in, n_out = _sizes(fields, "nIn", "nOut")
    k_h, k_w = fields.pair("kernelSize")
    shape = torch_shape = (n_out, n_in, k_h, k_w)
    if fields.layer.kind in _ONE_D:  # [nOut, nIn, k, 1]: nn.Conv1d's [nOut, nIn, k]
        shape, torch_shape = (n_out, n_in, k_h, 1), (n_out, n_in, k_h)
    slots = [_vector("b", n_out, _name(prefix, names, "b", "bias"))] if fields.get("hasBias", True) else []
    slots.append(("W", shape, "c", [_name(prefix, names, "W", "weight")],
                  lambda seg: (seg.reshape(torch_shape),), lambda arrays: arrays[0].reshape(-1)))
    return slots


def _deconvolution(fields: LayerFields, prefix: str, names: dict) -> list:
    n_in, n_out = _sizes(fields, "nIn", "nOut")
    shape = (n_in, n_out) + fields.pair("kernelSize")
    slots = [_vector("b", n_out, _name(prefix, names, "b", "bias"))] if fields.get("hasBias", True) else []
    slots.append(("W", shape, "c", [_name(prefix, names, "W", "weight")],
                  lambda seg: (seg.reshape(shape),), lambda arrays: arrays[0].reshape(-1)))
    return slots


def _depthwise(fields: LayerFields, prefix: str, names: dict) -> list:
    (n_in,) = _sizes(fields, "nIn")
    multiplier = fields.integer("depthMultiplier", default=1)
    k_h, k_w = fields.pair("kernelSize")
    slots = ([_vector("b", n_in * multiplier, _name(prefix, names, "b", "bias"))]
             if fields.get("hasBias", True) else [])
    slots.append(("W", (k_h, k_w, n_in, multiplier), "c", [_name(prefix, names, "W", "weight")],
                  lambda seg: (_grouped(seg.reshape(k_h, k_w, n_in, multiplier).transpose(2, 3, 0, 1)),),
                  lambda arrays: arrays[0].reshape(n_in, multiplier, k_h, k_w).transpose(2, 3, 0, 1).reshape(-1)))
    return slots


def _separable(fields: LayerFields, prefix: str, names: dict) -> list:
    n_in, n_out = _sizes(fields, "nIn", "nOut")
    multiplier = fields.integer("depthMultiplier", default=1)
    k_h, k_w = fields.pair("kernelSize")
    slots = ([_vector("b", n_out, _name(prefix, names, "b", "pointwise.bias"))]
             if fields.get("hasBias", True) else [])
    slots.append(("W", (multiplier, n_in, k_h, k_w), "c", [_name(prefix, names, "W", "depthwise.weight")],
                  lambda seg: (_grouped(seg.reshape(multiplier, n_in, k_h, k_w).transpose(1, 0, 2, 3)),),
                  lambda arrays: arrays[0].reshape(n_in, multiplier, k_h, k_w).transpose(1, 0, 2, 3).reshape(-1)))
    slots.append(("pW", (n_out, n_in * multiplier, 1, 1), "c", [_name(prefix, names, "pW", "pointwise.weight")],
                  lambda seg: (seg.reshape(n_out, n_in * multiplier, 1, 1),), lambda arrays: arrays[0].reshape(-1)))
    return slots


def _grouped(weights: np.ndarray) -> np.ndarray:
    """[nIn, depthMultiplier, kH, kW] -> a grouped ``nn.Conv2d``'s [nIn * depthMultiplier, 1, kH, kW]."""
    n_in, multiplier, k_h, k_w = weights.shape
    return np.ascontiguousarray(weights).reshape(n_in * multiplier, 1, k_h, k_w)


def _same_diff(fields: LayerFields, prefix: str, names: dict) -> list:
    if fields.layer.kind != "SelfAttentionLayer":
        raise fields.error("dl4py does not know how this SameDiff layer defines its parameters")
    if not fields.get("projectInput", False):
        return []
    n_in, n_out = _sizes(fields, "nIn", "nOut")
    heads = fields.integer("nHeads", "nheads", default=1)
    head_size = fields.integer("headSize", default=0) or n_out // max(heads, 1)  # DL4J's builder: nOut / nHeads
    if heads <= 0 or head_size <= 0:
        raise fields.error(f"nHeads {heads} and headSize {head_size}: its parameters cannot be laid out")
    inner = heads * head_size
    projections = (3, heads, head_size, n_in)  # Wq, Wk, Wv back to back: the rows of qkv
    return [
        ("Wq+Wk+Wv", projections, "c", [_name(prefix, names, "Wq+Wk+Wv", "qkv.weight")],
         lambda seg: (seg.reshape(3 * inner, n_in),), lambda arrays: arrays[0].reshape(-1)),
        ("Wo", (inner, n_out), "c", [_name(prefix, names, "Wo", "out.weight")],
         lambda seg: (seg.reshape(inner, n_out).T,), lambda arrays: arrays[0].T.reshape(-1)),
    ]


def _batch_normalization(fields: LayerFields, prefix: str, names: dict) -> list:
    (n_out,) = _sizes(fields, "nOut")
    slots = [] if fields.get("lockGammaBeta") else [
        _vector("gamma", n_out, _name(prefix, names, "gamma", "weight")),
        _vector("beta", n_out, _name(prefix, names, "beta", "bias"))]
    slots.append(_vector("mean", n_out, _name(prefix, names, "mean", "running_mean")))
    if fields.get("useLogStd", False):
        slots.append(("log10stdev", (n_out,), "c", [_name(prefix, names, "log10stdev", "running_var")],
                      lambda seg: ((10.0 ** seg) ** 2,), lambda arrays: np.log10(np.sqrt(arrays[0]))))
    else:
        slots.append(_vector("var", n_out, _name(prefix, names, "var", "running_var")))
    return slots


def _vector(key: str, size: int, name: str):
    return key, (size,), "c", [name], lambda seg: (seg.copy(),), lambda arrays: arrays[0].reshape(-1)


def _lstm(fields: LayerFields, prefix: str, names: dict, key_prefix: str = "", suffix: str = "") -> list:
    keys = tuple(key_prefix + key for key in ("W", "RW", "b"))
    return _lstm_direction(fields, prefix, names, peepholes=False, keys=keys, suffix=suffix)


def _graves_lstm(fields: LayerFields, prefix: str, names: dict, key_prefix: str = "", suffix: str = "") -> list:
    keys = tuple(key_prefix + key for key in ("W", "RW", "b"))
    return _lstm_direction(fields, prefix, names, peepholes=True, keys=keys, suffix=suffix)


def _simple_rnn(fields: LayerFields, prefix: str, names: dict, key_prefix: str = "", suffix: str = "") -> list:
    n_in, n = _sizes(fields, "nIn", "nOut")
    w_key, rw_key, b_key, g_key = (key_prefix + key for key in ("W", "RW", "b", "g"))
    rnn = f"{prefix}.rnn"
    slots = [
        (w_key, (n_in, n), "f", [_name(rnn, names, w_key, f"weight_ih_l0{suffix}")],
         lambda seg: (seg.reshape(n_in, n, order="F").T,), lambda arrays: arrays[0].T.reshape(-1, order="F")),
        (rw_key, (n, n), "f", [_name(rnn, names, rw_key, f"weight_hh_l0{suffix}")],
         lambda seg: (seg.reshape(n, n, order="F").T,), lambda arrays: arrays[0].T.reshape(-1, order="F")),
        (b_key, (n,), "c", [_name(rnn, names, b_key, f"bias_ih_l0{suffix}"), f"{rnn}.bias_hh_l0{suffix}"],
         lambda seg: (seg.copy(), np.zeros(n, dtype=seg.dtype)), lambda arrays: arrays[0] + arrays[1]),
    ]
    if fields.get("hasLayerNorm", False):  # what a layer-normalized RNN module would hold
        slots.append(_vector(g_key, 2 * n, f"{rnn}.layer_norm_gains_l0{suffix}"))
    return slots


def _bidirectional(fields: LayerFields, prefix: str, names: dict) -> list:
    inner = inner_layer(fields, "fwd")
    direction = _DIRECTIONS.get(inner.layer.kind) if inner is not None else None
    if direction is None:
        wrapped = inner.layer.kind if inner is not None else "nothing"
        raise fields.error(f"a Bidirectional around {wrapped}: dl4py does not know how DL4J lays out its parameters")
    return direction(inner, prefix, names, "f", "") + direction(inner, prefix, names, "b", "_reverse")


def _graves_bidirectional(fields: LayerFields, prefix: str, names: dict) -> list:
    return (_lstm_direction(fields, prefix, names, True, ("WF", "RWF", "bF"), "")
            + _lstm_direction(fields, prefix, names, True, ("WB", "RWB", "bB"), "_reverse"))


def _lstm_direction(fields, prefix, names, peepholes: bool, keys, suffix: str) -> list:
    n_in, n = _sizes(fields, "nIn", "nOut")
    rows = np.concatenate([np.arange(block * n, (block + 1) * n) for block in LSTM_BLOCKS])
    recurrent_columns = 4 * n + (3 if peepholes else 0)
    w_key, rw_key, b_key = keys
    rnn = f"{prefix}.rnn"

    def gates_to_torch(matrix):  # DL4J's [size, 4n] -> torch's [4n, size], rows i, f, g, o
        return matrix[:, rows].T

    def gates_from_torch(matrix):
        out = np.empty((matrix.shape[1], 4 * n), dtype=matrix.dtype)
        out[:, rows] = matrix.T
        return out

    def recurrent_to_torch(seg):
        rw = seg.reshape(n, recurrent_columns, order="F")
        out = (gates_to_torch(rw[:, :4 * n]),)
        return out + ((rw[:, 4 * n].copy(), rw[:, 4 * n + 1].copy(), rw[:, 4 * n + 2].copy()) if peepholes else ())

    def recurrent_from_torch(arrays):
        rw = np.concatenate([gates_from_torch(arrays[0])] + [a.reshape(n, 1) for a in arrays[1:]], axis=1)
        return rw.reshape(-1, order="F")

    recurrent_names = [_name(rnn, names, rw_key, f"weight_hh_l0{suffix}")]
    if peepholes:  # the names a peephole LSTM module would hold; dl4py has none yet
        recurrent_names += [f"{rnn}.peephole_{gate}_l0{suffix}" for gate in "foi"]
    return [
        (w_key, (n_in, 4 * n), "f", [_name(rnn, names, w_key, f"weight_ih_l0{suffix}")],
         lambda seg: (gates_to_torch(seg.reshape(n_in, 4 * n, order="F")),),
         lambda arrays: gates_from_torch(arrays[0]).reshape(-1, order="F")),
        (rw_key, (n, recurrent_columns), "f", recurrent_names, recurrent_to_torch, recurrent_from_torch),
        (b_key, (4 * n,), "c",
         [_name(rnn, names, b_key, f"bias_ih_l0{suffix}"), f"{rnn}.bias_hh_l0{suffix}"],
         lambda seg: (seg[rows].copy(), np.zeros(4 * n, dtype=seg.dtype)),
         lambda arrays: _bias_from_torch(arrays, rows)),
    ]


def _bias_from_torch(arrays, rows) -> np.ndarray:
    out = np.empty_like(arrays[0])
    out[rows] = arrays[0] + arrays[1]  # torch adds its two biases; DL4J has their sum
    return out


def _empty(fields: LayerFields, prefix: str, names: dict) -> list:
    return []


# The recurrent layers a Bidirectional may wrap: (fields, prefix, names, key prefix, torch suffix).
_DIRECTIONS = {"LSTM": _lstm, "GravesLSTM": _graves_lstm, "SimpleRnn": _simple_rnn}
_ONE_D = ("Convolution1DLayer", "Convolution1D")

_LAYOUTS = {
    "DefaultParamInitializer": _default,
    "EmbeddingLayerParamInitializer": _embedding,
    "ConvolutionParamInitializer": _convolution,
    "BatchNormalizationParamInitializer": _batch_normalization,
    "LSTMParamInitializer": _lstm,
    "GravesLSTMParamInitializer": _graves_lstm,
    "GravesBidirectionalLSTMParamInitializer": _graves_bidirectional,
    "EmptyParamInitializer": _empty,
    "DeconvolutionParamInitializer": _deconvolution,
    "SimpleRnnParamInitializer": _simple_rnn,
    "BidirectionalParamInitializer": _bidirectional,
    "SameDiffParamInitializer": _same_diff,
    "DepthwiseConvolutionParamInitializer": _depthwise,
    "SeparableConvolutionParamInitializer": _separable,
}
# custom_layers lists the initializers a registration may name without importing this module:
# each of them is laid out here (Bidirectional's and SameDiff's are for DL4J's own layers only:
# they read fields of the layer that wraps or defines them).
assert set(custom_layers.INITIALIZERS) <= set(_LAYOUTS), "custom_layers offers an initializer param_layout lacks"
