"""MultiLayerNetwork and TorchModel: building, training, save/load, resume, bad input."""

from __future__ import annotations

import math
import os
import signal
import zipfile

import pytest
import torch

import dl4py
from dl4py import (
    ArrayDataSetIterator,
    ConvolutionLayer,
    DenseLayer,
    DropoutLayer,
    InputType,
    MnistDataSetIterator,
    MultiLayerNetwork,
    Nesterovs,
    NetworkConfig,
    OutputLayer,
    RunConfig,
    SubsamplingLayer,
    TorchModel,
)
from dl4py.errors import DataError, TrainingError
from dl4py.train import CheckpointListener, ScoreIterationListener, TrainingInterrupted, TrainingListener

from conftest import SHARED_DATA  # noqa: F401  (sets DL4PY_DATA)
from devices import backend_for, on_devices

LENET_YAML = os.path.join(os.path.dirname(__file__), "..", "examples", "lenet_mnist.yaml")


def lenet() -> NetworkConfig:
    return RunConfig.from_file(LENET_YAML).network


def small_cnn(**overrides) -> NetworkConfig:
    settings = dict(
        seed=42, updater=Nesterovs(learning_rate=0.05, momentum=0.9), l2=1e-4,
        layers=[
            ConvolutionLayer(n_out=6, kernel_size=(5, 5), activation="relu"),
            SubsamplingLayer(kernel_size=(2, 2), stride=(2, 2)),
            DenseLayer(n_out=32, activation="relu"),
            DropoutLayer(rate=0.2),
            OutputLayer(n_out=10),
        ],
        input_type=InputType.convolutional_flat(28, 28, 1),
    )
    settings.update(overrides)
    return NetworkConfig(**settings)


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def test_lenet_summary_counts_parameters():
    net = MultiLayerNetwork(lenet()).init()
    text = net.summary()
    # 5*5*1*20+20, 0, 5*5*20*50+50, 0, 800*500+500, 500*10+10
    for count in ("520", "25,050", "400,500", "5,010", "Total parameters: 431,080"):
        assert count in text
    assert net.num_params() == 431_080
    assert "800" in text.splitlines()[6]  # the dense layer's inferred input


def test_same_seed_same_network_and_xavier_scale():
    a, b = MultiLayerNetwork(lenet()).init(), MultiLayerNetwork(lenet()).init()
    for (name, pa), pb in zip(params(a).items(), params(b).values()):
        assert torch.equal(pa, pb), name
    c = MultiLayerNetwork(lenet().replace(seed=124)).init()
    assert not torch.equal(params(a)["4.op.weight"], params(c)["4.op.weight"])
    dense = params(a)["4.op.weight"]  # 500 x 800, xavier: std sqrt(2 / (800 + 500))
    assert dense.std().item() == pytest.approx(math.sqrt(2 / 1300), rel=0.02)
    assert torch.count_nonzero(params(a)["4.op.bias"]) == 0  # biases start at zero


def test_l2_applies_to_weights_only():
    net = MultiLayerNetwork(small_cnn()).init()
    by_decay = {g["weight_decay"]: sum(p.numel() for p in g["params"]) for g in net.optimizer.param_groups}
    weights = 6 * 25 + 864 * 32 + 32 * 10
    biases = 6 + 32 + 10
    assert by_decay == {1e-4: weights, 0.0: biases}


def test_fit_learns_on_mnist_slice(mnist):
    net = MultiLayerNetwork(small_cnn())
    train = MnistDataSetIterator(64, train=True, seed=1, limit=2048)
    test = MnistDataSetIterator(256, train=False, seed=1, limit=1000)
    before = net.score((test.features, test.labels))
    scores = ScoreIterationListener(print_every=8)
    summaries = net.fit(train, epochs=2, listeners=[scores])
    assert [s.epoch for s in summaries] == [0, 1]
    assert summaries[0].batches == 32 and summaries[0].examples == 2048
    assert net.epoch_count == 2 and net.iteration_count == 64
    assert len(scores.history) == 8
    assert net.score((test.features, test.labels)) < before / 3
    assert net.evaluate(test).accuracy() > 0.85
    assert isinstance(net.score(), float)


def test_output_is_probabilities_and_checks_shape(mnist):
    net = MultiLayerNetwork(small_cnn()).init()
    x = MnistDataSetIterator(10, train=False, limit=10).features
    out = net.output(x)
    assert out.shape == (10, 10)
    assert torch.allclose(out.sum(dim=1), torch.ones(10), atol=1e-5)
    assert torch.equal(net.output(x.numpy()), out)  # numpy input gives the same
    with pytest.raises(DataError, match=r"features have shape \[10, 100\] .* expects \[n, 784\]"):
        net.output(torch.zeros(10, 100))


