"""DL4J's layers mapped onto dl4py's, one at a time: ``map_layer`` picks the mapper for the
layer's class (``MAPPERS``) or the user's registration (``custom_layers``), and the mapper adds
the dl4py layers it becomes to the ``NetworkMapping``. Here: dense and output layers, batch
normalization, self-attention, frozen layers, embeddings, dropout and activation layers; the
convolutional ones are in ``convolution_mapping``, the recurrent ones in ``recurrent_mapping``.

Data formats (DL4J 1.0.0-beta7 on): every layer's channels-first fields must say NCHW, as dl4py
computes (a channels-last file would need its weights and flattening reordered, which DL4J has
done differently across versions); a sequence layer may say NCW or NWC, which differ only in how
DL4J's data is laid out, not in what the layer computes: dl4py takes ``[batch, time, size]``.

What changes the network's output and dl4py cannot represent (a layer, activation, loss or
setting it lacks) is a DL4JFileError naming the file, the layer index and the DL4J class; a
class nothing maps is refused by its name.
"""

from __future__ import annotations

from typing import Callable

from dl4py.config.frozen import FrozenLayer
from dl4py.config.layers import ActivationLayer, BatchNormalization, DenseLayer, DropoutLayer, Layer, OutputLayer
from dl4py.config.layers_extra import SelfAttentionLayer
from dl4py.config.recurrent import EmbeddingLayer, EmbeddingSequenceLayer, RnnOutputLayer
from dl4py.dl4j import custom_layers
from dl4py.dl4j.convolution_mapping import (
    map_cnn_loss,
    map_convolution,
    map_convolution_1d,
    map_cropping,
    map_cropping_1d,
    map_deconvolution,
    map_depthwise_convolution,
    map_global_pooling,
    map_separable_convolution,
    map_subsampling,
    map_subsampling_1d,
    map_upsampling,
    map_zero_padding,
    map_zero_padding_1d,
)
from dl4py.dl4j.json_dialects import LayerFields, number, wrapped_layer
from dl4py.dl4j.mapping_state import NetworkMapping
from dl4py.dl4j.ndarray import DL4JFileError
from dl4py.dl4j.recurrent_mapping import map_bidirectional, map_last_time_step, map_lstm
from dl4py.dl4j.training_settings import dropout_rate
from dl4py.errors import ConfigError


def map_layer(mapping: NetworkMapping, fields: LayerFields) -> None:
    """Add what DL4J layer ``fields`` becomes in dl4py to ``mapping``; a DL4JFileError naming
    the layer where nothing maps it."""
    _check_data_format(fields)
    _check_data_format(wrapped_layer(fields))
    registered = custom_layers.custom_layer(fields.java_class)
    if registered is not None:
        layer = _custom(registered, fields)
        if getattr(layer, "l2", None) is None:
            mapping.l2_from_network(fields)
        mapping.add_with_dropout(fields, layer, "op")
        return
    mapper = MAPPERS.get(fields.layer.kind)
    if mapper is None:
        raise _unknown(fields)
    mapper(mapping, fields)


# Where DL4J's layers keep their data format (beta7 on), by kind of format.
_CHANNELS_FORMAT_KEYS = ("cnn2dDataFormat", "cnn2DFormat", "dataFormat", "format")
_SEQUENCE_FORMAT_KEYS = ("rnnDataFormat", "outputFormat")


def _check_data_format(fields: LayerFields) -> None:
    if not fields.java_class.startswith("org.deeplearning4j."):
        return  # a user's own layer class: its fields mean what its author chose
    for key in _CHANNELS_FORMAT_KEYS:
        value = fields.get(key)
        if isinstance(value, str) and value.upper() != "NCHW":
            raise fields.error(f"data format {key} {value}: dl4py's convolutional layers take channels first "
                               "(NCHW), and only such files are mapped")
    for key in _SEQUENCE_FORMAT_KEYS:
        value = fields.get(key)
        if isinstance(value, str) and value.upper() not in ("NCW", "NWC"):
            raise fields.error(f"sequence format {key} {value}: dl4py maps NCW and NWC (as its [batch, time, size])")


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


def _map_dense(mapping: NetworkMapping, fields: LayerFields) -> None:
    if fields.get("hasLayerNorm"):
        raise fields.error("a dense layer with layer normalization (hasLayerNorm) has no dl4py counterpart")
    kind = fields.layer.kind
    cls = {"DenseLayer": DenseLayer, "OutputLayer": OutputLayer, "RnnOutputLayer": RnnOutputLayer}[kind]
    options = dict(n_out=fields.n_out, activation=fields.activation(), has_bias=bool(fields.get("hasBias", True)),
                   l2=mapping.l2(fields), **mapping.common(fields))
    if cls is not DenseLayer:
        options["loss"] = fields.loss()
    mapping.add_with_dropout(fields, cls(**options), "op")


def _map_batch_normalization(mapping: NetworkMapping, fields: LayerFields) -> None:
    if fields.get("lockGammaBeta"):
        raise fields.error("lockGammaBeta (fixed gamma and beta) has no dl4py counterpart")
    options = {k: v for k, v in mapping.common(fields).items() if k != "weight_init"}  # it has no weights
    layer = BatchNormalization(eps=number(fields.raw.get("eps"), 1e-5), decay=number(fields.raw.get("decay"), 0.9),
                               **options)
    mapping.add_with_dropout(fields, layer, "op")
    activation = fields.activation(default="identity")
    if activation != "identity":  # DL4J's batch normalization applies its activation after
        mapping.add(ActivationLayer(activation=activation), fields)


