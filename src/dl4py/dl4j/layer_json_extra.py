"""DL4J 1.0 JSON for the layers dl4py took from DL4J's model files: the peephole, simple and
bidirectional recurrent layers, depthwise and separable convolutions, cropping, 1-D zero padding
and the CNN loss layer. Each writer is ``(config, layer, shape) -> (class under
org.deeplearning4j.nn.conf.layers, fields)``, as ``config_writer``'s, and gives what
``recurrent_mapping`` and ``convolution_mapping`` read back onto the same dl4py layer.
``VARIABLES`` are DL4J's parameter keys of each, in its initializer's order.
"""

from __future__ import annotations

from dl4py.config.layers_conv import (
    CnnLossLayer,
    Cropping1D,
    Cropping2D,
    DepthwiseConvolution2D,
    SeparableConvolution2D,
    ZeroPadding1DLayer,
)
from dl4py.config.recurrent import GRU, LSTM
from dl4py.config.recurrent_extra import Bidirectional, GravesBidirectionalLSTM, GravesLSTM, SimpleRnn
from dl4py.dl4j.layer_json_parts import LAYERS, LOSSES, convolution_fields, n_in, named_activation, trained
from dl4py.dl4j.ndarray import DL4JFileError


def recurrent_json(config, layer, shape) -> tuple[str, dict]:
    """An LSTM (any activation), GravesLSTM, GravesBidirectionalLSTM or SimpleRnn."""
    fields = {"activationFn": named_activation(layer.activation or "tanh"), **trained(config, layer),
              "nin": n_in(shape), "nout": layer.n_out}
    if isinstance(layer, SimpleRnn):
        return "recurrent.SimpleRnn", {**fields, "hasLayerNorm": False, "weightInitFnRecurrent": None}
    fields.update(forgetGateBiasInit=layer.forget_gate_bias_init,
                  gateActivationFn=named_activation(getattr(layer, "gate_activation", "sigmoid")),
                  helperAllowFallback=True)
    java = {LSTM: "LSTM", GravesLSTM: "GravesLSTM", GravesBidirectionalLSTM: "GravesBidirectionalLSTM"}[type(layer)]
    return java, fields


def bidirectional_json(config, layer, shape) -> tuple[str, dict]:
    """DL4J's Bidirectional: the wrapped layer's object twice (fwd, bwd) and the mode."""
    inner = layer.layer
    if isinstance(inner, GRU):
        raise DL4JFileError("save_dl4j", "a Bidirectional GRU: DL4J has no GRU layer; nothing was written")
    java, fields = recurrent_json(config, inner, shape)
    wrapped = {"@class": LAYERS + java, **fields}
    return "recurrent.Bidirectional", {
        "bwd": dict(wrapped), "constraints": None, "fwd": wrapped, "gradientNormalization": "None",
        "gradientNormalizationThreshold": 1.0, "idropout": None, "mode": layer.mode.upper(),
        "nin": n_in(shape), "nout": inner.n_out}


def depthwise_json(config, layer, shape) -> tuple[str, dict]:
    channels = n_in(shape)
    return "DepthwiseConvolution2D", {**convolution_fields(config, layer), "depthMultiplier": layer.depth_multiplier,
                                      "nin": channels, "nout": channels * layer.depth_multiplier}


def separable_json(config, layer, shape) -> tuple[str, dict]:
    return "SeparableConvolution2D", {**convolution_fields(config, layer), "depthMultiplier": layer.depth_multiplier,
                                      "nin": n_in(shape), "nout": layer.n_out}


def cropping_json(config, layer, shape) -> tuple[str, dict]:
    java = "convolutional.Cropping2D" if isinstance(layer, Cropping2D) else "convolutional.Cropping1D"
    return java, {"constraints": None, "cropping": list(layer.cropping), "idropout": None}


def zero_padding_1d_json(config, layer, shape) -> tuple[str, dict]:
    return "ZeroPadding1DLayer", {"constraints": None, "idropout": None, "padding": list(layer.padding)}


def cnn_loss_json(config, layer, shape) -> tuple[str, dict]:
    return "CnnLossLayer", {"activationFn": named_activation(layer.resolved_activation()),
                            "lossFn": {"@class": "org.nd4j.linalg.lossfunctions.impl." + LOSSES[layer.loss]},
                            "nin": 0, "nout": 0, **trained(config, layer)}


WRITERS = {
    GravesLSTM: recurrent_json, GravesBidirectionalLSTM: recurrent_json, SimpleRnn: recurrent_json,
    Bidirectional: bidirectional_json, DepthwiseConvolution2D: depthwise_json, SeparableConvolution2D: separable_json,
    Cropping2D: cropping_json, Cropping1D: cropping_json, ZeroPadding1DLayer: zero_padding_1d_json,
    CnnLossLayer: cnn_loss_json,
}


def variables(layer) -> list[str] | None:
    """DL4J's parameter keys of ``layer`` in its initializer's order; None for a layer not here."""
    if isinstance(layer, (GravesLSTM, SimpleRnn)):
        return ["W", "RW", "b"]
    if isinstance(layer, GravesBidirectionalLSTM):
        return ["WF", "RWF", "bF", "WB", "RWB", "bB"]
    if isinstance(layer, Bidirectional):
        return [prefix + key for prefix in "fb" for key in ("W", "RW", "b")]
    if isinstance(layer, DepthwiseConvolution2D):
        return ["W", "b"] if layer.has_bias else ["W"]
    if isinstance(layer, SeparableConvolution2D):
        return ["W", "pW", "b"] if layer.has_bias else ["W", "pW"]
    if isinstance(layer, (Cropping1D, Cropping2D, ZeroPadding1DLayer, CnnLossLayer)):
        return []
    return None
