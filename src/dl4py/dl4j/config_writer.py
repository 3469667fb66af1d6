"""A dl4py NetworkConfig as DL4J's ``configuration.json``, in the 1.0 dialect (1.0.0-beta4 on):
``@class`` objects, ``nin``/``nout``, ``iupdater``, ``regularization`` lists and ``dataType``,
laid out as the real files DL4J 1.0 writes (``dl4j-integration-tests``' MLPMoon and LenetMnist).

Only what ``config_json`` reads back onto the same dl4py layers is written: dense, output, RNN
output, convolution (2-D, 1-D, transposed), subsampling (2-D, 1-D; Same mode too), upsampling,
batch normalization, dropout, activation, LSTM, embeddings, global pooling and zero padding
layers here, and DL4J's own layers dl4py took for its files (peephole, simple and bidirectional
recurrent layers, depthwise and separable convolutions, cropping, 1-D zero padding, the CNN loss
layer) in ``layer_json_extra``; the parts they share are ``layer_json_parts``. Not yet:
self-attention (no real DL4J file to copy its SameDiff JSON from). Any other dl4py layer is one
DL4JFileError naming its index and type. DL4J needs two things dl4py infers from its input type: a
``FeedForwardToCnnPreProcessor`` where flat rows enter a convolution (``convolutional_flat``), and
a ``CnnToFeedForwardPreProcessor`` where images enter a dense layer; both are written.

dl4py's one updater and the layer or network L2 go into every layer with parameters (DL4J keeps
them per layer); each layer's activation and weight init are the ones it runs with (its own or
the network's). Weight init only shapes fresh parameters: written for information.
"""

from __future__ import annotations

import json

from dl4py.config.frozen import FrozenLayer
from dl4py.config.input_type import ConvolutionalFlat
from dl4py.config.layers import (ActivationLayer, BatchNormalization, ConvolutionLayer, DenseLayer, DropoutLayer,
                                 GlobalPoolingLayer, OutputLayer, SubsamplingLayer)
from dl4py.config.layers_extra import (Convolution1DLayer, Deconvolution2D, Subsampling1DLayer, Upsampling2D,
                                       ZeroPaddingLayer)
from dl4py.config.layers_conv import CnnLossLayer, DepthwiseConvolution2D, SeparableConvolution2D
from dl4py.config.network import NetworkConfig
from dl4py.config.recurrent import LSTM, EmbeddingLayer, EmbeddingSequenceLayer, RnnOutputLayer
from dl4py.dl4j import layer_json_extra
from dl4py.dl4j.layer_json_parts import (
    LAYERS,
    LOSSES,
    NO_CUDNN_ALGORITHMS,
    activation_json,
    convolution_fields,
    n_in,
    pooling_json,
    trained,
)
from dl4py.dl4j.ndarray import DL4JFileError

_PREPROCESSORS = "org.deeplearning4j.nn.conf.preprocessor."
_DATA_TYPES = {"float": "FLOAT", "double": "DOUBLE", "half": "HALF"}


def configuration_json(config: NetworkConfig, precision: str, counters: tuple[int, int] = (0, 0),
                       where: str = "save_dl4j") -> str:
    """DL4J's ``MultiLayerConfiguration`` JSON for ``config`` at ``precision`` (dl4py's name:
    float, double, half), with ``counters`` = (epochs, iterations) trained."""
    data_type = _DATA_TYPES.get(precision)
    if data_type is None:
        raise DL4JFileError(where, f"precision {precision}: DL4J networks are FLOAT, DOUBLE or HALF")
    epochs, iterations = counters
    shapes = config.layer_shapes()
    confs, preprocessors = [], {}
    for index, (layer, shape) in enumerate(zip(config.layers, shapes)):
        before = shapes[index - 1].output if index else shape.input  # dl4py's dense input is already flat
        preprocessor = _preprocessor(config, index, layer, before)
        if preprocessor is not None:
            preprocessors[str(index)] = preprocessor
        confs.append({
            "cacheMode": "NONE", "dataType": data_type, "epochCount": epochs, "iterationCount": iterations,
            "layer": _layer(config, index, layer, shape.input, where), "maxNumLineSearchIterations": 5,
            "miniBatch": True, "minimize": True, "optimizationAlgo": "STOCHASTIC_GRADIENT_DESCENT",
            "seed": config.seed, "stepFunction": None, "variables": _variables(layer)})
    network = {
        "backpropType": "Standard", "cacheMode": "NONE", "confs": confs, "dataType": data_type,
        "epochCount": epochs, "inferenceWorkspaceMode": "ENABLED", "inputPreProcessors": preprocessors,
        "iterationCount": iterations, "tbpttBackLength": 20, "tbpttFwdLength": 20,
        "trainingWorkspaceMode": "ENABLED", "validateOutputLayerConfig": True}
    return json.dumps(network, indent=2)


