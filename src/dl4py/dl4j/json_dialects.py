"""configuration.json read as DL4J wrote it, in the dialects of real files, into one neutral
form: ``DL4JConfiguration`` (each layer's simple class name and its fields as the file has them)
and ``LayerFields`` (a layer's fields with DL4J's spellings read).

Three dialects over DL4J's versions, told apart per object:

- 0.7: layers wrapped in their type name, ``"activationFunction": "relu"`` strings,
  ``"lossFunction": "MCXENT"`` enums;
- 0.8/0.9: the same wrappers (``{"dense": {...}}``), typed values as wrapper objects too
  (``"activationFn": {"ReLU": {}}``, ``"lossFn": {"MCXENT": {}}``), the updater as per-layer
  fields (``"updater": "NESTEROVS", "learningRate": .., "momentum": ..``), ``"NaN"`` for unset;
- 1.0: Jackson's ``"@class"`` names everywhere (``{"@class":
  "org.deeplearning4j.nn.conf.layers.DenseLayer", ...}``), the updater as ``"iupdater"``, L2
  as a ``"regularization"`` list, dropout as ``"idropout"``, a network ``"dataType"``.

Nothing here decides what a layer becomes in dl4py (``layer_mapping``); the activation and loss
names are read into dl4py's spelling here because a custom layer's ``make_layer`` reads them
through ``LayerFields`` too.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from dl4py.dl4j.ndarray import DL4JFileError

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
                "leakyrelu": "leakyrelu", "tanh": "tanh", "sigmoid": "sigmoid", "softmax": "softmax",
                "softsign": "softsign"}
_LOSSES = {"mcxent": "mcxent", "negativeloglikelihood": "negativeloglikelihood", "mse": "mse",
           "squaredloss": "mse", "xent": "xent", "binaryxent": "xent", "mae": "mae", "meanabsoluteerror": "mae"}
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


def read_layer_conf(index: int, conf: Any, where: str) -> DL4JLayer:
    """A NeuralNetConfiguration holding one layer (a MultiLayerConfiguration's ``confs[i]``, a
    graph LayerVertex's ``layerConf``) as the layer ``index``, in either dialect."""
    return _read_layer(index, conf, where)


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
                             f"with slope {_LEAKY_ALPHA}, tanh, sigmoid, softmax, softsign)")
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
                             "mse, xent, mae)")
        if params.get("weights") is not None:
            raise self.error(f"loss {name} has per-output weights, which dl4py's losses do not take")
        return dl4py_name

    def error(self, what: str) -> DL4JFileError:
        return DL4JFileError(self.where, f"layer {self.layer.index} ({self.layer.java_class}): {what}")


def wrapped_layer(fields: LayerFields) -> LayerFields:
    """The layer a FrozenLayer or LastTimeStep wraps, or the layer itself."""
    key = {"FrozenLayer": "layer", "FrozenLayerWithBackprop": "underlying", "LastTimeStep": "underlying"}.get(
        fields.layer.kind)
    inner = inner_layer(fields, key) if key else None
    return fields if inner is None else inner


def inner_layer(fields: LayerFields, key: str) -> LayerFields | None:
    """The layer object a wrapper holds in its field ``key`` (a LastTimeStep's ``underlying``, a
    Bidirectional's ``fwd``), read in either dialect, with the wrapper's index; None without one."""
    inner = fields.raw.get(key)
    if not isinstance(inner, dict):
        return None
    return LayerFields(_layer_object(fields.index, inner, fields.layer.conf, fields.where), fields.where)
