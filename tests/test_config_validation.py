"""One validation path (issue 14, point 8): however a config is made, it is checked and
canonicalised the same way; syntax errors name the file and line; DL4J's names are accepted."""

from __future__ import annotations

import pytest
import torch
import yaml

from dl4py import MultiLayerNetwork
from dl4py.cli import main
from dl4py.config import (
    Adam,
    ConvolutionLayer,
    DenseLayer,
    GlobalPoolingLayer,
    InputType,
    Layer,
    Nesterovs,
    NetworkConfig,
    OutputLayer,
    RunConfig,
    Sgd,
    SubsamplingLayer,
    Updater,
)
from dl4py.errors import ConfigError
from dl4py.nn.builder import OutputLoss

NETWORK_YAML = """\
network:
  seed: 1
  input_type: {type: feed_forward, size: 4}
  layers:
    - {type: dense, n_out: 3}
    - {type: output, n_out: 2}
  l2: 0.1: 2
"""  # line 7, column 10: the second ':' of "0.1: 2"


# ---- syntax errors name the file and line ---------------------------------------------------

@pytest.mark.parametrize("name, text, where, problem", [
    ("BAD.yaml", NETWORK_YAML, "line 7, column 10", "mapping values are not allowed here"),
    ("BAD.json", '{"network": {"seed": 1,\n  "layers": [}\n}\n', "line 2, column 14", "Expecting value"),
])
def test_cli_names_file_and_line_of_a_syntax_error(tmp_path, capsys, name, text, where, problem):
    path = tmp_path / name
    path.write_text(text)
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "<unicode string>" not in err
    assert f"{path}, {where}: " in err and problem in err


def test_syntax_error_of_yaml_text_and_of_a_set_argument():
    with pytest.raises(ConfigError, match=r"^YAML text, line 3, column 2: .*expected <block end>") as info:
        NetworkConfig.from_yaml("layers:\n  - {type: dense}\n bad: 1\n")
    assert (getattr(info.value, "line", None), getattr(info.value, "column", None)) == (3, 2)  # " bad: 1": one space short
    with pytest.raises(ConfigError, match=r"^JSON text, line 1, column 2: "):
        NetworkConfig.from_json("{]")
    run = RunConfig.from_dict({"network": yaml.safe_load(NETWORK_YAML.replace("0.1: 2", "0.1"))["network"]})
    with pytest.raises(ConfigError, match=r"^--set network\.layers\[0\]\.n_out=\[5, 5: the value is not valid YAML"):
        run.with_overrides(["network.layers[0].n_out=[5, 5"])


# ---- every way of making a config runs the same checks --------------------------------------

def _from_yaml_layer(type_name: str, fields: dict) -> Layer:
    return Layer.from_dict(yaml.safe_load(yaml.safe_dump({"type": type_name, **fields})))


@pytest.mark.parametrize("cls, fields, canonical", [
    (OutputLayer, {"n_out": 3, "loss": "NEGATIVELOGLIKELIHOOD"}, {"loss": "negativeloglikelihood"}),
    (ConvolutionLayer, {"n_out": 2, "kernel_size": 5}, {"kernel_size": (5, 5)}),
    (ConvolutionLayer, {"n_out": 2, "kernel_size": [3, 1], "stride": 2}, {"kernel_size": (3, 1), "stride": (2, 2)}),
    (DenseLayer, {"n_out": 2, "activation": "RELU", "weight_init": "XAVIER"},
     {"activation": "relu", "weight_init": "xavier"}),
    (SubsamplingLayer, {"pooling_type": "MAX"}, {"pooling_type": "max"}),
])
def test_direct_construction_is_canonicalised_like_yaml(cls, fields, canonical):
    direct = cls(**fields)
    assert direct == _from_yaml_layer(cls.type_name, fields)
    assert {k: getattr(direct, k) for k in canonical} == canonical


@pytest.mark.parametrize("cls, fields, field, message", [
    (DenseLayer, {"n_out": 2, "activation": "nonsense"}, "activation", "must be one of 'identity'"),
    (ConvolutionLayer, {"n_out": 2, "kernel_size": "five"}, "kernel_size", "must be a list of 2 values"),
    (ConvolutionLayer, {"n_out": 2, "kernel_size": 0}, "kernel_size", r"must be positive, got \[0, 0\]"),
    (OutputLayer, {"n_out": 2, "loss": "L2"}, "loss", "must be one of"),  # DL4J's L2 sums: it is not mse
    (DenseLayer, {"n_out": "ten"}, "n_out", "must be an integer"),
    (Nesterovs, {"learning_rate": -0.1}, "learning_rate", "must be positive"),
    (Adam, {"beta1": 1.5}, "beta1", r"must be in \[0, 1\)"),
    (Sgd, {"learning_rate": "fast"}, "learning_rate", "must be a number"),
])
def test_direct_construction_refuses_like_yaml(cls, fields, field, message):
    with pytest.raises(ConfigError, match=rf"^{cls.__name__}\.{field}: {message}"):
        cls(**fields)
    family = Layer if issubclass(cls, Layer) else Updater
    with pytest.raises(ConfigError, match=rf"^{field}: {message}"):
        family.from_dict(yaml.safe_load(yaml.safe_dump({"type": cls.type_name, **fields})))


