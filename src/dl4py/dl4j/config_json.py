"""DL4J's configuration.json read in the dialects of real files, and mapped onto dl4py's
NetworkConfig: the entry point of the import's configuration side.

``read_configuration`` parses the text into ``DL4JConfiguration`` (each layer's class and its
fields as the file has them: ``json_dialects``, which knows the 0.7, 0.8/0.9 and 1.0 dialects);
``map_network`` turns that into a ``NetworkConfig``, layer by layer (``layer_mapping``,
``convolution_mapping``, into a ``mapping_state.NetworkMapping``), with the training settings
(``training_settings``). What changes the network's output and dl4py cannot represent (a layer,
activation, loss or padding mode it lacks) is a DL4JFileError naming the file, the layer index
and the DL4J class. What only changes training and dl4py lacks (L1, a weight-init distribution,
an updater or schedule dl4py has no counterpart for) is listed in ``MappedNetwork.left_out``,
one line each, with what stands in for it.

DL4J's per-layer settings are per layer in dl4py where dl4py has the field (activation, L2,
gradient normalization); the updater is one per network in dl4py, so layers that disagree on
it are listed. DL4J's dropout (``dropOut(p)``: p is the probability to *keep*) on a layer's
input becomes a ``DropoutLayer(rate=1 - p)`` before it; ``Same`` convolution padding becomes
the convolution's padding, or a ``ZeroPaddingLayer`` before it where DL4J pads one side more.
So dl4py's layer indices may run ahead of DL4J's: ``MappedNetwork.prefixes`` says where each
DL4J layer's parameters are.
"""

from __future__ import annotations

from dataclasses import dataclass

from dl4py.config.input_type import ConvolutionalFlat, FeedForward, InputType, Recurrent
from dl4py.config.layers import Shape
from dl4py.config.network import NetworkConfig
from dl4py.dl4j import custom_layers
from dl4py.dl4j.json_dialects import (
    LAYERS_PACKAGE,
    DL4JConfiguration,
    DL4JLayer,
    LayerFields,
    number,
    read_configuration,
    typed,
    wrapped_layer,
)
from dl4py.dl4j.layer_mapping import CONVOLUTIONAL, DENSE, NO_UPDATER, SEQUENCES, map_layer
from dl4py.dl4j.mapping_state import NetworkMapping
from dl4py.dl4j.ndarray import DL4JFileError
from dl4py.dl4j.training_settings import layer_updater, network_l2, network_updater
from dl4py.errors import ConfigError

# Re-exported: what the importer, the parameter layout and custom layers' code read from here.
__all__ = ["LAYERS_PACKAGE", "DL4JConfiguration", "DL4JLayer", "LayerFields", "MappedNetwork", "map_network",
           "number", "read_configuration", "typed", "wrapped_layer"]


@dataclass(frozen=True)
class MappedNetwork:
    """A DL4J configuration as dl4py's: the config, where each DL4J layer's parameters are in
    the built ``nn.Sequential`` (``prefixes[i]``, e.g. ``"2.op"``), what was left out, and the
    precision DL4J's ``dataType`` names (None where the file does not say)."""

    config: NetworkConfig
    prefixes: dict[int, str]
    left_out: tuple[str, ...]
    precision: str | None


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
    mapping = NetworkMapping(conf, _first_shape(input_type, all_fields[0]))
    updaters = {}
    for fields in all_fields:
        try:
            _check_preprocessor(mapping, fields)
            _check_n_in(mapping, fields)
            map_layer(mapping, fields)
            if fields.index in mapping.prefixes and fields.layer.kind not in NO_UPDATER:
                updaters[fields.index] = layer_updater(wrapped_layer(fields), mapping.left_out)
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
        _check_channels_first(first, kind, fields)
        return ConvolutionalFlat(int(fields["inputHeight"]), int(fields["inputWidth"]), int(fields["numChannels"]))
    if kind is not None:
        raise first.error(f"input preprocessor {kind} has no dl4py counterpart")
    inner = wrapped_layer(first)
    if inner.layer.kind in ("EmbeddingLayer",):
        return FeedForward(1)
    if inner.layer.kind in ("EmbeddingSequenceLayer",):
        return Recurrent(1)
    if inner.layer.kind in SEQUENCES and inner.n_in:
        return Recurrent(inner.n_in)
    if inner.n_in and inner.layer.kind not in CONVOLUTIONAL:
        return FeedForward(inner.n_in)
    raise first.error("the file does not hold the input's shape (DL4J keeps no input type for it): pass "
                      "input_type=InputType.convolutional(height, width, channels) (or the type the data has)")