def test_bad_labels_fail_before_training_with_a_clear_error():
    net = MultiLayerNetwork(small_cnn())
    x = torch.rand(8, 784)
    with pytest.raises(DataError, match=r"label 12 is outside the output layer's 10 classes"):
        net.fit((x, torch.tensor([0, 1, 2, 3, 4, 5, 6, 12])))
    with pytest.raises(DataError, match=r"labels have shape \[8, 3\] but the output layer has 10 outputs"):
        net.fit((x, torch.rand(8, 3)))
    with pytest.raises(DataError, match=r"features have shape \[8, 10\]"):
        net.fit((torch.rand(8, 10), torch.zeros(8, dtype=torch.long)))
    assert net.iteration_count == 0


@on_devices
def test_nan_loss_stops_training_naming_the_precision(device):
    net = MultiLayerNetwork(small_cnn(), backend=backend_for(device))
    x = torch.rand(16, 784)
    x[3, 5] = float("nan")
    with pytest.raises(TrainingError, match=r"NaN or infinite .* precision 'float'"):
        net.fit((x, torch.zeros(16, dtype=torch.long)), epochs=1, batch_size=8)


@on_devices
@pytest.mark.parametrize("loss, activation, labels, accuracy", [
    ("mse", "identity", "rows", 0.8), ("xent", "sigmoid", "rows", 0.8), ("mcxent", "softmax", "index", 0.8),
    ("negativeloglikelihood", "softmax", "rows", 0.8), ("xent", "softmax", "index", 0.8),
    # NLL on sigmoid outputs only pushes the true class up: it learns, but less sharply.
    ("negativeloglikelihood", "sigmoid", "index", 0.6),
])
def test_every_loss_trains(loss, activation, labels, accuracy, device):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 6, generator=gen)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()  # 3 classes
    targets = torch.nn.functional.one_hot(y, 3).float() if labels == "rows" else y
    config = NetworkConfig(
        layers=[DenseLayer(n_out=16, activation="tanh"), OutputLayer(n_out=3, loss=loss, activation=activation)],
        input_type=InputType.feed_forward(6), updater=Nesterovs(learning_rate=0.05), seed=3,
    )
    net = MultiLayerNetwork(config, backend=backend_for(device))
    before = net.score((x, targets))
    net.fit((x, targets), epochs=30, batch_size=32)
    assert net.score((x, targets)) < 0.6 * before
    assert net.evaluate((x, y)).accuracy() > accuracy


def test_save_load_is_bit_identical_and_keeps_updater(tmp_path, mnist):
    net = MultiLayerNetwork(small_cnn(updater=dl4py.Adam(learning_rate=1e-3)))
    train = MnistDataSetIterator(64, train=True, seed=3, limit=512)
    net.fit(train, epochs=1)
    path = tmp_path / "model.dl4py"
    net.save(path)
    restored = dl4py.load(path)
    x = MnistDataSetIterator(100, train=False, limit=100).features
    assert torch.equal(net.output(x), restored.output(x))
    assert (restored.epoch_count, restored.iteration_count) == (1, 8)
    assert restored.config == net.config
    saved_state, loaded_state = net.optimizer.state_dict()["state"], restored.optimizer.state_dict()["state"]
    assert saved_state.keys() == loaded_state.keys()
    for pid in saved_state:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(saved_state[pid][key], loaded_state[pid][key])
    with zipfile.ZipFile(path) as zf:
        assert set(zf.namelist()) == {"meta.json", "config.json", "weights.safetensors",
                                      "updater.json", "updater.safetensors"}


def test_resume_continues_exactly(tmp_path, mnist):
    """Two epochs straight == one epoch, save, load, one more epoch (dropout included)."""
    train = MnistDataSetIterator(64, train=True, seed=5, limit=640)
    straight = MultiLayerNetwork(small_cnn())
    straight.fit(train, epochs=2)

    first = MultiLayerNetwork(small_cnn())
    first.fit(train, epochs=1)
    first.save(tmp_path / "ckpt.dl4py")
    resumed = dl4py.load(tmp_path / "ckpt.dl4py")
    resumed.fit(train, epochs=1)
    assert resumed.epoch_count == 2 and resumed.iteration_count == straight.iteration_count == 20
    for (name, a), b in zip(params(straight).items(), params(resumed).values()):
        assert torch.equal(a, b), name


class _CtrlCAt(TrainingListener):
    """Sends this process SIGINT (as Ctrl-C does) at a given iteration."""

    def __init__(self, iteration):
        self.iteration = iteration

    def iteration_done(self, model, iteration, epoch, loss, batch_size):
        if iteration == self.iteration:
            os.kill(os.getpid(), signal.SIGINT)


