"""``model.signature()``: what serve, export, ParallelInference, ``predict`` and the monitor know
about a model without probing it. Each model kind's signature is checked field by field against
the config (or the loss) it was made from; then each reader is shown to act on it: a regressor
is served and predicted as values, a graph's two inputs are packed and its two outputs split,
a model without a declared or fixed input shape is refused by name.

Nothing here trains: signatures come from declarations, and the readers run untrained networks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from dl4py import (
    LSTM,
    ComputationGraph,
    ConfigError,
    ConvolutionLayer,
    DataError,
    DenseLayer,
    GraphConfig,
    InputType,
    MultiLayerNetwork,
    NetworkConfig,
    OutputLayer,
    ParallelInference,
    RnnOutputLayer,
    Sgd,
    SubsamplingLayer,
    TorchModel,
)
from dl4py.export import export
from dl4py.export.predict_files import read_input
from dl4py.export.wrapper import example_shape
from dl4py.monitor.stats import static_record
from dl4py.nn.signature import CLASSES, GRAPH, MULTILAYER, TORCH_MODULE, VALUES, Output
from dl4py.serve import Service


def _network(input_type, *layers) -> NetworkConfig:
    return NetworkConfig(layers=list(layers), input_type=input_type, updater=Sgd(0.1), seed=5)


def _two_input_graph() -> GraphConfig:
    """Inputs ``image`` (convolutional_flat 4x4x1) and ``extra`` (3 values); outputs ``kind``
    (3 classes) and ``amount`` (an mse regression of 2 values)."""
    def layer(inputs, **spec):
        return {"inputs": inputs, "layer": spec}

    return GraphConfig.from_dict({
        "inputs": {"image": {"type": "convolutional_flat", "height": 4, "width": 4, "channels": 1},
                   "extra": {"type": "feed_forward", "size": 3}},
        "vertices": {
            "conv": layer(["image"], type="convolution", n_out=2, kernel_size=3),
            "flat": {"inputs": ["conv"], "vertex": {"type": "preprocessor", "preprocessor": "cnn_to_feed_forward"}},
            "joined": {"inputs": ["flat", "extra"], "vertex": {"type": "merge"}},
            "kind": layer(["joined"], type="output", n_out=3),
            "amount": layer(["joined"], type="output", n_out=2, loss="mse"),
        },
        "outputs": ["kind", "amount"], "seed": 5,
    })


def _torch_model(loss) -> TorchModel:
    return TorchModel(nn.Linear(4, 3), loss=loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), backend="cpu")


@pytest.fixture(scope="module")
def graph():
    return ComputationGraph(_two_input_graph(), backend="cpu").init()


@pytest.fixture(scope="module")
def graph_inputs():
    generator = torch.Generator().manual_seed(0)
    return [torch.rand(6, 16, generator=generator), torch.rand(6, 3, generator=generator)]


# ---- each model kind's signature, field by field ------------------------------------------
def test_a_dense_classifier():
    config = _network(InputType.feed_forward(5), DenseLayer(n_out=7), OutputLayer(n_out=3))
    signature = MultiLayerNetwork(config).signature()
    assert signature.model == MULTILAYER
    assert signature.input_shape == (5,)
    assert signature.input_type == config.input_type
    assert signature.input_names == ()
    assert signature.outputs == (Output(name=None, size=3, labels=CLASSES),)
    assert signature.classifier and not signature.several_inputs and signature.from_config


def test_a_regressor_with_an_mse_output():
    config = _network(InputType.feed_forward(5), DenseLayer(n_out=7), OutputLayer(n_out=2, loss="mse"))
    signature = MultiLayerNetwork(config).signature()
    assert signature.outputs == (Output(name=None, size=2, labels=VALUES),)
    assert not signature.classifier


def test_a_convolutional_net_takes_channels_height_width():
    config = _network(InputType.convolutional(height=8, width=6, channels=2), ConvolutionLayer(n_out=4, kernel_size=3),
                      SubsamplingLayer(kernel_size=2, stride=2), OutputLayer(n_out=10))
    signature = MultiLayerNetwork(config).signature()
    assert signature.input_shape == (2, 8, 6)  # [c, h, w], as the data carries it
    assert signature.input_type == config.input_type
    assert signature.outputs == (Output(name=None, size=10, labels=CLASSES),)


def test_an_lstm_over_padded_sequences_of_any_length():
    config = _network(InputType.recurrent(3), LSTM(n_out=5), RnnOutputLayer(n_out=4))
    net = MultiLayerNetwork(config, backend="cpu")
    signature = net.signature()
    assert signature.input_shape == (None, 3)  # time: any length, a mask marks each sequence's steps
    assert signature.input_type == config.input_type
    assert signature.outputs == (Output(name=None, size=4, labels=CLASSES),)
    with pytest.raises(DataError, match="sequences of any length"):
        example_shape(net)  # what export and dl4py predict need is a fixed shape
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float32)
    net.init().set_mask(mask)  # takes masks; predict still answers a class per step
    assert net.predict(torch.rand(2, 4, 3)).shape == (2, 4)


def test_a_graph_with_two_inputs_and_two_outputs(graph):
    signature = graph.signature()
    assert signature.model == GRAPH
    assert signature.input_names == ("image", "extra")  # the packing order, config.inputs'
    assert signature.input_shape == (4 * 4 * 1 + 3,)  # one packed row
    assert signature.input_type is None and signature.several_inputs
    assert signature.outputs == (Output(name="kind", size=3, labels=CLASSES),
                                 Output(name="amount", size=2, labels=VALUES))
    assert signature.classifier  # the first output's


def test_a_torch_model_declares_no_shape_and_is_labelled_by_its_loss():
    signature = _torch_model(nn.CrossEntropyLoss()).signature()
    assert signature.model == TORCH_MODULE and not signature.from_config
    assert signature.input_shape is None and signature.input_type is None and signature.input_names == ()
    assert signature.outputs == (Output(name=None, size=None, labels=CLASSES),)
    assert _torch_model(nn.MSELoss()).signature().outputs == (Output(name=None, size=None, labels=VALUES),)


def test_a_signature_is_frozen():
    signature = _torch_model(nn.CrossEntropyLoss()).signature()
    with pytest.raises(AttributeError):
        signature.input_shape = (4,)


# ---- the readers act on it ----------------------------------------------------------------
def test_serve_answers_a_regressor_with_values_and_sizes_a_torch_model_by_a_forward():
    config = _network(InputType.feed_forward(5), OutputLayer(n_out=2, loss="mse"))
    service = Service(MultiLayerNetwork(config, backend="cpu"))
    try:
        assert service.metadata["kind"] == "regressor" and service.metadata["outputs"] == 2
        assert service.metadata["input_shape"] == [5]
    finally:
        service.close()
    service = Service(_torch_model(nn.MSELoss()), input_shape=(4,))
    try:  # a TorchModel declares no width: one example of zeros tells
        assert service.metadata["kind"] == "regressor" and service.metadata["outputs"] == 3
    finally:
        service.close()
    with pytest.raises(ConfigError, match="input_shape: a TorchModel has no config to read its input shape"):
        Service(_torch_model(nn.CrossEntropyLoss()))


def test_serve_refuses_a_graph_of_two_outputs(graph):
    with pytest.raises(DataError, match="takes a model with one output; this graph has 2"):
        Service(graph)


def test_parallel_inference_packs_a_graphs_inputs_and_splits_its_outputs(graph, graph_inputs):
    expected = graph.output(graph_inputs)
    with ParallelInference(graph, workers=1) as inference:
        answer = inference.output(graph_inputs)
    assert [a.shape for a in answer] == [(6, 3), (6, 2)]
    for got, want in zip(answer, expected):
        torch.testing.assert_close(got, want)


def test_predict_gives_classes_and_values_per_output(graph, graph_inputs):
    kinds, amounts = graph.predict(graph_inputs)
    assert kinds.dtype == np.int64 and kinds.shape == (6,)
    np.testing.assert_array_equal(amounts, graph.predict_proba(graph_inputs)[1])  # values as they are


def test_export_refuses_a_torch_model_by_name(tmp_path):
    model = _torch_model(nn.CrossEntropyLoss())
    with pytest.raises(DataError, match="a TorchModel has no config to read its input shape"):
        example_shape(model)
    with pytest.raises(DataError, match="the weights-only file rebuilds a network from its config"):
        export(model, tmp_path / "m.weights.dl4py", "safetensors")


def test_an_image_folder_needs_a_convolutional_input(tmp_path, graph):
    (tmp_path / "images").mkdir()
    dense = MultiLayerNetwork(_network(InputType.feed_forward(5), OutputLayer(n_out=3))).signature()
    with pytest.raises(DataError, match="needs a model with a convolutional input, this one takes feed_forward"):
        read_input(tmp_path / "images", dense.input_shape, dense.input_type)
    with pytest.raises(DataError, match="this one takes several inputs"):
        read_input(tmp_path / "images", graph.signature().input_shape, graph.signature().input_type)


def test_the_monitor_names_a_networks_layers_by_index_and_prints_a_torch_models_module():
    config = _network(InputType.feed_forward(5), DenseLayer(n_out=7), OutputLayer(n_out=3))
    record = static_record(MultiLayerNetwork(config, backend="cpu").init())
    assert record["model"]["layers"] == ["0_DenseLayer", "1_OutputLayer"]
    model = _torch_model(nn.CrossEntropyLoss()).init()
    record = static_record(model)
    assert record["model"]["summary"] == str(model.module) and record["model"]["layers"] == ["model"]
