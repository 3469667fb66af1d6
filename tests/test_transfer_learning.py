"""Transfer learning: the trained LeNet, frozen below its dense layer, learns digits 0-4.

One short pretraining run and one fine-tuning run are shared by the tests (module
fixture). What is checked: kept layers copied bit for bit, frozen ones unchanged by
training, no gradient and no updater state for them, accuracy, save/load/resume, the
memory estimate, the YAML round trip and the errors. A small recurrent network transfers on
each device (a GPU too): its kept layers copied there, its new LSTM given the forget gate's bias.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from devices import backend_for, on_devices
from dl4py import (
    LSTM,
    Adam,
    ArrayDataSetIterator,
    BatchNormalization,
    ConfigError,
    ConvolutionLayer,
    DenseLayer,
    DropoutLayer,
    FineTuneConfiguration,
    FrozenLayer,
    InputType,
    LastTimeStep,
    MnistDataSetIterator,
    MultiLayerNetwork,
    NetworkConfig,
    OutputLayer,
    RunConfig,
    Sgd,
    TransferLearning,
    load,
)
from dl4py.cli import main
from dl4py.memory import estimate, measure_training_step

ROOT = Path(__file__).resolve().parents[1]
LENET_YAML = ROOT / "examples" / "lenet_mnist.yaml"
FROZEN = ("0.", "2.")  # LeNet's two convolutions: layers 0-3 are frozen, pooling has no parameters


def _digits_below_5(limit: int, train: bool, skip: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    batch = next(iter(MnistDataSetIterator(limit, train=train, seed=1, shuffle=False, limit=limit)))
    features, labels = batch.features[skip:], batch.labels[skip:]
    keep = labels < 5
    return features[keep], labels[keep]


def _state(model) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.module.state_dict().items()}


@pytest.fixture(scope="module")
def lenet():
    """The seed's LeNet, trained one epoch on 3,000 MNIST examples of all ten digits."""
    from conftest import require_mnist

    require_mnist()
    net = MultiLayerNetwork(RunConfig.from_file(LENET_YAML).network, backend="cpu").init()
    net.fit(MnistDataSetIterator(64, train=True, seed=1, limit=3000), epochs=1, verbose=0)
    return net


@pytest.fixture(scope="module")
def transferred(lenet):
    """LeNet frozen below its dense layer, with a new 5-class output, fine-tuned one epoch
    on the digits 0-4 among 6,000 training examples it was not pretrained on."""
    pretrained = _state(lenet)
    net = (TransferLearning.Builder(lenet)
           .fine_tune(FineTuneConfiguration(updater=Adam(learning_rate=1e-3), seed=7))
           .set_feature_extractor(3)
           .remove_output_layer()
           .add_layer(OutputLayer(n_out=5))
           .build())
    built = _state(net)
    features, labels = _digits_below_5(9000, train=True, skip=3000)
    net.fit(ArrayDataSetIterator(features, labels, batch_size=32, seed=3), epochs=1, verbose=0)
    return {"net": net, "pretrained": pretrained, "built": built, "examples": len(labels)}


def test_kept_layers_start_as_trained_and_frozen_ones_stay_bit_identical(transferred):
    net, pretrained, built = transferred["net"], transferred["pretrained"], transferred["built"]
    assert [type(layer).__name__ for layer in net.config.layers] == [
        "FrozenLayer", "FrozenLayer", "FrozenLayer", "FrozenLayer", "DenseLayer", "OutputLayer"]
    for name in ("0.op.weight", "0.op.bias", "2.op.weight", "2.op.bias", "4.op.weight", "4.op.bias"):
        assert torch.equal(built[name], pretrained[name]), name  # copied, not re-initialised
    assert built["5.op.weight"].shape == (5, 500)  # the new output layer
    after = net.module.state_dict()
    for name in pretrained:
        if name.startswith(FROZEN):
            assert torch.equal(after[name], pretrained[name]), name
    assert not torch.equal(after["4.op.weight"], pretrained["4.op.weight"])  # the dense layer trained


def test_the_transferred_lenet_learns_digits_0_to_4_above_97_percent(transferred):
    assert transferred["examples"] > 2500  # one epoch on a slice of about 3,000 examples of 0-4
    features, labels = _digits_below_5(2000, train=False)
    accuracy = transferred["net"].evaluate((features, labels)).accuracy()
    assert accuracy > 0.97, accuracy


def test_frozen_parameters_get_no_gradient_and_no_updater_state(transferred):
    net = transferred["net"]
    stepped = {id(p) for group in net.optimizer.param_groups for p in group["params"]}
    for name, param in net.module.named_parameters():
        if name.startswith(FROZEN):
            assert not param.requires_grad and param.grad is None, name
            assert id(param) not in stepped and param not in net.optimizer.state, name
        else:
            assert param.requires_grad and id(param) in stepped and "exp_avg" in net.optimizer.state[param], name
    assert isinstance(net.optimizer, torch.optim.Adam)  # the fine-tune configuration's updater