def _variables(layer) -> list[str]:
    """DL4J's parameter keys of the layer, in the order its initializer adds them (conv too: W,
    b, though b comes first in the flat vector)."""
    extra = layer_json_extra.variables(layer)
    if extra is not None:
        return extra
    if isinstance(layer, BatchNormalization):
        return ["gamma", "beta", "mean", "var"]
    if isinstance(layer, LSTM):
        return ["W", "RW", "b"]
    if isinstance(layer, (EmbeddingLayer, EmbeddingSequenceLayer)):
        return ["W"]
    if type(layer) in (DenseLayer, OutputLayer, RnnOutputLayer, ConvolutionLayer, Deconvolution2D,
                       Convolution1DLayer):
        return ["W", "b"] if layer.has_bias else ["W"]
    return []


def _preprocessor(config: NetworkConfig, index: int, layer, shape) -> dict | None:
    convolutional = isinstance(layer, (ConvolutionLayer, SubsamplingLayer, BatchNormalization, ZeroPaddingLayer,
                                       GlobalPoolingLayer, Deconvolution2D, Upsampling2D, DepthwiseConvolution2D,
                                       SeparableConvolution2D))
    if index == 0 and isinstance(config.input_type, ConvolutionalFlat) and convolutional:
        kind = config.input_type
        return {"@class": _PREPROCESSORS + "FeedForwardToCnnPreProcessor", "inputHeight": kind.height,
                "inputWidth": kind.width, "numChannels": kind.channels}
    if shape.kind == "cnn" and isinstance(layer, DenseLayer) and not isinstance(layer, CnnLossLayer) and index > 0:
        channels, height, width = shape.dims
        return {"@class": _PREPROCESSORS + "CnnToFeedForwardPreProcessor", "inputHeight": height,
                "inputWidth": width, "numChannels": channels}
    return None


def _layer(config: NetworkConfig, index: int, layer, shape, where: str) -> dict:
    if isinstance(layer, FrozenLayer) or type(layer) not in _WRITERS:
        raise DL4JFileError(where, f"layer {index} ({type(layer).__name__}, dl4py type "
                                   f"{getattr(layer, 'type_name', None)!r}): dl4py does not write it as a DL4J "
                                   "layer (no DL4J counterpart, or not written yet); nothing was written")
    java, fields = _WRITERS[type(layer)](config, layer, shape)
    return {"@class": LAYERS + java, "layerName": f"layer{index}", **fields}


# ---- the layers --------------------------------------------------------------------------------

def _dense(config, layer, shape):
    java = {DenseLayer: "DenseLayer", OutputLayer: "OutputLayer", RnnOutputLayer: "RnnOutputLayer"}[type(layer)]
    n_in = shape.size if shape.kind != "rnn" else shape.dims[-1]
    fields = {"activationFn": activation_json(config, layer), **trained(config, layer), "hasBias": layer.has_bias,
              "nin": n_in, "nout": layer.n_out}
    if java == "DenseLayer":
        fields["hasLayerNorm"] = False
    else:
        fields["lossFn"] = {"@class": "org.nd4j.linalg.lossfunctions.impl." + LOSSES[layer.loss]}
        if layer.loss in ("mcxent", "negativeloglikelihood"):
            fields["lossFn"]["softmaxClipEps"] = 1e-10  # DL4J's default, as its files write it
    return java, fields


def _convolution(config, layer, shape):
    return "ConvolutionLayer", {**convolution_fields(config, layer), "nin": n_in(shape), "nout": layer.n_out}


