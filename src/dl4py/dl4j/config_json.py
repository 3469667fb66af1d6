"""DL4J's configuration.json read in the dialects of real files, and mapped onto dl4py's
NetworkConfig.

Three dialects over DL4J's versions, told apart per object:

- 0.7: layers wrapped in their type name, ``"activationFunction": "relu"`` strings,
  ``"lossFunction": "MCXENT"`` enums;
- 0.8/0.9: the same wrappers (``{"dense": {...}}``), typed values as wrapper objects too
  (``"activationFn": {"ReLU": {}}``, ``"lossFn": {"MCXENT": {}}``), the updater as per-layer
  fields (``"updater": "NESTEROVS", "learningRate": .., "momentum": ..``), ``"NaN"`` for unset;
- 1.0: Jackson's ``"@class"`` names everywhere (``{"@class":
  "org.deeplearning4j.nn.conf.layers.DenseLayer", ...}``), the updater as ``"iupdater"``, L2
  as a ``"regularization"`` list, dropout as ``"idropout"``, a network ``"dataType"``.

``read_configuration`` parses the text into ``DL4JConfiguration`` (each layer's class and its
fields as the file has them); ``map_network`` turns that into a ``NetworkConfig``. What changes
the network's output and dl4py cannot represent (a layer, activation, loss or padding mode it
lacks) is a DL4JFileError naming the file, the layer index and the DL4J class. What only
changes training and dl4py lacks (L1, a weight-init distribution, an updater or schedule dl4py
has no counterpart for) is listed in ``MappedNetwork.left_out``, one line each, with what
stands in for it.

DL4J's per-layer settings are per layer in dl4py where dl4py has the field (activation, L2,
gradient normalization); the updater is one per network in dl4py, so layers that disagree on
it are listed. DL4J's dropout (``dropOut(p)``: p is the probability to *keep*) on a layer's
input becomes a ``DropoutLayer(rate=1 - p)`` before it; ``Same`` convolution padding becomes
the convolution's padding, or a ``ZeroPaddingLayer`` before it where DL4J pads one side more.
So dl4py's layer indices may run ahead of DL4J's: ``MappedNetwork.prefixes`` says where each
DL4J layer's parameters are.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from dl4py.config.frozen import FrozenLayer, unfrozen
from dl4py.config.input_type import ConvolutionalFlat, FeedForward, InputType, Recurrent
from dl4py.config.layers import (
    ActivationLayer,
    BatchNormalization,
    ConvolutionLayer,
    DenseLayer,
    DropoutLayer,
    GlobalPoolingLayer,
    Layer,
    OutputLayer,
    Shape,
    SubsamplingLayer,
)
from dl4py.config.layers_extra import Upsampling2D, ZeroPaddingLayer
from dl4py.config.network import NetworkConfig
from dl4py.config.recurrent import LSTM, EmbeddingLayer, EmbeddingSequenceLayer, LastTimeStep, RnnOutputLayer
from dl4py.config.schedules import ExponentialSchedule, PolySchedule, StepSchedule
from dl4py.config.updaters import Adam, Nesterovs, RmsProp, Sgd
from dl4py.dl4j import custom_layers
from dl4py.dl4j.ndarray import DL4JFileError
from dl4py.errors import ConfigError

LAYERS_PACKAGE = "org.deeplearning4j.nn.conf.layers."
# 0.7-0.9's wrapper names (Jackson's @JsonSubTypes on Layer) -> the class's simple name.
_WRAPPERS = {
    "dense": "DenseLayer", "output": "OutputLayer", "rnnoutput": "RnnOutputLayer", "loss": "LossLayer",
    "convolution": "ConvolutionLayer", "convolution1d": "Convolution1DLayer", "subsampling": "SubsamplingLayer",
    "subsampling1d": "Subsampling1DLayer", "batchnormalization": "BatchNormalization", "lstm": "LSTM",
    "graveslstm": "GravesLSTM", "gravesbidirectionallstm": "GravesBidirectionalLSTM", "embedding": "EmbeddingLayer",
    "activation": "ActivationLayer", "dropout": "DropoutLayer", "globalpooling": "GlobalPoolingLayer",
    "zeropadding": "ZeroPaddingLayer", "frozenlayer": "FrozenLayer", "autoencoder": "AutoEncoder", "rbm": "RBM",
    "localresponsenormalization": "LocalResponseNormalization", "variationalautoencoder": "VariationalAutoencoder",
    "centerlossoutputlayer": "CenterLossOutputLayer",
}
_ACTIVATIONS = {"identity": "identity", "linear": "identity", "relu": "relu", "lrelu": "leakyrelu",
                "leakyrelu": "leakyrelu", "tanh": "tanh", "sigmoid": "sigmoid", "softmax": "softmax"}
_LOSSES = {"mcxent": "mcxent", "negativeloglikelihood": "negativeloglikelihood", "mse": "mse",
           "squaredloss": "mse", "xent": "xent", "binaryxent": "xent"}
_WEIGHT_INITS = {"xavier": "xavier", "relu": "relu", "normal": "normal", "uniform": "uniform", "zero": "zero"}
_LEAKY_ALPHA = 0.01  # dl4py's leakyrelu slope, DL4J's default


@dataclass(frozen=True)
class DL4JLayer:
    """One layer as the file holds it: ``kind`` is the class's simple name (``DenseLayer``)."""

    index: int
    java_class: str
    kind: str
    fields: dict
    conf: dict  # the NeuralNetConfiguration around it (seed, 0.8's useRegularization, ...)
    dialect: str


