"""A dl4py NetworkConfig as DL4J's ``configuration.json``, in the 1.0 dialect (1.0.0-beta4 on):
``@class`` objects, ``nin``/``nout``, ``iupdater``, ``regularization`` lists and ``dataType``,
laid out as the real files DL4J 1.0 writes (``dl4j-integration-tests``' MLPMoon and LenetMnist).

Only what ``config_json`` reads back onto the same dl4py layers is written: dense, output, RNN
output, convolution (2-D, 1-D, transposed), subsampling (2-D, 1-D), upsampling, batch
normalization, dropout, activation, LSTM, embeddings, global pooling and zero padding layers.
Not yet: self-attention (no real DL4J file to copy its SameDiff JSON from). Any other dl4py layer is one DL4JFileError naming its
index and type. DL4J needs two things dl4py infers from its input type: a
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
from dl4py.config.network import NetworkConfig
from dl4py.config.recurrent import LSTM, EmbeddingLayer, EmbeddingSequenceLayer, RnnOutputLayer
from dl4py.config.schedules import ExponentialSchedule, PolySchedule, StepSchedule
from dl4py.config.updaters import Adam, AdamW, Nesterovs, RmsProp, Sgd
from dl4py.dl4j.ndarray import DL4JFileError

_LAYERS = "org.deeplearning4j.nn.conf.layers."
_PREPROCESSORS = "org.deeplearning4j.nn.conf.preprocessor."
_ACTIVATIONS = {"identity": "ActivationIdentity", "relu": "ActivationReLU", "leakyrelu": "ActivationLReLU",
                "tanh": "ActivationTanH", "sigmoid": "ActivationSigmoid", "softmax": "ActivationSoftmax"}
_LOSSES = {"mcxent": "LossMCXENT", "negativeloglikelihood": "LossNegativeLogLikelihood", "mse": "LossMSE",
           "xent": "LossBinaryXENT"}
_WEIGHT_INITS = {"xavier": "WeightInitXavier", "relu": "WeightInitRelu", "normal": "WeightInitNormal",
                 "uniform": "WeightInitUniform", "zero": "WeightInitConstant"}
_NO_CUDNN_ALGORITHMS = {"cudnnBwdDataAlgo": None, "cudnnBwdFilterAlgo": None, "cudnnFwdAlgo": None}
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
                                       GlobalPoolingLayer, Deconvolution2D, Upsampling2D))
    if index == 0 and isinstance(config.input_type, ConvolutionalFlat) and convolutional:
        kind = config.input_type
        return {"@class": _PREPROCESSORS + "FeedForwardToCnnPreProcessor", "inputHeight": kind.height,
                "inputWidth": kind.width, "numChannels": kind.channels}
    if shape.kind == "cnn" and isinstance(layer, DenseLayer) and index > 0:
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
    return {"@class": _LAYERS + java, "layerName": f"layer{index}", **fields}


# ---- the parts every layer with parameters has -------------------------------------------------

def _trained(config: NetworkConfig, layer, l2: float | None = None) -> dict:
    """Updater, regularization, weight init, gradient normalization: DL4J's BaseLayer fields."""
    l2 = getattr(layer, "l2", None) if l2 is None else l2
    l2 = config.l2 if l2 is None else l2
    normalization = getattr(layer, "gradient_normalization", None) or config.gradient_normalization
    threshold = getattr(layer, "gradient_normalization_threshold", None) or config.gradient_normalization_threshold
    regularization = [{"@class": "org.nd4j.linalg.learning.regularization.L2Regularization",
                       "l2": {"@class": "org.nd4j.linalg.schedule.FixedSchedule", "value": l2}}] if l2 else []
    weight_init = getattr(layer, "weight_init", None) or config.weight_init
    return {"biasInit": 0.0, "biasUpdater": None, "constraints": None, "gainInit": 1.0,
            "gradientNormalization": _normalization_name(normalization),
            "gradientNormalizationThreshold": threshold, "idropout": None,
            "iupdater": updater_json(config.updater), "regularization": regularization, "regularizationBias": [],
            "weightInitFn": {"@class": "org.deeplearning4j.nn.weights." + _WEIGHT_INITS.get(weight_init,
                                                                                            "WeightInitXavier")},
            "weightNoise": None}


def _normalization_name(name: str) -> str:
    """dl4py's gradient normalization names are DL4J's enum names (``none`` -> ``None``)."""
    return "None" if str(name).lower() == "none" else str(name)