def _deconvolution(config, layer, shape):
    java, fields = _convolution(config, layer, shape)
    return "Deconvolution2D", fields


def _convolution_1d(config, layer, shape):
    """DL4J's 1-D layers are 2-D ones over [time, 1]: each size is [x, 1] (padding [p, 0]), as
    the real CNN1dCharacter file writes them."""
    mode = "Same" if layer.convolution_mode == "same" else "Truncate"
    return "Convolution1DLayer", {
        "activationFn": activation_json(config, layer), **trained(config, layer), "convolutionMode": mode,
        "cudnnAlgoMode": "PREFER_FASTEST", "cudnnAllowFallback": True, **NO_CUDNN_ALGORITHMS,
        "dilation": [layer.dilation, 1],
        "hasBias": layer.has_bias, "kernelSize": [layer.kernel_size, 1], "nin": n_in(shape), "nout": layer.n_out,
        "padding": [layer.padding, 0], "stride": [layer.stride, 1]}


def _subsampling_1d(config, layer, shape):
    return "Subsampling1DLayer", pooling_json(layer, [layer.kernel_size, 1], [layer.stride, 1], [layer.padding, 0])


def _upsampling(config, layer, shape):
    return "Upsampling2D", {"constraints": None, "idropout": None, "size": list(layer.size)}


def _subsampling(config, layer, shape):
    return "SubsamplingLayer", pooling_json(layer, list(layer.kernel_size), list(layer.stride), list(layer.padding))


def _batch_normalization(config, layer, shape):
    n = n_in(shape)
    fields = trained(config, layer, l2=0.0)  # dl4py's batch normalization has no L2 on gamma and beta
    fields.pop("weightInitFn")
    return "BatchNormalization", {
        "activationFn": {"@class": "org.nd4j.linalg.activations.impl.ActivationIdentity"}, **fields,
        "beta": 0.0, "cudnnAllowFallback": True, "decay": layer.decay, "eps": layer.eps, "gamma": 1.0,
        "isMinibatch": True, "lockGammaBeta": False, "nin": n, "nout": n, "useLogStd": False}


def _embedding(config, layer, shape):
    java = "EmbeddingSequenceLayer" if isinstance(layer, EmbeddingSequenceLayer) else "EmbeddingLayer"
    fields = {"activationFn": activation_json(config, layer, "identity"), **trained(config, layer),
              "hasBias": False, "nin": layer.vocab_size, "nout": layer.n_out}
    if java == "EmbeddingSequenceLayer":
        fields.update(inferInputLength=True, inputLength=1)
    return java, fields


def _dropout(config, layer, shape):
    keep = 1.0 - layer.rate  # DL4J's p: the probability to keep
    return "DropoutLayer", {"constraints": None, "idropout": {"@class": "org.deeplearning4j.nn.conf.dropout.Dropout",
                                                              "p": keep, "pSchedule": None}}


def _activation_layer(config, layer, shape):
    return "ActivationLayer", {"activationFn": activation_json(config, layer), "constraints": None, "idropout": None}


def _global_pooling(config, layer, shape):
    return "GlobalPoolingLayer", {"collapseDimensions": True, "pnorm": 2,
                                  "poolingDimensions": None, "poolingType": layer.pooling_type.upper()}


def _zero_padding(config, layer, shape):
    return "ZeroPaddingLayer", {"padding": list(layer.padding)}


_WRITERS = {
    DenseLayer: _dense, OutputLayer: _dense, RnnOutputLayer: _dense, ConvolutionLayer: _convolution,
    SubsamplingLayer: _subsampling, BatchNormalization: _batch_normalization, LSTM: layer_json_extra.recurrent_json,
    EmbeddingLayer: _embedding, EmbeddingSequenceLayer: _embedding, DropoutLayer: _dropout,
    ActivationLayer: _activation_layer, GlobalPoolingLayer: _global_pooling, ZeroPaddingLayer: _zero_padding,
    Deconvolution2D: _deconvolution, Convolution1DLayer: _convolution_1d, Subsampling1DLayer: _subsampling_1d,
    Upsampling2D: _upsampling,
}
_WRITERS.update(layer_json_extra.WRITERS)