def test_network_config_names_the_layer_index_however_it_is_made():
    layers = [DenseLayer(n_out=4), {"type": "dense", "n_out": 0}, OutputLayer(n_out=2)]
    with pytest.raises(ConfigError, match=r"^network\.layers\[1\]\.n_out: must be positive"):
        NetworkConfig(layers=layers, input_type=InputType.feed_forward(3))
    with pytest.raises(ConfigError, match=r"^network\.activation: must be one of"):
        NetworkConfig(layers=[OutputLayer(n_out=2)], input_type=InputType.feed_forward(3), activation="swish")
    with pytest.raises(ConfigError, match=r"^network\.updater\.momentum: must be in"):
        NetworkConfig(layers=[OutputLayer(n_out=2)], input_type=InputType.feed_forward(3),
                      updater={"type": "NESTEROVS", "momentum": 2})
    with pytest.raises(ConfigError, match=r"^FeedForward\.size: must be positive"):
        InputType.feed_forward(0)


def test_builder_direct_and_yaml_give_one_config():
    direct = NetworkConfig(
        layers=[ConvolutionLayer(n_out=2, kernel_size=3, activation="RELU"), GlobalPoolingLayer("SUM"),
                OutputLayer(n_out=2, loss="MCXENT")],
        input_type=InputType.convolutional(6, 6, 1), weight_init="XAVIER", updater=Nesterovs(0.05),
    )
    built = (NetworkConfig.builder().weight_init("XAVIER").updater({"type": "NESTEROVS", "learning_rate": 0.05})
             .layer(ConvolutionLayer(n_out=2, kernel_size=3, activation="RELU"))
             .layer({"type": "GLOBAL_POOLING", "pooling_type": "SUM"})
             .layer(OutputLayer(n_out=2, loss="MCXENT"))
             .input_type(InputType.convolutional(6, 6, 1)).build())
    assert direct == built == NetworkConfig.from_yaml(direct.to_yaml())
    assert direct.layers[0].kernel_size == (3, 3) and direct.layers[2].loss == "mcxent"


def test_directly_built_negative_log_likelihood_trains_with_nll_not_mse():
    config = NetworkConfig(
        layers=[DenseLayer(n_out=8, activation="TANH"), OutputLayer(n_out=3, loss="NEGATIVELOGLIKELIHOOD")],
        input_type=InputType.feed_forward(5), seed=4,
    )
    net = MultiLayerNetwork(config)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 5, generator=gen), torch.randint(0, 3, (32,), generator=gen)
    probs = net.output(x)
    assert torch.allclose(probs.sum(dim=1), torch.ones(32), atol=1e-5)  # softmax, the loss's activation
    nll = -probs[torch.arange(32), y].log().mean().item()
    assert net.score((x, y)) == pytest.approx(nll, rel=1e-4)


def test_output_loss_has_no_silent_fallback():
    layer = OutputLayer(n_out=2)
    object.__setattr__(layer, "loss", "hinge")  # a name the config cannot hold
    with pytest.raises(TypeError, match="no rule for loss 'hinge'"):
        OutputLoss(layer)


# ---- DL4J's names round-trip to dl4py's canonical ones ----------------------------------------

@pytest.mark.parametrize("cls, fields, field, expected", [
    (OutputLayer, {"loss": "NEGATIVELOGLIKELIHOOD"}, "loss", "negativeloglikelihood"),
    (OutputLayer, {"loss": "MCXENT"}, "loss", "mcxent"),
    (OutputLayer, {"loss": "LossFunctions.LossFunction.MCXENT"}, "loss", "mcxent"),
    (OutputLayer, {"loss": "SPARSE_MCXENT"}, "loss", "mcxent"),  # DL4J: MCXENT on class indices
    (OutputLayer, {"loss": "MSE"}, "loss", "mse"),
    (OutputLayer, {"loss": "SQUARED_LOSS"}, "loss", "mse"),  # DL4J: new LossMSE()
    (OutputLayer, {"loss": "XENT"}, "loss", "xent"),
    (OutputLayer, {"activation": "Activation.SOFTMAX"}, "activation", "softmax"),
    (DenseLayer, {"activation": "LEAKYRELU"}, "activation", "leakyrelu"),
    (DenseLayer, {"weight_init": "WeightInit.RELU"}, "weight_init", "relu"),
    (GlobalPoolingLayer, {"pooling_type": "AVG"}, "pooling_type", "avg"),
])
def test_dl4j_names_round_trip_to_canonical_names(cls, fields, field, expected):
    if cls is GlobalPoolingLayer:
        layer, input_type = cls(**fields), InputType.convolutional(2, 2, 1)
    else:
        layer, input_type = cls(n_out=2, **fields), InputType.feed_forward(4)
    assert layer == Layer.from_dict({"type": cls.type_name.upper(), **layer.to_dict(), **fields})
    layers = [layer] if cls is OutputLayer else [layer, OutputLayer(n_out=2)]
    config = NetworkConfig(layers=layers, input_type=input_type, activation="RELU", weight_init="XAVIER",
                           updater={"type": "NESTEROVS"})
    as_dict = config.to_dict()
    assert as_dict["layers"][0][field] == expected
    assert (as_dict["activation"], as_dict["weight_init"], as_dict["updater"]["type"]) == ("relu", "xavier", "nesterovs")
    assert NetworkConfig.from_dict(as_dict) == config and NetworkConfig.from_dict(as_dict).to_dict() == as_dict
    assert NetworkConfig.from_yaml(config.to_yaml()) == config
    camel = {**as_dict, "input_type": {**as_dict["input_type"], "type": "convolutional" if cls is GlobalPoolingLayer
                                       else "InputType.feedForward"}}
    assert NetworkConfig.from_dict(camel) == config  # DL4J's InputType.feedForward spelling


def test_a_loss_dl4py_lacks_is_refused_not_mapped():
    for name in ("L1", "HINGE", "KL_DIVERGENCE"):
        with pytest.raises(ConfigError, match=r"^OutputLayer\.loss: must be one of"):
            OutputLayer(n_out=2, loss=name)