def test_a_frozen_batch_norm_keeps_its_statistics_and_frozen_dropout_keeps_everything(lenet):
    config = NetworkConfig(
        seed=5, updater=Sgd(learning_rate=0.1), input_type=InputType.feed_forward(784),
        layers=[DenseLayer(n_out=32, activation="relu"), BatchNormalization(), DropoutLayer(rate=0.5),
                OutputLayer(n_out=10)])
    trained = MultiLayerNetwork(config, backend="cpu").init()
    data = MnistDataSetIterator(64, train=True, seed=2, limit=512)
    trained.fit(data, epochs=1, verbose=0)
    net = TransferLearning(trained).set_feature_extractor(2).build()
    before = _state(net)
    net.fit(data, epochs=1, verbose=0)
    after = net.module.state_dict()
    for name in ("1.op.running_mean", "1.op.running_var", "1.op.num_batches_tracked", "0.op.weight"):
        assert torch.equal(after[name], before[name]), name
    net.module.train()  # as in a training step: the frozen layers stay in inference mode
    assert not net.module[1].training and not net.module[2].training and net.module[3].training
    x = torch.rand(8, 784)
    assert torch.equal(net.module[2](x), x)  # dropout drops nothing


def test_a_saved_transferred_model_loads_frozen_and_resumes(transferred, tmp_path):
    net = transferred["net"]
    path = tmp_path / "transferred.zip"
    net.save(path)
    restored = load(path, backend="cpu")
    assert isinstance(restored.config.layers[0], FrozenLayer)
    assert [p.requires_grad for p in restored.module.parameters()] == [p.requires_grad for p in net.module.parameters()]
    for param, original in zip(restored.optimizer.param_groups[0]["params"], net.optimizer.param_groups[0]["params"]):
        assert torch.equal(restored.optimizer.state[param]["exp_avg"], net.optimizer.state[original]["exp_avg"])
    before = _state(restored)
    features, labels = _digits_below_5(1000, train=False)
    restored.fit(ArrayDataSetIterator(features, labels, batch_size=32, seed=4), epochs=1, verbose=0)
    assert restored.epoch_count == 2  # it went on from the saved epoch
    after = restored.module.state_dict()
    for name in before:
        assert torch.equal(after[name], before[name]) == name.startswith(FROZEN), name
    # A saved model can be the source of a transfer too.
    again = TransferLearning(path).n_out_replace(5, 3).build()
    assert torch.equal(again.module.state_dict()["4.op.weight"], net.module.state_dict()["4.op.weight"])
    assert again.n_out == 3


def test_n_out_replace_reinitialises_the_layer_and_the_one_above(lenet):
    pretrained = _state(lenet)
    net = TransferLearning(lenet).n_out_replace(4, 100, weight_init="relu").build()
    state = net.module.state_dict()
    assert state["4.op.weight"].shape == (100, 800) and state["5.op.weight"].shape == (10, 100)
    assert net.config.updater == lenet.config.updater  # no fine-tune configuration: the same updater
    slower = TransferLearning(lenet).fine_tune_configuration(FineTuneConfiguration(learning_rate=1e-4)).build()
    assert slower.config.updater == dataclasses.replace(lenet.config.updater, learning_rate=1e-4)
    assert net.config.layers[4].weight_init == "relu"
    for name in ("0.op.weight", "2.op.weight", "2.op.bias"):
        assert torch.equal(state[name], pretrained[name]), name