def test_ctrl_c_stops_cleanly_keeps_checkpoint_and_resumes(tmp_path, mnist):
    config = small_cnn(layers=[layer for layer in small_cnn().layers if not isinstance(layer, DropoutLayer)])
    train = MnistDataSetIterator(64, train=True, seed=5, limit=640)  # 10 batches per epoch
    straight = MultiLayerNetwork(config)
    straight.fit(train, epochs=2)

    ckpt = tmp_path / "checkpoint.dl4py"
    net = MultiLayerNetwork(config)
    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN in a shell's background job
    with pytest.raises(TrainingInterrupted, match="after iteration 13"):
        net.fit(train, epochs=2, listeners=[CheckpointListener(ckpt), _CtrlCAt(13)])
    assert signal.getsignal(signal.SIGINT) is before  # handler restored
    resumed = dl4py.load(ckpt)
    assert (resumed.epoch_count, resumed.batch_in_epoch, resumed.iteration_count) == (1, 3, 13)
    resumed.fit(train, epochs=1)  # finishes the interrupted epoch
    assert resumed.iteration_count == 20 and resumed.epoch_count == 2
    for (name, a), b in zip(params(straight).items(), params(resumed).values()):
        assert torch.equal(a, b), name


class _SaveAt(TrainingListener):
    """Saves the model part-way through an epoch, as a periodic checkpoint would."""

    def __init__(self, path, iteration):
        self.path, self.iteration = path, iteration

    def iteration_done(self, model, iteration, epoch, loss, batch_size):
        if iteration == self.iteration:
            model.save(self.path)


@pytest.mark.parametrize("stop", ["ctrl-c", "saved-while-training"])
def test_mid_epoch_resume_with_dropout_is_exact(tmp_path, mnist, stop):
    """The checkpoint keeps the dropout generators' state where the epoch stopped, so the
    resumed epoch draws the masks the uninterrupted run drew: the weights are bit-equal."""
    train = MnistDataSetIterator(64, train=True, seed=5, limit=640)  # 10 batches per epoch
    straight = MultiLayerNetwork(small_cnn())  # with a DropoutLayer
    straight.fit(train, epochs=2)

    ckpt = tmp_path / "checkpoint.dl4py"
    net = MultiLayerNetwork(small_cnn())
    if stop == "ctrl-c":
        with pytest.raises(TrainingInterrupted, match="after iteration 13"):
            net.fit(train, epochs=2, listeners=[CheckpointListener(ckpt), _CtrlCAt(13)])
    else:
        net.fit(train, epochs=2, listeners=[_SaveAt(ckpt, 13)])
    resumed = dl4py.load(ckpt)
    assert (resumed.epoch_count, resumed.batch_in_epoch) == (1, 3)
    resumed.fit(train, epochs=1)  # finishes the interrupted epoch
    assert resumed.iteration_count == 20
    for (name, a), b in zip(params(straight).items(), params(resumed).values()):
        assert torch.equal(a, b), name


def test_corrupt_or_truncated_model_file_is_a_clear_error(tmp_path, mnist):
    net = MultiLayerNetwork(small_cnn()).init()
    path = tmp_path / "m.dl4py"
    net.save(path)
    data = path.read_bytes()
    (tmp_path / "cut.dl4py").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"cut\.dl4py is not a valid dl4py model"):
        dl4py.load(tmp_path / "cut.dl4py")
    with pytest.raises(DataError, match="no such model file"):
        dl4py.load(tmp_path / "absent.dl4py")


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(784, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))

    def forward(self, x):
        return self.body(x)


def test_plain_torch_module_trains_evaluates_and_reloads(tmp_path, mnist):
    torch.manual_seed(0)
    model = TorchModel(Tiny(), loss=torch.nn.functional.cross_entropy,
                       optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                       output_activation=lambda z: torch.softmax(z, dim=1))
    train = MnistDataSetIterator(64, train=True, seed=2, limit=2048)
    test = MnistDataSetIterator(256, train=False, limit=1000)
    model.fit(train, epochs=2)
    assert model.evaluate(test).accuracy() > 0.8
    model.save(tmp_path / "tiny.dl4py")
    with pytest.raises(DataError, match=r"plain torch module .*Tiny.*pass it"):
        dl4py.load(tmp_path / "tiny.dl4py")
    fresh = TorchModel(Tiny(), loss=torch.nn.functional.cross_entropy,
                       optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                       output_activation=lambda z: torch.softmax(z, dim=1))
    restored = dl4py.load(tmp_path / "tiny.dl4py", into=fresh)
    assert torch.equal(restored.output(test.features), model.output(test.features))
    assert restored.epoch_count == 2


def test_array_iterator_fit_with_batch_size():
    x, y = torch.rand(50, 784), torch.randint(0, 10, (50,))
    net = MultiLayerNetwork(small_cnn())
    summaries = net.fit((x, y), epochs=1, batch_size=16)
    assert summaries[0].batches == 4 and summaries[0].examples == 50
    with pytest.raises(ValueError, match="batch_size applies to arrays"):
        net.fit(ArrayDataSetIterator(x, y, batch_size=10), batch_size=5)