def _activation(config: NetworkConfig, layer, default: str | None = None) -> dict:
    name = getattr(layer, "activation", None) or default or config.activation
    java = _ACTIVATIONS[name]
    out = {"@class": "org.nd4j.linalg.activations.impl." + java}
    if name == "leakyrelu":
        out["alpha"] = 0.01
    if name == "relu":  # DL4J 1.0's plain ReLU writes its unset options
        out.update(max=None, negativeSlope=None, threshold=None)
    return out


def updater_json(updater) -> dict:
    """dl4py's updater as DL4J's ``iupdater`` object (AdamW: DL4J's Adam has no decoupled decay)."""
    rate = {"learningRate": updater.learning_rate}
    if updater.schedule is not None:
        rate["learningRateSchedule"] = _schedule_json(updater.schedule, updater.learning_rate)
    config = "org.nd4j.linalg.learning.config."
    if isinstance(updater, AdamW):
        raise DL4JFileError("save_dl4j", "updater AdamW: DL4J's Adam has no decoupled weight decay (DL4J's "
                                         "AdamW-like setting is WeightDecay regularization, not written)")
    if isinstance(updater, Adam):
        return {"@class": config + "Adam", **rate, "beta1": updater.beta1, "beta2": updater.beta2,
                "epsilon": updater.epsilon}
    if isinstance(updater, Nesterovs):
        return {"@class": config + "Nesterovs", **rate, "momentum": updater.momentum}
    if isinstance(updater, RmsProp):
        return {"@class": config + "RmsProp", **rate, "rmsDecay": updater.rms_decay, "epsilon": updater.epsilon}
    if isinstance(updater, Sgd):
        return {"@class": config + "Sgd", **rate}
    raise DL4JFileError("save_dl4j", f"updater {type(updater).__name__}: no DL4J counterpart written")


def _schedule_json(schedule, initial: float) -> dict:
    base = {"scheduleType": schedule.unit.upper(), "initialValue": initial}
    prefix = "org.nd4j.linalg.schedule."
    if isinstance(schedule, ExponentialSchedule):
        return {"@class": prefix + "ExponentialSchedule", **base, "gamma": schedule.gamma}
    if isinstance(schedule, StepSchedule):
        return {"@class": prefix + "StepSchedule", **base, "decayRate": schedule.decay_rate, "step": schedule.step}
    if isinstance(schedule, PolySchedule):
        return {"@class": prefix + "PolySchedule", **base, "power": schedule.power, "maxIter": schedule.max_steps}
    raise DL4JFileError("save_dl4j", f"learning-rate schedule {type(schedule).__name__}: DL4J has none like it")


# ---- the layers --------------------------------------------------------------------------------

def _n_in(shape) -> int:
    return shape.dims[-1] if shape.kind == "rnn" else (shape.dims[0] if shape.kind == "cnn" else shape.size)


def _dense(config, layer, shape):
    java = {DenseLayer: "DenseLayer", OutputLayer: "OutputLayer", RnnOutputLayer: "RnnOutputLayer"}[type(layer)]
    n_in = shape.size if shape.kind != "rnn" else shape.dims[-1]
    fields = {"activationFn": _activation(config, layer), **_trained(config, layer), "hasBias": layer.has_bias,
              "nin": n_in, "nout": layer.n_out}
    if java == "DenseLayer":
        fields["hasLayerNorm"] = False
    else:
        fields["lossFn"] = {"@class": "org.nd4j.linalg.lossfunctions.impl." + _LOSSES[layer.loss]}
        if layer.loss in ("mcxent", "negativeloglikelihood"):
            fields["lossFn"]["softmaxClipEps"] = 1e-10  # DL4J's default, as its files write it
    return java, fields


def _convolution(config, layer, shape):
    return "ConvolutionLayer", {
        "activationFn": _activation(config, layer), **_trained(config, layer), "convolutionMode": "Truncate",
        "cudnnAlgoMode": "PREFER_FASTEST", "cudnnAllowFallback": True, **_NO_CUDNN_ALGORITHMS,
        "dilation": list(layer.dilation),
        "hasBias": layer.has_bias, "kernelSize": list(layer.kernel_size), "nin": _n_in(shape), "nout": layer.n_out,
        "padding": list(layer.padding), "stride": list(layer.stride)}


def _deconvolution(config, layer, shape):
    java, fields = _convolution(config, layer, shape)
    return "Deconvolution2D", fields