def test_the_memory_estimate_drops_by_the_frozen_gradients_and_updater_state(transferred, tmp_path, capsys):
    config = transferred["net"].config
    unfrozen = config.replace(layers=tuple(getattr(layer, "layer", layer) for layer in config.layers))
    frozen_params = sum(p.numel() for name, p in transferred["net"].module.named_parameters() if name.startswith(FROZEN))
    assert frozen_params == 20 * 25 + 20 + 50 * 20 * 25 + 50
    frozen, full = estimate(config, 32, device="cpu"), estimate(unfrozen, 32, device="cpu")
    assert full.gradient_bytes - frozen.gradient_bytes == 4 * frozen_params
    assert full.updater_bytes - frozen.updater_bytes == 2 * 4 * frozen_params  # Adam: two copies
    assert frozen.parameter_bytes == full.parameter_bytes
    # The peak, too, is what a real step of the frozen network allocates (nothing below the
    # dense layer is saved for backward).
    model = MultiLayerNetwork(config, backend="cpu").init()
    generator = torch.Generator().manual_seed(0)
    features, labels = torch.rand(32, 784, generator=generator), torch.randint(0, 5, (32,), generator=generator)
    measured = measure_training_step(model, features, labels).peak_bytes
    assert abs(frozen.peak_bytes / measured - 1) <= 0.01, (frozen.peak_bytes, measured)
    assert frozen.peak_bytes < full.peak_bytes
    # dl4py memory reads a frozen config from YAML and says the same.
    run = RunConfig.from_file(LENET_YAML)
    path = tmp_path / "frozen.yaml"
    path.write_text(dataclasses.replace(run, network=config).to_yaml())
    assert main(["memory", str(path), "--device", "cpu", "--batch-size", "32", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["gradient_bytes"] == frozen.gradient_bytes and answer["updater_bytes"] == frozen.updater_bytes


def test_a_config_with_frozen_layers_round_trips_through_yaml_and_json(transferred):
    config = transferred["net"].config
    assert NetworkConfig.from_yaml(config.to_yaml()) == config
    assert NetworkConfig.from_json(config.to_json()) == config
    text = config.to_yaml()
    assert "type: frozen" in text
    written = NetworkConfig.from_dict({
        "input_type": {"type": "feed_forward", "size": 784},
        "layers": [{"type": "frozen", "layer": {"type": "dense", "n_out": 16, "activation": "RELU"}},
                   {"type": "output", "n_out": 10}]})
    assert written.layers[0] == FrozenLayer(layer=DenseLayer(n_out=16, activation="relu"))
    with pytest.raises(ConfigError, match=r"network\.layers\[0\]\.layer\.n_out"):
        NetworkConfig.from_dict({"input_type": {"type": "feed_forward", "size": 784},
                                 "layers": [{"type": "frozen", "layer": {"type": "dense", "n_out": -1}},
                                            {"type": "output", "n_out": 10}]})


def test_bad_requests_are_errors_naming_the_layer(lenet):
    with pytest.raises(ConfigError, match=r"set_feature_extractor: layer 5 is not below the output layer \(layer 5"):
        TransferLearning(lenet).set_feature_extractor(5).build()
    with pytest.raises(ConfigError, match=r"layer 9 does not exist: the network has layers 0 to 5"):
        TransferLearning(lenet).set_feature_extractor(9)
    with pytest.raises(ConfigError, match=r"layers have no names; give the layer's index, not 'dense'"):
        TransferLearning(lenet).set_feature_extractor("dense")
    with pytest.raises(ConfigError, match=r"n_out_replace: layer 1: \(subsampling\) has no n_out"):
        TransferLearning(lenet).n_out_replace(1, 7)
    with pytest.raises(ConfigError, match=r"add_layer: layer 5 is the output layer; remove it first"):
        TransferLearning(lenet).add_layer(OutputLayer(n_out=5))
    # A convolution cannot take the dense layer's flat output: named by its new index.
    with pytest.raises(ConfigError, match=r"network\.layers\[5\]: convolution needs convolutional input"):
        TransferLearning(lenet).remove_output_layer().add_layer(ConvolutionLayer(n_out=4)).add_layer(
            OutputLayer(n_out=5)).build()
    with pytest.raises(ConfigError, match=r"cannot remove 6 of the network's 6 layers"):
        TransferLearning(lenet).remove_layers_from_output(6)
    with pytest.raises(ConfigError, match=r"FrozenLayer\.layer: an output layer cannot be frozen"):
        FrozenLayer(layer=OutputLayer(n_out=5))


def _forget_gate_rows(lstm: torch.nn.LSTM) -> torch.Tensor:
    """The LSTM's effective bias (bias_ih + bias_hh) as rows of PyTorch's gates: input, forget, cell, output."""
    return (lstm.bias_ih_l0 + lstm.bias_hh_l0).detach().cpu().reshape(4, -1)


@on_devices
def test_a_recurrent_network_transfers_on_its_device(device):
    """Kept layers copied bit for bit on the trained network's device, the frozen one unchanged
    by training there, and the LSTM given new outputs (and the one above it, whose input
    changed) initialised anew: their forget gates start at their forget_gate_bias_init again."""
    config = NetworkConfig(seed=3, updater=Adam(learning_rate=0.01), input_type=InputType.recurrent(3), layers=[
        LSTM(n_out=6), LSTM(n_out=5, forget_gate_bias_init=2.5), LastTimeStep(LSTM(n_out=4)), OutputLayer(n_out=2)])
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(64, 7, 3, generator=generator)
    data = ArrayDataSetIterator(features, (features[:, 0, 0] > 0).long(), batch_size=16, seed=1)
    trained = MultiLayerNetwork(config, backend=backend_for(device)).init()
    trained.fit(data, epochs=1, verbose=0)
    pretrained = _state(trained)
    net = TransferLearning(trained).set_feature_extractor(0).n_out_replace(1, 8).build()
    built = _state(net)
    assert {value.device.type for value in built.values()} == {device}
    kept = [name for name in built if name.startswith("0.")]
    assert kept and all(torch.equal(built[name], pretrained[name]) for name in kept)
    lstms = [m for m in net.module.modules() if isinstance(m, torch.nn.LSTM)]
    for lstm, forget in zip(lstms[1:], (2.5, 1.0)):  # fresh: DL4J's init, not the trained biases
        expected = torch.zeros(4, lstm.hidden_size)
        expected[1] = forget
        assert torch.equal(_forget_gate_rows(lstm), expected)
    net.fit(data, epochs=1, verbose=0)
    after = net.module.state_dict()
    assert all(torch.equal(after[name], built[name]) for name in kept)  # frozen
    assert not torch.equal(after["1.op.rnn.bias_ih_l0"], built["1.op.rnn.bias_ih_l0"])  # trained
