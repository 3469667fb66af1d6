"""Network and run configuration: round trips, shape inference, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dl4py.config import (
    ActivationLayer,
    Adam,
    AdamW,
    BatchNormalization,
    ConvolutionLayer,
    DenseLayer,
    DropoutLayer,
    GRU,
    LSTM,
    EmbeddingLayer,
    EmbeddingSequenceLayer,
    FrozenLayer,
    GlobalPoolingLayer,
    LastTimeStep,
    RnnOutputLayer,
    InputType,
    Layer,
    Nesterovs,
    NetworkConfig,
    OutputLayer,
    RmsProp,
    RunConfig,
    Sgd,
    SubsamplingLayer,
    Updater,
)
from dl4py.config import (
    Convolution1DLayer,
    Deconvolution2D,
    LayerNormalization,
    SelfAttentionLayer,
    Subsampling1DLayer,
    Upsampling2D,
    ZeroPaddingLayer,
)
from dl4py.config import (
    CnnLossLayer,
    Cropping1D,
    Cropping2D,
    DepthwiseConvolution2D,
    SeparableConvolution2D,
    ZeroPadding1DLayer,
)
from dl4py.config import Bidirectional, GravesBidirectionalLSTM, GravesLSTM, SimpleRnn
from dl4py.errors import ConfigError

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# One non-default sample of every layer type, placed where its input shape is valid.
SAMPLES = {
    "convolution": ConvolutionLayer(n_out=4, kernel_size=(3, 2), stride=(1, 2), padding=(1, 0),
                                    dilation=(2, 1), activation="leakyrelu", weight_init="relu",
                                    l2=0.01, has_bias=False),
    "subsampling": SubsamplingLayer(pooling_type="avg", kernel_size=(2, 2), stride=(1, 1), padding=(1, 1)),
    "batch_normalization": BatchNormalization(eps=1e-3, decay=0.8),
    "activation": ActivationLayer(activation="gelu"),
    "dropout": DropoutLayer(rate=0.25),
    "global_pooling": GlobalPoolingLayer(pooling_type="sum"),
    "dense": DenseLayer(n_out=7, activation="tanh", weight_init="uniform", l2=0.001),
    "output": OutputLayer(n_out=3, activation="sigmoid", loss="xent", weight_init="normal"),
    "frozen": FrozenLayer(layer=ConvolutionLayer(n_out=3, kernel_size=2, activation="relu")),
    "upsampling2d": Upsampling2D(size=(2, 3)),
    "deconvolution2d": Deconvolution2D(n_out=3, kernel_size=(3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2),
                                       activation="relu", weight_init="uniform", l2=0.01, has_bias=False),
    "zero_padding": ZeroPaddingLayer(padding=(1, 0, 2, 3)),
    "layer_normalization": LayerNormalization(eps=1e-3),
    "depthwise_convolution2d": DepthwiseConvolution2D(depth_multiplier=2, kernel_size=(3, 2), stride=(1, 2),
                                                      padding=(1, 0), dilation=(2, 1), activation="relu",
                                                      weight_init="uniform", l2=0.01, has_bias=False),
    "separable_convolution2d": SeparableConvolution2D(n_out=3, depth_multiplier=3, kernel_size=(2, 3), stride=(2, 1),
                                                      padding=(0, 1), dilation=(1, 2), activation="sigmoid",
                                                      weight_init="normal", l2=0.02, has_bias=False),
    "cropping2d": Cropping2D(cropping=(1, 0, 2, 1)),
}
CNN_TYPES = {"convolution", "subsampling", "global_pooling", "frozen", "upsampling2d", "deconvolution2d",
             "zero_padding", "layer_normalization"}
CNN_TYPES |= {"depthwise_convolution2d", "separable_convolution2d", "cropping2d"}
# Recurrent and embedding layers, each in a whole network: its input type and layers.
SEQUENCE_SAMPLES = {
    "lstm": (InputType.recurrent(3, 5), [LSTM(n_out=4, weight_init="uniform", forget_gate_bias_init=0.5),
                                         RnnOutputLayer(n_out=2, loss="mcxent")]),
    "gru": (InputType.recurrent(3), [GRU(n_out=4, activation="tanh"), RnnOutputLayer(n_out=2)]),
    "last_time_step": (InputType.recurrent(3), [LastTimeStep(layer=LSTM(n_out=4)), SAMPLES["output"]]),
    "rnn_output": (InputType.recurrent(3), [RnnOutputLayer(n_out=3, activation="sigmoid", loss="xent")]),
    "embedding": (InputType.feed_forward(1), [EmbeddingLayer(vocab_size=10, n_out=4, activation="relu"),
                                              SAMPLES["output"]]),
    "embedding_sequence": (InputType.recurrent(1), [EmbeddingSequenceLayer(vocab_size=10, n_out=4),
                                                    RnnOutputLayer(n_out=2)]),
    "convolution1d": (InputType.recurrent(3, 9), [Convolution1DLayer(n_out=4, kernel_size=2, stride=2, padding=1,
                                                                     dilation=2, activation="gelu", l2=0.1),
                                                  RnnOutputLayer(n_out=2)]),
    "subsampling1d": (InputType.recurrent(3), [Subsampling1DLayer(pooling_type="avg", kernel_size=3, stride=1,
                                                                  padding=1), RnnOutputLayer(n_out=2)]),
    "self_attention": (InputType.recurrent(4), [SelfAttentionLayer(n_out=6, n_heads=3, head_size=4, weight_init="normal"),
                                                SelfAttentionLayer(n_out=6, n_heads=2, project_input=False),
                                                RnnOutputLayer(n_out=2)]),
    "cropping1d": (InputType.recurrent(3, 7), [Cropping1D(cropping=(2, 1)), RnnOutputLayer(n_out=2)]),
    "zero_padding1d": (InputType.recurrent(3), [ZeroPadding1DLayer(padding=(0, 2)), RnnOutputLayer(n_out=2)]),
    "graves_lstm": (InputType.recurrent(3, 5), [GravesLSTM(n_out=4, activation="softsign", gate_activation="hardsigmoid",
                                                           forget_gate_bias_init=0.5, weight_init="uniform", l2=0.01),
                                                RnnOutputLayer(n_out=2)]),
    "graves_bidirectional_lstm": (InputType.recurrent(3), [GravesBidirectionalLSTM(n_out=4, gate_activation="hardsigmoid",
                                                                                   l2=0.1), RnnOutputLayer(n_out=2)]),
    "simple_rnn": (InputType.recurrent(3), [SimpleRnn(n_out=4, activation="relu", weight_init="normal", l2=0.1),
                                            RnnOutputLayer(n_out=2)]),
    "bidirectional": (InputType.recurrent(3), [Bidirectional(LSTM(n_out=4, activation="relu"), mode="mul"),
                                               RnnOutputLayer(n_out=2)]),
    # Not a sequence layer, but like these a whole network: the CNN loss layer is its last layer.
    "cnn_loss": (InputType.convolutional(5, 4, 2), [ConvolutionLayer(n_out=3, kernel_size=2),
                                                    SubsamplingLayer(kernel_size=3, stride=2, convolution_mode="same"),
                                                    CnnLossLayer(activation="softmax", loss="mae")]),
}
SAMPLES.update({name: next(layer for layer in layers if layer.type_name == name)
                for name, (_, layers) in SEQUENCE_SAMPLES.items()})


def sample_layers(type_name: str):
    """``(input_type, layers)``: a valid network around the sample of ``type_name``, as every
    per-type test (round trip, model files, the layer registry) places it."""
    layer = SAMPLES[type_name]
    layers = [layer] if type_name != "output" else []
    if type_name not in CNN_TYPES:
        layers = [GlobalPoolingLayer()] + layers  # cnn -> flat first, so flat layers get flat input
    if type_name in ("batch_normalization", "activation", "dropout"):
        layers = [layer, GlobalPoolingLayer()]  # these also take cnn input
    if type_name in SEQUENCE_SAMPLES:
        return SEQUENCE_SAMPLES[type_name]
    return InputType.convolutional(8, 6, 2), layers + [SAMPLES["output"]]


def test_every_layer_type_has_a_sample():
    assert set(SAMPLES) == set(Layer.registry), "add a sample for each new layer type"


@pytest.mark.parametrize("type_name", sorted(SAMPLES))
def test_round_trip_every_layer_type(type_name):
    input_type, layers = sample_layers(type_name)
    config = NetworkConfig(
        layers=layers,
        input_type=input_type,
        seed=7, weight_init="relu", activation="tanh", updater=Adam(learning_rate=0.01), l2=0.0001,
    )
    as_dict = config.to_dict()
    assert NetworkConfig.from_dict(as_dict) == config
    assert NetworkConfig.from_dict(as_dict).to_dict() == as_dict
    assert NetworkConfig.from_json(config.to_json()) == config
    assert NetworkConfig.from_yaml(config.to_yaml()) == config
    assert json.loads(config.to_json()) == yaml.safe_load(config.to_yaml()) == as_dict


@pytest.mark.parametrize("updater", [Sgd(0.05), Nesterovs(0.01, 0.8), Adam(0.002, 0.8, 0.99, 1e-7),
                                     AdamW(weight_decay=0.05), RmsProp(0.01, 0.9, 1e-6)])
def test_round_trip_every_updater(updater):
    assert Updater.from_dict(updater.to_dict()) == updater
    assert set(Updater.registry) == {"sgd", "nesterovs", "adam", "adamw", "rmsprop"}


def test_run_config_round_trip_and_example_file():
    config = RunConfig.from_file(EXAMPLES / "lenet_mnist.yaml")
    assert RunConfig.from_dict(config.to_dict()) == config
    assert RunConfig.from_dict(yaml.safe_load(config.to_yaml())) == config
    network = config.network
    assert network.seed == 123 and network.weight_init == "xavier"
    assert isinstance(network.updater, Nesterovs)
    assert config.training.batch_size == 128


def test_lenet_shapes_are_inferred():
    network = RunConfig.from_file(EXAMPLES / "lenet_mnist.yaml").network
    shapes = [(s.input.dims, s.output.dims) for s in network.layer_shapes()]
    assert shapes == [
        ((1, 28, 28), (20, 24, 24)),
        ((20, 24, 24), (20, 12, 12)),
        ((20, 12, 12), (50, 8, 8)),
        ((50, 8, 8), (50, 4, 4)),
        ((800,), (500,)),  # dense n_in = 50*4*4, inferred
        ((500,), (10,)),
    ]


def test_builder_matches_dict_form():
    built = (
        NetworkConfig.builder()
        .seed(123).weight_init("xavier").updater(Nesterovs(learning_rate=0.03, momentum=0.9)).l2(0.0005)
        .layer(ConvolutionLayer(n_out=20, kernel_size=(5, 5), stride=(1, 1), activation="identity"))
        .layer(SubsamplingLayer(pooling_type="max", kernel_size=(2, 2), stride=(2, 2)))
        .layer(ConvolutionLayer(n_out=50, kernel_size=(5, 5), stride=(1, 1), activation="identity"))
        .layer(SubsamplingLayer(pooling_type="max", kernel_size=(2, 2), stride=(2, 2)))
        .layer(DenseLayer(n_out=500, activation="relu"))
        .layer(OutputLayer(n_out=10, activation="softmax", loss="negativeloglikelihood"))
        .input_type(InputType.convolutional_flat(28, 28, 1))
        .build()
    )
    assert built == RunConfig.from_file(EXAMPLES / "lenet_mnist.yaml").network
    with pytest.raises(AttributeError, match="no setting 'learning_rate'"):
        NetworkConfig.builder().learning_rate(0.1)


def test_scalar_kernel_means_square_and_flat_input_to_dense():
    config = NetworkConfig.from_dict({
        "input_type": {"type": "convolutional_flat", "height": 28, "width": 28, "channels": 1},
        "layers": [{"type": "dense", "n_out": 10}, {"type": "output", "n_out": 2}],
    })
    assert config.layer_shapes()[0].input.dims == (784,)
    conv = ConvolutionLayer.from_dict({"n_out": 3, "kernel_size": 3})
    assert conv.kernel_size == (3, 3)


# ---- invalid configurations fail at construction, naming the layer index and field ----------

def _net(*layers, input_type=None):
    return {
        "input_type": input_type or {"type": "convolutional_flat", "height": 28, "width": 28, "channels": 1},
        "layers": list(layers),
    }


OUT = {"type": "output", "n_out": 10}


@pytest.mark.parametrize("network, where, message", [
    (_net({"type": "dense", "n_out": 5}, {"type": "pooling"}, OUT),
     r"network\.layers\[1\]\.type", "unknown type 'pooling'"),
    (_net({"type": "dense", "n_out": 5, "activation": "swish"}, OUT),
     r"network\.layers\[0\]\.activation", "must be one of"),
    (_net({"type": "dense", "n_out": 0}, OUT), r"network\.layers\[0\]\.n_out", "must be positive, got 0"),
    (_net({"type": "dense", "n_out": -3}, OUT), r"network\.layers\[0\]\.n_out", "must be positive, got -3"),
    (_net({"type": "convolution", "n_out": 4, "kernel_size": [0, 3]}, OUT),
     r"network\.layers\[0\]\.kernel_size", r"must be positive, got \[0, 3\]"),
    (_net({"type": "convolution", "n_out": 4, "stride": -1}, OUT),
     r"network\.layers\[0\]\.stride", "must be positive"),
    (_net({"type": "convolution", "n_out": 4, "kernel_size": [5, 5]},
          {"type": "convolution", "n_out": 4, "kernel_size": [30, 3]}, OUT),
     r"network\.layers\[1\]\.kernel_size", "spans 30 but the input height is 24"),
    (_net({"type": "subsampling", "kernel_size": [2, 2], "stride": [2, 2]},
          {"type": "subsampling", "kernel_size": [20, 20]}, OUT),
     r"network\.layers\[1\]\.kernel_size", "input height is 14"),
    (_net({"type": "dense", "n_out": 5}), r"network\.layers\[0\]", "last layer must be an output layer"),
    (_net(OUT, {"type": "dense", "n_out": 5}, OUT), r"network\.layers\[0\]", "output layer must be the last"),
    (_net({"type": "dense", "n_out": 5}, {"type": "convolution", "n_out": 2}, OUT),
     r"network\.layers\[1\]", "convolution needs convolutional input"),
    (_net({"type": "dense", "n_out": 5, "n_outt": 3}, OUT),
     r"network\.layers\[0\]\.n_outt", "unknown field for DenseLayer"),
    (_net({"type": "dense", "n_out": "ten"}, OUT), r"network\.layers\[0\]\.n_out", "must be an integer"),
    (_net({"type": "dropout", "rate": 1.5}, OUT), r"network\.layers\[0\]\.rate", r"must be in \[0, 1\)"),
    (_net({"type": "dense"}, OUT), r"network\.layers\[0\]\.n_out", "is required"),
    (_net({"type": "output", "n_out": 10, "loss": "hinge"}), r"network\.layers\[0\]\.loss", "must be one of"),
    ({"layers": [OUT]}, r"network\.input_type", "is required"),
    ({"input_type": {"type": "feed_forward", "size": 0}, "layers": [OUT]},
     r"network\.input_type\.size", "must be positive"),
    ({**_net(OUT), "updater": {"type": "nesterovs", "learning_rate": -0.1}},
     r"network\.updater\.learning_rate", "must be positive"),
    ({**_net(OUT), "updater": {"type": "adamw"}, "l2": 0.01}, r"network\.l2", "AdamW decays weights itself"),
])
def test_invalid_network_is_rejected_with_location(network, where, message):
    with pytest.raises(ConfigError, match=f"^{where}: .*{message}"):
        NetworkConfig.from_dict(network)


def test_invalid_layer_object_in_code_names_its_index():
    with pytest.raises(ConfigError, match=r"network\.layers\[1\]\.kernel_size: kernel \[9, 9\]"):
        NetworkConfig(
            layers=[ConvolutionLayer(n_out=2, kernel_size=(3, 3)), ConvolutionLayer(n_out=2, kernel_size=(9, 9)),
                    OutputLayer(n_out=2)],
            input_type=InputType.convolutional(8, 8, 1),
        )
    with pytest.raises(ConfigError, match=r"layers\[0\]\.n_out: must be positive"):
        NetworkConfig.from_dict(_net({"type": "dense", "n_out": 0}, OUT))


# ---- --set overrides ------------------------------------------------------------------------

@pytest.fixture
def lenet_run():
    return RunConfig.from_file(EXAMPLES / "lenet_mnist.yaml")


def test_overrides_apply_with_types(lenet_run):
    changed = lenet_run.with_overrides([
        "training.epochs=3", "network.updater.learning_rate=0.02", "network.layers[4].n_out=64",
        "network.layers.2.kernel_size=[3, 3]", "data.limit_train=1000",
    ])
    assert changed.training.epochs == 3
    assert changed.network.updater.learning_rate == 0.02
    assert changed.network.layers[4].n_out == 64
    assert changed.network.layers[2].kernel_size == (3, 3)
    assert changed.network.layer_shapes()[4].input.dims == (50 * 5 * 5,)  # 12 -> 10 -> pooled 5: re-inferred
    assert changed.data.limit_train == 1000
    assert lenet_run.training.epochs == 1  # the original is untouched


@pytest.mark.parametrize("assignment, message", [
    ("training.epoch=3", r"training\.epoch: unknown key 'epoch' in training \(did you mean 'epochs'\?\); valid keys: epochs"),
    ("training.epochs=three", r"training\.epochs: must be an integer, got 'three'"),
    ("training.epochs=0", r"training\.epochs: must be positive, got 0"),
    ("training.batch_size=1.5", r"training\.batch_size: must be int or .auto."),
    ("network.layers[7].n_out=3", r"index 7 is out of range: network\.layers has 6 entries"),
    ("network.layers[1].n_out=3", r"unknown key 'n_out' in network\.layers\[1\]"),
    ("network.layers[0].activation=swish", r"network\.layers\[0\]\.activation: must be one of"),
    ("training.backend=tpu", r"training\.backend: must be one of 'auto', 'cpu', 'gpu'"),
    ("epochs", "must look like key=value"),
    ("nonsense.key=1", r"unknown key 'nonsense' in the config"),
])
def test_bad_overrides_are_rejected(lenet_run, assignment, message):
    with pytest.raises(ConfigError, match=message):
        lenet_run.with_overrides([assignment])


def test_run_config_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("network:\n  input_type: {type: feed_forward, size: 4}\n  layers:\n    - {type: dense, n_out: 0}\n    - {type: output, n_out: 2}\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: network\.layers\[0\]\.n_out: must be positive"):
        RunConfig.from_file(bad)
    broken = tmp_path / "broken.yaml"
    broken.write_text("network: [unclosed\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        RunConfig.from_file(broken)
    with pytest.raises(ConfigError, match="cannot read config file"):
        RunConfig.from_file(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match=r"environment\.max_devise_cache: unknown field"):
        RunConfig.from_dict({"network": _net(OUT), "environment": {"max_devise_cache": 1}})
    with pytest.raises(ConfigError, match=r"data\.train_path: is required when dataset is 'csv'"):
        RunConfig.from_dict({"network": _net(OUT), "data": {"dataset": "csv"}})


def test_python_example_builds_the_same_network_as_the_yaml():
    import importlib.util

    spec = importlib.util.spec_from_file_location("lenet_example", EXAMPLES / "lenet_mnist.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.lenet_config() == RunConfig.from_file(EXAMPLES / "lenet_mnist.yaml").network