def _convolution_1d(config, layer, shape):
    """DL4J's 1-D layers are 2-D ones over [time, 1]: each size is [x, 1] (padding [p, 0]), as
    the real CNN1dCharacter file writes them."""
    return "Convolution1DLayer", {
        "activationFn": _activation(config, layer), **_trained(config, layer), "convolutionMode": "Truncate",
        "cudnnAlgoMode": "PREFER_FASTEST", "cudnnAllowFallback": True, **_NO_CUDNN_ALGORITHMS,
        "dilation": [layer.dilation, 1],
        "hasBias": layer.has_bias, "kernelSize": [layer.kernel_size, 1], "nin": _n_in(shape), "nout": layer.n_out,
        "padding": [layer.padding, 0], "stride": [layer.stride, 1]}


def _subsampling_1d(config, layer, shape):
    return "Subsampling1DLayer", _pooling(layer, [layer.kernel_size, 1], [layer.stride, 1], [layer.padding, 0])


def _upsampling(config, layer, shape):
    return "Upsampling2D", {"constraints": None, "idropout": None, "size": list(layer.size)}


def _subsampling(config, layer, shape):
    return "SubsamplingLayer", _pooling(layer, list(layer.kernel_size), list(layer.stride), list(layer.padding))


def _pooling(layer, kernel: list, stride: list, padding: list) -> dict:
    """A pooling layer's fields; dl4py's average pooling counts the padding in its divisor."""
    return {"avgPoolIncludePadInDivisor": layer.pooling_type == "avg", "constraints": None, "convolutionMode": "Truncate",
            "cudnnAllowFallback": True, "dilation": [1, 1], "eps": 1e-8, "gradientNormalization": "None",
            "gradientNormalizationThreshold": 0.0, "idropout": None, "kernelSize": kernel, "padding": padding,
            "pnorm": 0, "poolingType": layer.pooling_type.upper(), "stride": stride}


def _batch_normalization(config, layer, shape):
    n = _n_in(shape)
    fields = _trained(config, layer, l2=0.0)  # dl4py's batch normalization has no L2 on gamma and beta
    fields.pop("weightInitFn")
    return "BatchNormalization", {
        "activationFn": {"@class": "org.nd4j.linalg.activations.impl.ActivationIdentity"}, **fields,
        "beta": 0.0, "cudnnAllowFallback": True, "decay": layer.decay, "eps": layer.eps, "gamma": 1.0,
        "isMinibatch": True, "lockGammaBeta": False, "nin": n, "nout": n, "useLogStd": False}


def _lstm(config, layer, shape):
    return "LSTM", {
        "activationFn": {"@class": "org.nd4j.linalg.activations.impl.ActivationTanH"}, **_trained(config, layer),
        "forgetGateBiasInit": layer.forget_gate_bias_init,
        "gateActivationFn": {"@class": "org.nd4j.linalg.activations.impl.ActivationSigmoid"},
        "helperAllowFallback": True, "nin": _n_in(shape), "nout": layer.n_out}


def _embedding(config, layer, shape):
    java = "EmbeddingSequenceLayer" if isinstance(layer, EmbeddingSequenceLayer) else "EmbeddingLayer"
    fields = {"activationFn": _activation(config, layer, "identity"), **_trained(config, layer),
              "hasBias": False, "nin": layer.vocab_size, "nout": layer.n_out}
    if java == "EmbeddingSequenceLayer":
        fields.update(inferInputLength=True, inputLength=1)
    return java, fields


def _dropout(config, layer, shape):
    keep = 1.0 - layer.rate  # DL4J's p: the probability to keep
    return "DropoutLayer", {"constraints": None, "idropout": {"@class": "org.deeplearning4j.nn.conf.dropout.Dropout",
                                                              "p": keep, "pSchedule": None}}


def _activation_layer(config, layer, shape):
    return "ActivationLayer", {"activationFn": _activation(config, layer), "constraints": None, "idropout": None}


def _global_pooling(config, layer, shape):
    return "GlobalPoolingLayer", {"collapseDimensions": True, "pnorm": 2,
                                  "poolingDimensions": None, "poolingType": layer.pooling_type.upper()}


def _zero_padding(config, layer, shape):
    return "ZeroPaddingLayer", {"padding": list(layer.padding)}


_WRITERS = {
    DenseLayer: _dense, OutputLayer: _dense, RnnOutputLayer: _dense, ConvolutionLayer: _convolution,
    SubsamplingLayer: _subsampling, BatchNormalization: _batch_normalization, LSTM: _lstm,
    EmbeddingLayer: _embedding, EmbeddingSequenceLayer: _embedding, DropoutLayer: _dropout,
    ActivationLayer: _activation_layer, GlobalPoolingLayer: _global_pooling, ZeroPaddingLayer: _zero_padding,
    Deconvolution2D: _deconvolution, Convolution1DLayer: _convolution_1d, Subsampling1DLayer: _subsampling_1d,
    Upsampling2D: _upsampling,
}
