"""The parts of DL4J's 1.0 layer JSON that ``config_writer`` and ``layer_json_extra`` share:
every trained layer's BaseLayer fields (updater, regularization, weight init, gradient
normalization), activations and losses by DL4J's class names, the input size a layer reads,
and a pooling layer's fields with DL4J's convolution mode."""

from __future__ import annotations

from dl4py.config.network import NetworkConfig
from dl4py.config.schedules import ExponentialSchedule, PolySchedule, StepSchedule
from dl4py.config.updaters import Adam, AdamW, Nesterovs, RmsProp, Sgd
from dl4py.dl4j.ndarray import DL4JFileError

LAYERS = "org.deeplearning4j.nn.conf.layers."

_ACTIVATIONS = {"identity": "ActivationIdentity", "relu": "ActivationReLU", "leakyrelu": "ActivationLReLU",
                "tanh": "ActivationTanH", "sigmoid": "ActivationSigmoid", "softmax": "ActivationSoftmax",
                "softsign": "ActivationSoftSign", "hardsigmoid": "ActivationHardSigmoid"}
LOSSES = {"mcxent": "LossMCXENT", "negativeloglikelihood": "LossNegativeLogLikelihood", "mse": "LossMSE",
          "xent": "LossBinaryXENT", "mae": "LossMAE"}
_WEIGHT_INITS = {"xavier": "WeightInitXavier", "relu": "WeightInitRelu", "normal": "WeightInitNormal",
                 "uniform": "WeightInitUniform", "zero": "WeightInitConstant"}
NO_CUDNN_ALGORITHMS = {"cudnnBwdDataAlgo": None, "cudnnBwdFilterAlgo": None, "cudnnFwdAlgo": None}


def trained(config: NetworkConfig, layer, l2: float | None = None) -> dict:
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


def activation_json(config: NetworkConfig, layer, default: str | None = None) -> dict:
    """The layer's activation (its own, or ``default``, or the network's) as DL4J's object."""
    return named_activation(getattr(layer, "activation", None) or default or config.activation)


def named_activation(name: str) -> dict:
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


def n_in(shape) -> int:
    """The size DL4J's nIn holds for input of ``shape``: a step's, the channels, or the flat size."""
    return shape.dims[-1] if shape.kind == "rnn" else (shape.dims[0] if shape.kind == "cnn" else shape.size)


def convolution_fields(config: NetworkConfig, layer) -> dict:
    """A 2-D convolution's fields (plain, transposed, depthwise, separable) but its nIn and nOut."""
    return {"activationFn": activation_json(config, layer), **trained(config, layer), "convolutionMode": "Truncate",
            "cudnnAlgoMode": "PREFER_FASTEST", "cudnnAllowFallback": True, **NO_CUDNN_ALGORITHMS,
            "dilation": list(layer.dilation), "hasBias": layer.has_bias, "kernelSize": list(layer.kernel_size),
            "padding": list(layer.padding), "stride": list(layer.stride)}


def pooling_json(layer, kernel: list, stride: list, padding: list) -> dict:
    """A pooling layer's fields: in Truncate mode dl4py's average pooling counts the padding in its
    divisor; in Same mode it leaves it out (DL4J's default there)."""
    same = getattr(layer, "convolution_mode", "truncate") == "same"
    return {"avgPoolIncludePadInDivisor": layer.pooling_type == "avg" and not same, "constraints": None,
            "convolutionMode": "Same" if same else "Truncate",
            "cudnnAllowFallback": True, "dilation": [1, 1], "eps": 1e-8, "gradientNormalization": "None",
            "gradientNormalizationThreshold": 0.0, "idropout": None, "kernelSize": kernel, "padding": padding,
            "pnorm": 0, "poolingType": layer.pooling_type.upper(), "stride": stride}