def _map_frozen(mapping: NetworkMapping, fields: LayerFields) -> None:
    inner = wrapped_layer(fields)
    if inner is fields:
        raise fields.error("a FrozenLayer without the layer it freezes")
    before = len(mapping.layers)
    map_layer(mapping, inner)
    if len(mapping.layers) != before + 1:
        raise fields.error(f"a frozen {inner.layer.kind} maps onto {len(mapping.layers) - before} dl4py layers; "
                           "dl4py freezes one")
    mapping.layers[-1] = FrozenLayer(layer=mapping.layers[-1])


def _map_embedding(mapping: NetworkMapping, fields: LayerFields) -> None:
    sequence = fields.layer.kind == "EmbeddingSequenceLayer"
    if fields.get("hasBias", not sequence):
        raise fields.error("an embedding with a bias (hasBias) has no dl4py counterpart: dl4py's embedding is a "
                           "lookup table only")
    cls = EmbeddingSequenceLayer if sequence else EmbeddingLayer
    mapping.l2_from_network(fields)  # dl4py's embedding has no l2 field
    layer = cls(vocab_size=fields.n_in, n_out=fields.n_out, activation=fields.activation(default="identity"),
                **mapping.common(fields))
    mapping.add_with_dropout(fields, layer, "op")


def _map_self_attention(mapping: NetworkMapping, fields: LayerFields) -> None:
    """DL4J's multi-head dot-product attention (libnd4j's): scores divided by the square root of
    the head size (the input size without projection), softmax over the keys, no biases: dl4py's,
    where DL4J scales (``scaled``, always so before 1.0.0-M1)."""
    if fields.get("scaled", True) is False:
        raise fields.error("self-attention without scaling (scaled=false): dl4py's divides the scores by the "
                           "square root of the head size, as DL4J does by default")
    project = bool(fields.get("projectInput", False))
    heads = fields.integer("nHeads", "nheads", default=1)
    head_size = fields.integer("headSize") if project else None  # without projection: the input's size
    mapping.l2_from_network(fields)  # dl4py's self-attention has no l2 field
    layer = SelfAttentionLayer(n_out=fields.n_out, n_heads=heads, head_size=head_size or None,
                               project_input=project, **mapping.common(fields))
    mapping.add_with_dropout(fields, layer, "op")


def _map_dropout(mapping: NetworkMapping, fields: LayerFields) -> None:
    rate = dropout_rate(fields, mapping.left_out)
    mapping.add(DropoutLayer(rate=rate), fields)


def _map_activation(mapping: NetworkMapping, fields: LayerFields) -> None:
    mapping.add_with_dropout(fields, ActivationLayer(activation=fields.activation()), None)


MAPPERS: dict[str, Callable[[NetworkMapping, LayerFields], None]] = {
    "DenseLayer": _map_dense, "OutputLayer": _map_dense, "RnnOutputLayer": _map_dense,
    "ConvolutionLayer": map_convolution, "Convolution2D": map_convolution,
    "SubsamplingLayer": map_subsampling, "Pooling2D": map_subsampling,
    "BatchNormalization": _map_batch_normalization, "LSTM": map_lstm, "LastTimeStep": map_last_time_step,
    "GravesLSTM": map_lstm, "GravesBidirectionalLSTM": map_lstm, "SimpleRnn": map_lstm,
    "Bidirectional": map_bidirectional,
    "FrozenLayer": _map_frozen, "EmbeddingLayer": _map_embedding, "EmbeddingSequenceLayer": _map_embedding,
    "DropoutLayer": _map_dropout, "ActivationLayer": _map_activation, "GlobalPoolingLayer": map_global_pooling,
    "ZeroPaddingLayer": map_zero_padding, "Upsampling2D": map_upsampling,
    "Convolution1DLayer": map_convolution_1d, "Convolution1D": map_convolution_1d,
    "Subsampling1DLayer": map_subsampling_1d, "Pooling1D": map_subsampling_1d,
    "Deconvolution2D": map_deconvolution, "SelfAttentionLayer": _map_self_attention,
    "DepthwiseConvolution2D": map_depthwise_convolution, "SeparableConvolution2D": map_separable_convolution,
    "Cropping2D": map_cropping, "Cropping1D": map_cropping_1d, "ZeroPadding1DLayer": map_zero_padding_1d,
    "CnnLossLayer": map_cnn_loss,
}
DENSE = {"DenseLayer", "OutputLayer", "CenterLossOutputLayer"}
CONVOLUTIONAL = {"ConvolutionLayer", "Convolution2D", "SubsamplingLayer", "Pooling2D", "BatchNormalization",
                 "Deconvolution2D", "DepthwiseConvolution2D", "SeparableConvolution2D"}
# Layers whose nIn, as the first layer, is the size of each step of a sequence.
SEQUENCES = {"LSTM", "GravesLSTM", "GravesBidirectionalLSTM", "RnnOutputLayer", "SimpleRnn", "Bidirectional",
             "Convolution1DLayer", "Convolution1D", "SelfAttentionLayer"}
NO_UPDATER = {"SubsamplingLayer", "Pooling2D", "DropoutLayer", "ActivationLayer", "GlobalPoolingLayer",
              "ZeroPaddingLayer", "Upsampling2D", "FrozenLayer", "Subsampling1DLayer", "Pooling1D", "Cropping2D",
              "Cropping1D", "ZeroPadding1DLayer", "CnnLossLayer"}