@dataclass(frozen=True)
class DL4JConfiguration:
    """A configuration.json read: its layers, input preprocessors (by layer index), data type."""

    where: str  # the file and entry, for messages
    layers: tuple[DL4JLayer, ...]
    preprocessors: dict[int, tuple[str, dict]]
    data_type: str | None
    raw: dict
    is_graph: bool = False


def read_configuration(text: str, where: str) -> DL4JConfiguration:
    """The configuration in ``text`` (configuration.json's content); ``where`` names it in errors."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DL4JFileError(where, f"is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise DL4JFileError(where, "nests deeper than Python's JSON reader goes: not a DL4J configuration") from None
    if not isinstance(data, dict):
        raise DL4JFileError(where, f"holds a JSON {type(data).__name__}, not a DL4J configuration object")
    if "vertices" in data:
        return DL4JConfiguration(where, (), {}, _data_type(data), data, is_graph=True)
    confs = data.get("confs")
    if not isinstance(confs, list) or not confs:
        raise DL4JFileError(where, "has no layers (no 'confs' list): not a MultiLayerConfiguration")
    layers = tuple(_read_layer(i, conf, where) for i, conf in enumerate(confs))
    preprocessors, found = {}, data.get("inputPreProcessors") or {}
    if not isinstance(found, dict):
        raise DL4JFileError(where, f"inputPreProcessors is a JSON {type(found).__name__}, not an object by layer index")
    for key, value in found.items():
        name, fields = typed(value)
        if not str(key).isdigit() or name is None:
            raise DL4JFileError(where, f"inputPreProcessors[{key!r}] is not a preprocessor DL4J writes")
        preprocessors[int(key)] = (name, fields)
    return DL4JConfiguration(where, layers, preprocessors, _data_type(data), data)


def _read_layer(index: int, conf: Any, where: str) -> DL4JLayer:
    layer = conf.get("layer") if isinstance(conf, dict) else None
    if not isinstance(layer, dict) or not layer:
        raise DL4JFileError(where, f"layer {index} has no layer object ('confs[{index}].layer')")
    return _layer_object(index, layer, conf, where)


def _layer_object(index: int, layer: dict, conf: dict, where: str) -> DL4JLayer:
    """A layer object in either form: ``{"@class": ..., fields}`` or ``{"dense": {fields}}``."""
    if "@class" in layer:
        java_class = str(layer["@class"])
        fields = {k: v for k, v in layer.items() if k != "@class"}
        dialect = "1.0"
        kind = java_class.rsplit(".", 1)[-1]
    elif len(layer) == 1 and isinstance(next(iter(layer.values())), dict):
        (wrapper, fields), = layer.items()
        kind = _WRAPPERS.get(wrapper.lower(), wrapper)
        java_class = LAYERS_PACKAGE + kind
        dialect = "0.7" if "activationFunction" in fields else "0.8"
    else:
        raise DL4JFileError(where, f"layer {index}: {sorted(layer)[:5]} is no layer object DL4J writes")
    return DL4JLayer(index, java_class, kind, fields, conf, dialect)


def _data_type(data: dict) -> str | None:
    value = data.get("dataType") or (data.get("defaultConfiguration") or {}).get("dataType")
    return str(value).upper() if value else None


def typed(value: Any) -> tuple[str | None, dict]:
    """A typed JSON value as ``(simple class name, fields)``: ``{"@class": "a.b.Name", ...}``,
    a wrapper ``{"Name": {...}}``, or a bare string (0.7's enums)."""
    if isinstance(value, str):
        return value, {}
    if not isinstance(value, dict) or not value:
        return None, {}
    if "@class" in value:
        return str(value["@class"]).rsplit(".", 1)[-1], {k: v for k, v in value.items() if k != "@class"}
    if len(value) == 1:
        (name, fields), = value.items()
        if isinstance(fields, dict):
            return name, fields
    return None, {}


def number(value: Any, default=None):
    """A JSON number, with 0.8's ``"NaN"`` (and null) meaning unset: ``default``."""
    if value is None or isinstance(value, bool):
        return default
    try:
        value = float(value)
    except (TypeError, ValueError):
        return default
    return default if math.isnan(value) else value


class LayerFields:
    """A layer's fields with DL4J's spellings read: what a custom layer's ``make_layer`` gets."""

    def __init__(self, layer: DL4JLayer, where: str):
        self.layer, self.raw, self.where = layer, layer.fields, where

    @property
    def index(self) -> int:
        return self.layer.index

    @property
    def java_class(self) -> str:
        return self.layer.java_class

    def get(self, key: str, default=None):
        """Field ``key`` (0.8's ``"NaN"`` and null read as unset: ``default``)."""
        value = self.raw.get(key)
        if value is None or value == "NaN":
            return default
        return value

    def integer(self, *keys: str, default=None):
        for key in keys:
            value = number(self.raw.get(key))
            if value is not None:
                return int(value)
        return default

    @property
    def n_in(self) -> int | None:
        return self.integer("nin", "nIn")

    @property
    def n_out(self) -> int | None:
        return self.integer("nout", "nOut")

    def pair(self, key: str, default=(1, 1)) -> tuple[int, int]:
        value = self.raw.get(key)
        if value is None:
            return tuple(default)
        if not isinstance(value, list) or len(value) != 2:
            raise self.error(f"'{key}' is {value!r}, not two numbers (dl4py maps 2-D layers)")
        return int(value[0]), int(value[1])

    def activation(self, key: str = "activationFn", default: str = "sigmoid") -> str:
        """The DL4J activation in field ``key`` (0.7's ``activationFunction`` string too) as dl4py
        names it; an error naming the layer for one dl4py lacks."""
        value = self.raw.get(key)
        if value is None and key == "activationFn":
            value = self.raw.get("activationFunction")
        if value is None:
            return default
        name, params = typed(value)
        key_name = (name or "").lower().removeprefix("activation")
        dl4py_name = _ACTIVATIONS.get(key_name)
        if dl4py_name is None:
            raise self.error(f"activation {name} has no dl4py counterpart (dl4py has: identity, relu, leakyrelu "
                             f"with slope {_LEAKY_ALPHA}, tanh, sigmoid, softmax)")
        if dl4py_name == "leakyrelu" and number(params.get("alpha"), _LEAKY_ALPHA) != _LEAKY_ALPHA:
            raise self.error(f"leaky ReLU slope {params.get('alpha')}: dl4py's leakyrelu has slope {_LEAKY_ALPHA}")
        if dl4py_name == "relu" and any(number(params.get(k), 0.0) for k in ("max", "negativeSlope", "threshold")):
            raise self.error(f"ReLU with max/negativeSlope/threshold {params}: dl4py's relu is plain max(0, x)")
        return dl4py_name

    def loss(self) -> str:
        name, params = typed(self.raw.get("lossFn") or self.raw.get("lossFunction"))
        dl4py_name = _LOSSES.get((name or "").lower().removeprefix("loss").replace("_", ""))
        if dl4py_name is None:
            raise self.error(f"loss {name} has no dl4py counterpart (dl4py has: mcxent, negativeloglikelihood, "
                             "mse, xent)")
        if params.get("weights") is not None:
            raise self.error(f"loss {name} has per-output weights, which dl4py's losses do not take")
        return dl4py_name

    def error(self, what: str) -> DL4JFileError:
        return DL4JFileError(self.where, f"layer {self.layer.index} ({self.layer.java_class}): {what}")


@dataclass(frozen=True)
class MappedNetwork:
    """A DL4J configuration as dl4py's: the config, where each DL4J layer's parameters are in
    the built ``nn.Sequential`` (``prefixes[i]``, e.g. ``"2.op"``), what was left out, and the
    precision DL4J's ``dataType`` names (None where the file does not say)."""

    config: NetworkConfig
    prefixes: dict[int, str]
    left_out: tuple[str, ...]
    precision: str | None


@dataclass
class _Mapping:
    """The network as it is mapped, layer by layer, with the shape that reaches the next one."""

    conf: DL4JConfiguration
    shape: Shape
    layers: list = field(default_factory=list)
    prefixes: dict = field(default_factory=dict)
    owners: list = field(default_factory=list)  # dl4py layer index -> DL4J layer index
    left_out: list = field(default_factory=list)
    # DL4J's L2 of the layers whose dl4py layer has no l2 field: they take the network's.
    l2_elsewhere: dict = field(default_factory=dict)

    def add(self, layer: Layer, fields: LayerFields) -> int:
        """Append ``layer`` (for DL4J layer ``fields.index``); its dl4py index."""
        shape = self.shape
        if unfrozen(layer).type_name in ("dense", "output") and shape.kind == "cnn":
            shape = shape.flat()  # as NetworkConfig flattens (DL4J's CnnToFeedForwardPreProcessor)
        try:
            self.shape = layer.output_shape(shape, f"layer {fields.index}")
        except ConfigError as exc:
            raise fields.error(str(exc).split(": ", 1)[-1]) from None
        self.layers.append(layer)
        self.owners.append(fields.index)
        return len(self.layers) - 1


# ---- the network -------------------------------------------------------------------------------

def map_network(conf: DL4JConfiguration, input_type: InputType | None = None) -> MappedNetwork:
    """``conf`` as a dl4py NetworkConfig (see the module docstring); ``input_type`` where the
    file does not say what the first layer takes (a convolution's height and width)."""
    if conf.is_graph:
        raise DL4JFileError(conf.where, "is a ComputationGraphConfiguration: importing graphs comes later "
                                        "(dl4py imports MultiLayerConfigurations now)")
    all_fields = [LayerFields(layer, conf.where) for layer in conf.layers]
    try:
        input_type = input_type or _input_type(conf, all_fields)
    except (KeyError, TypeError, ValueError) as exc:
        raise all_fields[0].error(f"its input preprocessor is missing a field or malformed: {_reason(exc)}") from None
    mapping = _Mapping(conf, _first_shape(input_type, all_fields[0]))
    updaters = {}
    for fields in all_fields:
        try:
            _check_preprocessor(mapping, fields)
            _check_n_in(mapping, fields)
            _map_layer(mapping, fields)
            if fields.index in mapping.prefixes and fields.layer.kind not in _NO_UPDATER:
                updaters[fields.index] = _updater(wrapped_layer(fields), mapping.left_out)
        except (KeyError, TypeError, ValueError) as exc:  # a field missing or of the wrong type; a ConfigError
            raise fields.error(f"a field is missing or malformed: {_reason(exc)}") from None
    config = _network_config(mapping, all_fields, input_type, updaters)
    return MappedNetwork(config, mapping.prefixes, tuple(dict.fromkeys(mapping.left_out)), _precision(conf))


def _reason(exc: Exception) -> str:
    """An exception's message, on one line."""
    if isinstance(exc, KeyError):
        return f"no {exc.args[0]!r}"
    return str(exc).replace("\n", " ")


def _input_type(conf: DL4JConfiguration, all_fields: list[LayerFields]) -> InputType:
    first = all_fields[0]
    kind, fields = conf.preprocessors.get(0, (None, {}))
    if kind is not None and kind.lower().startswith("feedforwardtocnn"):
        return ConvolutionalFlat(int(fields["inputHeight"]), int(fields["inputWidth"]), int(fields["numChannels"]))
    if kind is not None:
        raise first.error(f"input preprocessor {kind} has no dl4py counterpart")
    inner = wrapped_layer(first)
    if inner.layer.kind in ("EmbeddingLayer",):
        return FeedForward(1)
    if inner.layer.kind in ("EmbeddingSequenceLayer",):
        return Recurrent(1)
    if inner.layer.kind in _RECURRENT and inner.n_in:
        return Recurrent(inner.n_in)
    if inner.n_in and inner.layer.kind not in _CONVOLUTIONAL:
        return FeedForward(inner.n_in)
    raise first.error("the file does not hold the input's shape (DL4J keeps no input type for it): pass "
                      "input_type=InputType.convolutional(height, width, channels) (or the type the data has)")


def _first_shape(input_type: InputType, first: LayerFields) -> Shape:
    if isinstance(input_type, FeedForward):
        return Shape("ff", (input_type.size,))
    if isinstance(input_type, Recurrent):
        return Shape("rnn", (input_type.length, input_type.size))
    cnn = Shape("cnn", (input_type.channels, input_type.height, input_type.width))
    if isinstance(input_type, ConvolutionalFlat) and wrapped_layer(first).layer.kind in _DENSE:
        return cnn.flat()
    return cnn


def wrapped_layer(fields: LayerFields) -> LayerFields:
    """The layer a FrozenLayer or LastTimeStep wraps, or the layer itself."""
    key = {"FrozenLayer": "layer", "FrozenLayerWithBackprop": "underlying", "LastTimeStep": "underlying"}.get(
        fields.layer.kind)
    inner = fields.raw.get(key) if key else None
    if not isinstance(inner, dict):
        return fields
    layer = _layer_object(fields.index, inner, fields.layer.conf, fields.where)
    return LayerFields(layer, fields.where)


def _check_preprocessor(mapping: _Mapping, fields: LayerFields) -> None:
    kind, values = mapping.conf.preprocessors.get(fields.index, (None, {}))
    if kind is None or fields.index == 0 and kind.lower().startswith("feedforwardtocnn"):
        return
    if kind.lower().startswith("cnntofeedforward") and mapping.shape.kind == "cnn":
        expected = (int(values.get("numChannels", -1)), int(values.get("inputHeight", -1)),
                    int(values.get("inputWidth", -1)))
        if tuple(mapping.shape.dims) != expected:
            raise fields.error(f"DL4J flattens [channels, height, width] {list(expected)} here, but the layers "
                               f"before give {list(mapping.shape.dims)}")
        return
    raise fields.error(f"input preprocessor {kind} (at layer {fields.index}) has no dl4py counterpart")


def _check_n_in(mapping: _Mapping, fields: LayerFields) -> None:
    """DL4J's nIn against what the layers before give: a mismatch would put the parameters in
    the wrong places (or the file's network never ran)."""
    inner = wrapped_layer(fields)
    n_in, shape = inner.n_in, mapping.shape
    if not n_in or inner.layer.kind in ("EmbeddingLayer", "EmbeddingSequenceLayer"):
        return
    if shape.kind == "rnn":
        given = shape.dims[1]
    elif shape.kind == "cnn" and inner.layer.kind not in _DENSE and not custom_layers.custom_layer(inner.java_class):
        given = shape.dims[0]
    else:
        given = shape.size
    if given != n_in:
        raise fields.error(f"nIn is {n_in} in the file, but the layers before give {given} "
                           f"(shape {shape}): the file's network does not fit together")


def _precision(conf: DL4JConfiguration) -> str | None:
    return {"FLOAT": "float", "DOUBLE": "double", "HALF": "half"}.get(conf.data_type or "")


# ---- one layer ---------------------------------------------------------------------------------

def _map_layer(mapping: _Mapping, fields: LayerFields) -> None:
    registered = custom_layers.custom_layer(fields.java_class)
    if registered is not None:
        layer = _custom(registered, fields)
        if getattr(layer, "l2", None) is None:
            mapping.l2_elsewhere[fields.index] = _l2(fields, mapping.left_out)
        _add_with_dropout(mapping, fields, layer, "op")
        return
    mapper = _MAPPERS.get(fields.layer.kind)
    if mapper is None:
        raise _unknown(fields)
    mapper(mapping, fields)


def _unknown(fields: LayerFields) -> DL4JFileError:
    if fields.java_class.startswith(("org.deeplearning4j.nn.conf.layers.", "org.deeplearning4j.nn.layers.")):
        return fields.error(f"dl4py has no counterpart for DL4J's {fields.layer.kind}")
    return fields.error("a custom layer class with nothing registered for it: map it onto a dl4py layer with "
                        f"dl4py.dl4j.register_custom_layer({fields.java_class!r}, make_layer, initializer=...)")


def _custom(registered, fields: LayerFields) -> Layer:
    try:
        layer = registered.make_layer(fields)
    except (ConfigError, KeyError, TypeError, ValueError) as exc:
        raise fields.error(f"the registered make_layer failed: {exc}") from None
    if not isinstance(layer, Layer):
        raise fields.error(f"the registered make_layer returned {type(layer).__name__}, not a dl4py layer config")
    return layer


def _add_with_dropout(mapping: _Mapping, fields: LayerFields, layer: Layer, prefix: str | None,
                      padding: Layer | None = None) -> int:
    """``layer`` after the DropoutLayer that DL4J's dropout on its input becomes (and after
    ``padding``, where given); ``prefix``: the path of its parameters under its module (None:
    it has none)."""
    rate = _dropout_rate(fields, mapping.left_out)
    if rate:
        mapping.add(DropoutLayer(rate=rate), fields)
    if padding is not None:
        mapping.add(padding, fields)
    index = mapping.add(layer, fields)
    if prefix is not None:
        mapping.prefixes[fields.index] = f"{index}.{prefix}"
    return index


def _dropout_rate(fields: LayerFields, left_out: list) -> float:
    old = number(fields.raw.get("dropOut"), 0.0)  # 0.7/0.8: the probability to keep
    if old:
        return 1.0 - old
    name, params = typed(fields.raw.get("idropout"))
    if name is None:
        return 0.0
    if name != "Dropout" or params.get("pSchedule") is not None:
        left_out.append(f"layer {fields.index}: dropout {name} {params} (dl4py has plain dropout with a fixed rate)")
        return 0.0
    keep = number(params.get("p"), 1.0)
    return 0.0 if keep >= 1.0 else 1.0 - keep


def _common(fields: LayerFields, mapping: _Mapping) -> dict:
    """Settings every dl4py layer with parameters takes: weight init, gradient normalization."""
    out = {"weight_init": _weight_init(fields, mapping.left_out)}
    normalization = fields.get("gradientNormalization")
    if normalization and str(normalization).lower() != "none":
        out["gradient_normalization"] = normalization
        out["gradient_normalization_threshold"] = number(fields.raw.get("gradientNormalizationThreshold"), 1.0)
    return out


def _map_dense(mapping: _Mapping, fields: LayerFields) -> None:
    if fields.get("hasLayerNorm"):
        raise fields.error("a dense layer with layer normalization (hasLayerNorm) has no dl4py counterpart")
    kind = fields.layer.kind
    cls = {"DenseLayer": DenseLayer, "OutputLayer": OutputLayer, "RnnOutputLayer": RnnOutputLayer}[kind]
    options = dict(n_out=fields.n_out, activation=fields.activation(), has_bias=bool(fields.get("hasBias", True)),
                   l2=_l2(fields, mapping.left_out), **_common(fields, mapping))
    if cls is not DenseLayer:
        options["loss"] = fields.loss()
    _add_with_dropout(mapping, fields, cls(**options), "op")


def _map_convolution(mapping: _Mapping, fields: LayerFields) -> None:
    _check_nchw(fields)
    kernel, stride, dilation = fields.pair("kernelSize"), fields.pair("stride"), fields.pair("dilation")
    padding = _padding(mapping, fields, kernel, stride, dilation)
    layer = ConvolutionLayer(n_out=fields.n_out, kernel_size=kernel, stride=stride, padding=padding[:2],
                             dilation=dilation, activation=fields.activation(),
                             has_bias=bool(fields.get("hasBias", True)), l2=_l2(fields, mapping.left_out),
                             **_common(fields, mapping))
    # Same mode padding one side more than the other: the zeros first, then the convolution.
    _add_with_dropout(mapping, fields, layer, "op", None if padding[2] is None else ZeroPaddingLayer(padding=padding[2]))


def _padding(mapping: _Mapping, fields: LayerFields, kernel, stride, dilation):
    """``(top, left, None)``, or ``(0, 0, (top, bottom, left, right))`` where Same mode pads
    unevenly; Truncate and Strict take the file's padding."""
    mode = str(fields.get("convolutionMode", "Truncate"))
    if mode.lower() != "same":
        top, left = fields.pair("padding", (0, 0))
        return top, left, None
    if mapping.shape.kind != "cnn":
        raise fields.error("Same convolution mode needs convolutional input")
    sides = []
    for axis in range(2):
        size = mapping.shape.dims[1 + axis]
        out = -(-size // stride[axis])
        span = (kernel[axis] - 1) * dilation[axis] + 1
        total = max((out - 1) * stride[axis] + span - size, 0)
        sides += [total // 2, total - total // 2]  # DL4J: the top/left side gets the smaller half
    top, bottom, left, right = sides
    if top == bottom and left == right:
        return top, left, None
    return 0, 0, (top, bottom, left, right)


def _check_nchw(fields: LayerFields) -> None:
    data_format = fields.get("cnn2dDataFormat") or fields.get("dataFormat")
    if data_format and str(data_format).upper() not in ("NCHW",):
        raise fields.error(f"data format {data_format}: dl4py's convolutions take NCHW (channels first)")


def _map_subsampling(mapping: _Mapping, fields: LayerFields) -> None:
    _check_nchw(fields)
    pooling = str(fields.get("poolingType", "MAX")).lower()
    if pooling not in ("max", "avg"):
        raise fields.error(f"pooling type {pooling.upper()} has no dl4py counterpart (dl4py pools max or avg)")
    kernel, stride = fields.pair("kernelSize", (2, 2)), fields.pair("stride", (2, 2))
    if fields.pair("dilation") != (1, 1):
        raise fields.error(f"pooling dilation {fields.pair('dilation')}: dl4py's pooling has none")
    top, left, uneven = _padding(mapping, fields, kernel, stride, (1, 1))
    if uneven is not None:
        raise fields.error(f"Same mode pads this pooling unevenly {list(uneven)} (top, bottom, left, right), and "
                           "DL4J leaves the padding out of the window: dl4py's pooling pads evenly only")
    if pooling == "avg" and (top or left) and not fields.get("avgPoolIncludePadInDivisor", False):
        raise fields.error("average pooling with padding that DL4J leaves out of the divisor: dl4py's average "
                           "pooling counts the padding")
    _add_with_dropout(mapping, fields, SubsamplingLayer(pooling_type=pooling, kernel_size=kernel, stride=stride,
                                                        padding=(top, left)), None)


def _map_batch_normalization(mapping: _Mapping, fields: LayerFields) -> None:
    if fields.get("lockGammaBeta"):
        raise fields.error("lockGammaBeta (fixed gamma and beta) has no dl4py counterpart")
    options = {k: v for k, v in _common(fields, mapping).items() if k != "weight_init"}  # it has no weights
    layer = BatchNormalization(eps=number(fields.raw.get("eps"), 1e-5), decay=number(fields.raw.get("decay"), 0.9),
                               **options)
    _add_with_dropout(mapping, fields, layer, "op")
    activation = fields.activation(default="identity")
    if activation != "identity":  # DL4J's batch normalization applies its activation after
        mapping.add(ActivationLayer(activation=activation), fields)


def _lstm(fields: LayerFields, mapping: _Mapping) -> LSTM:
    activation = fields.activation(default="tanh")
    if activation != "tanh":
        raise fields.error(f"LSTM activation {activation}: dl4py's LSTM (PyTorch's) has tanh only")
    gate = fields.activation("gateActivationFn", default="sigmoid")
    if gate != "sigmoid":
        raise fields.error(f"LSTM gate activation {gate}: dl4py's LSTM gates are sigmoid")
    mapping.l2_elsewhere[fields.index] = _l2(fields, mapping.left_out)  # dl4py's LSTM takes the network's
    return LSTM(n_out=fields.n_out, forget_gate_bias_init=number(fields.raw.get("forgetGateBiasInit"), 1.0),
                **_common(fields, mapping))


def _map_lstm(mapping: _Mapping, fields: LayerFields) -> None:
    _add_with_dropout(mapping, fields, _lstm(fields, mapping), "op")


def _map_last_time_step(mapping: _Mapping, fields: LayerFields) -> None:
    inner = wrapped_layer(fields)
    if inner.layer.kind != "LSTM":
        raise inner.error(f"LastTimeStep around {inner.layer.kind}: dl4py wraps its LSTM or GRU only")
    _add_with_dropout(mapping, inner, LastTimeStep(layer=_lstm(inner, mapping)), "op.op")


def _map_frozen(mapping: _Mapping, fields: LayerFields) -> None:
    inner = wrapped_layer(fields)
    if inner is fields:
        raise fields.error("a FrozenLayer without the layer it freezes")
    before = len(mapping.layers)
    _map_layer(mapping, inner)
    if len(mapping.layers) != before + 1:
        raise fields.error(f"a frozen {inner.layer.kind} maps onto {len(mapping.layers) - before} dl4py layers; "
                           "dl4py freezes one")
    mapping.layers[-1] = FrozenLayer(layer=mapping.layers[-1])


def _map_embedding(mapping: _Mapping, fields: LayerFields) -> None:
    sequence = fields.layer.kind == "EmbeddingSequenceLayer"
    if fields.get("hasBias", not sequence):
        raise fields.error("an embedding with a bias (hasBias) has no dl4py counterpart: dl4py's embedding is a "
                           "lookup table only")
    cls = EmbeddingSequenceLayer if sequence else EmbeddingLayer
    mapping.l2_elsewhere[fields.index] = _l2(fields, mapping.left_out)  # dl4py's embedding takes the network's
    layer = cls(vocab_size=fields.n_in, n_out=fields.n_out, activation=fields.activation(default="identity"),
                **_common(fields, mapping))
    _add_with_dropout(mapping, fields, layer, "op")


def _map_dropout(mapping: _Mapping, fields: LayerFields) -> None:
    rate = _dropout_rate(fields, mapping.left_out)
    mapping.add(DropoutLayer(rate=rate), fields)


def _map_activation(mapping: _Mapping, fields: LayerFields) -> None:
    _add_with_dropout(mapping, fields, ActivationLayer(activation=fields.activation()), None)


def _map_global_pooling(mapping: _Mapping, fields: LayerFields) -> None:
    pooling = str(fields.get("poolingType", "MAX")).lower()
    collapsed = fields.get("collapseDimensions", True) is not False
    if pooling not in ("max", "avg", "sum") or mapping.shape.kind != "cnn" or not collapsed:
        raise fields.error(f"global {pooling} pooling over {mapping.shape.kind} input: dl4py pools convolutional "
                           "input (max, avg or sum) to one value per channel")
    _add_with_dropout(mapping, fields, GlobalPoolingLayer(pooling_type=pooling), None)


def _map_zero_padding(mapping: _Mapping, fields: LayerFields) -> None:
    padding = fields.get("padding", [0, 0, 0, 0])
    _add_with_dropout(mapping, fields, ZeroPaddingLayer(padding=tuple(int(p) for p in padding)), None)


def _map_upsampling(mapping: _Mapping, fields: LayerFields) -> None:
    size = fields.get("size", [2, 2])
    size = (size, size) if isinstance(size, int) else tuple(int(s) for s in size)
    _add_with_dropout(mapping, fields, Upsampling2D(size=size), None)


_MAPPERS: dict[str, Callable[[_Mapping, LayerFields], None]] = {
    "DenseLayer": _map_dense, "OutputLayer": _map_dense, "RnnOutputLayer": _map_dense,
    "ConvolutionLayer": _map_convolution, "Convolution2D": _map_convolution,
    "SubsamplingLayer": _map_subsampling, "Pooling2D": _map_subsampling,
    "BatchNormalization": _map_batch_normalization, "LSTM": _map_lstm, "LastTimeStep": _map_last_time_step,
    "FrozenLayer": _map_frozen, "EmbeddingLayer": _map_embedding, "EmbeddingSequenceLayer": _map_embedding,
    "DropoutLayer": _map_dropout, "ActivationLayer": _map_activation, "GlobalPoolingLayer": _map_global_pooling,
    "ZeroPaddingLayer": _map_zero_padding, "Upsampling2D": _map_upsampling,
}
_DENSE = {"DenseLayer", "OutputLayer", "CenterLossOutputLayer"}
_CONVOLUTIONAL = {"ConvolutionLayer", "Convolution2D", "SubsamplingLayer", "Pooling2D", "BatchNormalization"}
_RECURRENT = {"LSTM", "GravesLSTM", "GravesBidirectionalLSTM", "RnnOutputLayer", "SimpleRnn", "Bidirectional"}
_NO_UPDATER = {"SubsamplingLayer", "Pooling2D", "DropoutLayer", "ActivationLayer", "GlobalPoolingLayer",
               "ZeroPaddingLayer", "Upsampling2D", "FrozenLayer"}


# ---- training settings ---------------------------------------------------------------------------

def _weight_init(fields: LayerFields, left_out: list) -> str | None:
    name = fields.get("weightInit")
    if name is None:
        name, _ = typed(fields.raw.get("weightInitFn"))
        name = (name or "").removeprefix("WeightInit")
    if not name:
        return None
    dl4py_name = _WEIGHT_INITS.get(str(name).lower())
    if dl4py_name is None:
        left_out.append(f"layer {fields.index}: weight init {name} (it only shapes fresh parameters; dl4py's "
                        "xavier stands in)")
    return dl4py_name


def _l2(fields: LayerFields, left_out: list) -> float:
    """L2 on the weights; L1, bias L2 and weight decay go to ``left_out``."""
    if fields.layer.conf.get("useRegularization") is False:  # 0.7/0.8: l1/l2 set but switched off
        return 0.0
    if "regularization" in fields.raw or "regularizationBias" in fields.raw:
        l2 = 0.0
        for item in fields.raw.get("regularization") or []:
            name, params = typed(item)
            value = _schedule_value(params.get("l2"))
            if name == "L2Regularization" and value is not None:
                l2 = value
            else:
                left_out.append(f"layer {fields.index}: {name} {params} (dl4py regularizes with L2 only)")
        if fields.raw.get("regularizationBias"):
            left_out.append(f"layer {fields.index}: regularization of biases (dl4py leaves biases unregularized)")
        return l2
    for key, what in (("l1", "L1"), ("l1Bias", "bias L1"), ("l2Bias", "bias L2")):
        if number(fields.raw.get(key), 0.0):
            left_out.append(f"layer {fields.index}: {what} {fields.raw[key]} (dl4py regularizes weights with L2 only)")
    return number(fields.raw.get("l2"), 0.0)


def _schedule_value(value) -> float | None:
    name, params = typed(value)
    if isinstance(value, (int, float)):
        return float(value)
    return number(params.get("value")) if name == "FixedSchedule" else None


def _updater(fields: LayerFields, left_out: list):
    """The layer's updater as dl4py's (None: dl4py has none like it, noted in ``left_out``)."""
    name, params = typed(fields.raw.get("iupdater") or fields.raw.get("iUpdater"))
    if name is None:  # 0.7/0.8: an enum and the hyperparameters beside it
        name, params = str(fields.raw.get("updater") or "SGD"), fields.raw
        schedule = _old_schedule(fields, left_out)
    else:
        schedule = _schedule(fields, params.get("learningRateSchedule"), left_out)
    key = name.lower()
    lr = number(params.get("learningRate"))
    if lr is None:  # DL4J writes NaN beside a schedule: the schedule's first rate
        lr = _initial_rate(params.get("learningRateSchedule"))
    extra = {"schedule": schedule} if schedule is not None else {}
    if lr is not None:
        extra["learning_rate"] = lr
    if key == "sgd":
        return Sgd(**extra)
    if key == "nesterovs":
        return Nesterovs(momentum=number(params.get("momentum"), 0.9), **extra)
    if key == "adam":
        return Adam(beta1=number(params.get("beta1", params.get("adamMeanDecay")), 0.9),
                    beta2=number(params.get("beta2", params.get("adamVarDecay")), 0.999),
                    epsilon=number(params.get("epsilon"), 1e-8), **extra)
    if key == "rmsprop":
        return RmsProp(rms_decay=number(params.get("rmsDecay"), 0.95), epsilon=number(params.get("epsilon"), 1e-8),
                       **extra)
    left_out.append(f"layer {fields.index}: updater {name} (dl4py has Sgd, Nesterovs, Adam, RmsProp; "
                    "the network's other updater, or Sgd, stands in)")
    return None


def _schedule(fields: LayerFields, value, left_out: list):
    name, params = typed(value)
    if name is None:
        return None
    unit = "epoch" if str(params.get("scheduleType", "ITERATION")).upper() == "EPOCH" else "iteration"
    try:
        if name == "ExponentialSchedule":
            return ExponentialSchedule(gamma=params["gamma"], unit=unit)
        if name == "StepSchedule":
            return StepSchedule(decay_rate=params["decayRate"], step=int(params["step"]), unit=unit)
        if name == "PolySchedule":
            return PolySchedule(power=params["power"], max_steps=int(params["maxIter"]), unit=unit)
    except (KeyError, TypeError, ValueError, ConfigError) as exc:
        raise fields.error(f"learning-rate schedule {name} {params}: {exc}") from None
    left_out.append(f"layer {fields.index}: learning-rate schedule {name} (dl4py schedules: exponential, step, "
                    "poly; the fixed initial rate stands in)")
    return None


def _initial_rate(value) -> float | None:
    _, params = typed(value)
    if "initialValue" in params:
        return number(params["initialValue"])
    values = params.get("values")  # MapSchedule: {iteration: rate}
    if isinstance(values, dict) and values:
        return number(values[min(values, key=int)])
    return None


def _old_schedule(fields: LayerFields, left_out: list):
    """0.7/0.8's network-wide ``learningRatePolicy``."""
    conf = fields.layer.conf
    policy = str(conf.get("learningRatePolicy") or "None")
    if policy == "None":
        return None
    if policy == "Exponential":
        return ExponentialSchedule(gamma=number(conf.get("lrPolicyDecayRate")))
    if policy == "Step":
        return StepSchedule(decay_rate=number(conf.get("lrPolicyDecayRate")), step=int(number(conf.get("lrPolicySteps"))))
    left_out.append(f"layer {fields.index}: learning-rate policy {policy} (dl4py schedules: exponential, step, poly; "
                    "the fixed rate stands in)")
    return None


def _network_config(mapping: _Mapping, all_fields: list[LayerFields], input_type: InputType,
                    updaters: dict) -> NetworkConfig:
    chosen = [u for u in updaters.values() if u is not None]
    updater = chosen[0] if chosen else Sgd()
    differing = sorted(i for i, u in updaters.items() if u is not None and u != updater)
    if differing:
        mapping.left_out.append(f"layers {differing}: their own updaters (dl4py has one per network: "
                                f"layer {min(updaters)}'s {type(updater).__name__} is used)")
    l2 = _network_l2(mapping)
    seed = int(number(all_fields[0].layer.conf.get("seed"), 12345))
    where = mapping.conf.where
    try:
        return NetworkConfig(layers=tuple(mapping.layers), input_type=input_type, seed=seed, updater=updater, l2=l2)
    except ConfigError as exc:
        index = _dl4j_index(exc.where, mapping.owners)
        at = f"layer {index} ({mapping.conf.layers[index].java_class})" if index is not None else "the network"
        raise DL4JFileError(where, f"{at}: {str(exc).split(': ', 1)[-1]}") from None


def _network_l2(mapping: _Mapping) -> float:
    """The L2 most layers have; the layers that take the network's and have another are listed."""
    values = [getattr(unfrozen(layer), "l2", None) for layer in mapping.layers]
    counts = Counter([v for v in values if v is not None] + list(mapping.l2_elsewhere.values()))
    l2 = counts.most_common(1)[0][0] if counts else 0.0
    for index, value in mapping.l2_elsewhere.items():
        if value != l2:
            mapping.left_out.append(f"layer {index}: L2 {value} (dl4py's layer of this kind takes the network's "
                                    f"L2, {l2})")
    return l2


def _dl4j_index(where: str, owners: list) -> int | None:
    if where and "layers[" in where:
        dl4py_index = int(where.split("layers[", 1)[1].split("]", 1)[0])
        if dl4py_index < len(owners):
            return owners[dl4py_index]
    return None