def _first_shape(input_type: InputType, first: LayerFields) -> Shape:
    if isinstance(input_type, FeedForward):
        return Shape("ff", (input_type.size,))
    if isinstance(input_type, Recurrent):
        return Shape("rnn", (input_type.length, input_type.size))
    cnn = Shape("cnn", (input_type.channels, input_type.height, input_type.width))
    if isinstance(input_type, ConvolutionalFlat) and wrapped_layer(first).layer.kind in DENSE:
        return cnn.flat()
    return cnn


def _check_preprocessor(mapping: NetworkMapping, fields: LayerFields) -> None:
    kind, values = mapping.conf.preprocessors.get(fields.index, (None, {}))
    if kind is None or fields.index == 0 and kind.lower().startswith("feedforwardtocnn"):
        return
    if kind.lower().startswith("cnntofeedforward") and mapping.shape.kind == "cnn":
        _check_channels_first(fields, kind, values)
        expected = (int(values.get("numChannels", -1)), int(values.get("inputHeight", -1)),
                    int(values.get("inputWidth", -1)))
        if tuple(mapping.shape.dims) != expected:
            if fields.n_in == mapping.shape.size:
                # The preprocessor's shape disagrees with the layers before and with this layer's
                # own nIn, which the layers before do fill (0.8's CNN_1: its builder set nIn by
                # hand, the preprocessor came from the input type DL4J inferred): the layers win.
                mapping.left_out.append(f"layer {fields.index}: the input preprocessor's [channels, height, width] "
                                        f"{list(expected)} (the layers before give {list(mapping.shape.dims)}, which "
                                        f"is the layer's nIn {fields.n_in}: used)")
                return
            raise fields.error(f"DL4J flattens [channels, height, width] {list(expected)} here, but the layers "
                               f"before give {list(mapping.shape.dims)}")
        return
    raise fields.error(f"input preprocessor {kind} (at layer {fields.index}) has no dl4py counterpart")


def _check_channels_first(fields: LayerFields, kind: str, values: dict) -> None:
    """A preprocessor between images and flat rows (DL4J 1.0.0-beta7 on keeps its ``format``)
    flattens ``[channels, height, width]`` as dl4py does only for NCHW."""
    data_format = values.get("format")
    if isinstance(data_format, str) and data_format.upper() != "NCHW":
        raise fields.error(f"input preprocessor {kind} with format {data_format}: dl4py flattens images channels "
                           "first (NCHW), and only such files are mapped")


def _check_n_in(mapping: NetworkMapping, fields: LayerFields) -> None:
    """DL4J's nIn against what the layers before give: a mismatch would put the parameters in
    the wrong places (or the file's network never ran)."""
    inner = wrapped_layer(fields)
    n_in, shape = inner.n_in, mapping.shape
    if not n_in or inner.layer.kind in ("EmbeddingLayer", "EmbeddingSequenceLayer"):
        return
    if shape.kind == "rnn":
        given = shape.dims[1]
    elif shape.kind == "cnn" and inner.layer.kind not in DENSE and not custom_layers.custom_layer(inner.java_class):
        given = shape.dims[0]
    else:
        given = shape.size
    if given != n_in:
        raise fields.error(f"nIn is {n_in} in the file, but the layers before give {given} "
                           f"(shape {shape}): the file's network does not fit together")


def _precision(conf: DL4JConfiguration) -> str | None:
    return {"FLOAT": "float", "DOUBLE": "double", "HALF": "half"}.get(conf.data_type or "")


def _network_config(mapping: NetworkMapping, all_fields: list[LayerFields], input_type: InputType,
                    updaters: dict) -> NetworkConfig:
    updater = network_updater(updaters, mapping.left_out)
    l2 = network_l2(mapping.layers, mapping.l2_elsewhere, mapping.left_out)
    seed = int(number(all_fields[0].layer.conf.get("seed"), 12345))
    where = mapping.conf.where
    try:
        return NetworkConfig(layers=tuple(mapping.layers), input_type=input_type, seed=seed, updater=updater, l2=l2)
    except ConfigError as exc:
        index = _dl4j_index(exc.where, mapping.owners)
        at = f"layer {index} ({mapping.conf.layers[index].java_class})" if index is not None else "the network"
        raise DL4JFileError(where, f"{at}: {str(exc).split(': ', 1)[-1]}") from None


def _dl4j_index(where: str, owners: list) -> int | None:
    if where and "layers[" in where:
        dl4py_index = int(where.split("layers[", 1)[1].split("]", 1)[0])
        if dl4py_index < len(owners):
            return owners[dl4py_index]
    return None
