"""StatsListener: per-layer statistics every few iterations, on one device and from spawned
workers, into memory and into metrics.jsonl (which never stays open)."""

from __future__ import annotations

import gc
import json
import warnings

import pytest
import torch

from dl4py import (
    ConvolutionLayer,
    DenseLayer,
    InputType,
    MnistDataSetIterator,
    MultiLayerNetwork,
    NetworkConfig,
    OutputLayer,
    Sgd,
    SubsamplingLayer,
)
from dl4py.monitor import FileStatsStorage, InMemoryStatsStorage, StatsListener
from dl4py.train import MetricsLogger, TrainingListener

LR, BATCH, EXAMPLES, EPOCHS, EVERY = 0.05, 32, 512, 2, 5
ITERATIONS = EXAMPLES // BATCH * EPOCHS  # 32
LAYERS = ["0_ConvolutionLayer", "1_SubsamplingLayer", "2_DenseLayer", "3_OutputLayer"]


def lenet_ish() -> NetworkConfig:
    # Plain SGD (no momentum, no L2): a step changes each parameter by exactly -lr * gradient.
    return NetworkConfig(
        seed=42, updater=Sgd(learning_rate=LR), input_type=InputType.convolutional_flat(28, 28, 1),
        layers=[ConvolutionLayer(n_out=6, kernel_size=(5, 5), activation="relu"),
                SubsamplingLayer(kernel_size=(2, 2), stride=(2, 2)),
                DenseLayer(n_out=32, activation="relu"), OutputLayer(n_out=10)])


class ConvByHand(TrainingListener):
    """The first layer's parameters after iteration ``at - 1`` and ``at``: the update by hand."""

    def __init__(self, at: int):
        self.at, self.before, self.after, self.gradient_sum = at, None, None, None

    def iteration_done(self, model, iteration, epoch, loss, batch_size):
        params = list(model.module[0].parameters())
        if iteration == self.at - 1:
            self.before = [p.detach().clone() for p in params]
        elif iteration == self.at:
            self.after = [p.detach().clone() for p in params]
            self.gradient_sum = sum(float(p.grad.abs().sum()) for p in params)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One short MNIST run, with validation, recorded in memory and in a run directory."""
    from conftest import require_mnist

    require_mnist()
    run_dir = tmp_path_factory.mktemp("run")
    train = MnistDataSetIterator(BATCH, train=True, seed=1, limit=EXAMPLES)
    validation = MnistDataSetIterator(200, train=False, seed=1, shuffle=False, limit=200)
    memory, by_hand = InMemoryStatsStorage(), ConvByHand(at=10)
    model = MultiLayerNetwork(lenet_ish(), backend="cpu").init()
    stats = StatsListener([memory, FileStatsStorage(run_dir / "metrics.jsonl")], frequency=EVERY)
    history = model.fit(train, epochs=EPOCHS, validation=validation, listeners=[stats, by_hand])
    return memory, run_dir, history, by_hand


def test_a_stats_record_every_frequency_iterations_with_score_rate_speed_and_memory(run):
    memory, _, _, _ = run
    static = memory.static
    assert len(static) == 1 and static[0]["workers"] == 1
    assert static[0]["model"]["layers"] == LAYERS and static[0]["model"]["parameters"] > 0
    assert "Total parameters" in static[0]["model"]["summary"]
    assert static[0]["environment"]["backend"] == "cpu" and static[0]["environment"]["precision"] == "float"
    updates = memory.updates
    assert [r["iteration"] for r in updates] == list(range(EVERY, ITERATIONS + 1, EVERY))  # 5, 10, ..., 30
    assert [r["epoch"] for r in updates] == [0, 0, 0, 1, 1, 1]  # 16 iterations an epoch
    for record in updates:
        assert record["learning_rate"] == LR and 0 < record["score"] < 5 and record["samples_per_second"] > 0
        assert record["memory"]["process_rss_bytes"] > 10_000_000
        assert record["memory"]["device_allocated_bytes"] is None  # a CPU has no device memory to report
        assert list(record["layers"]) == LAYERS


def test_update_ratio_is_the_change_of_the_parameters_over_their_size(run):
    memory, _, _, by_hand = run
    tenth = next(r for r in memory.updates if r["iteration"] == 10)["layers"]["0_ConvolutionLayer"]
    size = sum(p.numel() for p in by_hand.after)
    update = sum(float((a - b).abs().sum()) for a, b in zip(by_hand.after, by_hand.before)) / size
    parameters = sum(float(a.abs().sum()) for a in by_hand.after) / size
    assert tenth["updates"] == pytest.approx(update, rel=1e-5)
    assert tenth["parameters"] == pytest.approx(parameters, rel=1e-5)
    assert tenth["gradients"] == pytest.approx(by_hand.gradient_sum / size, rel=1e-5)
    assert tenth["update_ratio"] == pytest.approx(update / parameters, rel=1e-5)
    # Plain SGD moves each parameter by lr * gradient: on every record, the first included
    # (its parameters were copied on the step before it), for every layer with parameters.
    for record in memory.updates:
        for name in ("0_ConvolutionLayer", "2_DenseLayer", "3_OutputLayer"):
            layer = record["layers"][name]
            assert layer["updates"] == pytest.approx(LR * layer["gradients"], rel=1e-4), (record["iteration"], name)
            assert layer["update_ratio"] == pytest.approx(layer["updates"] / layer["parameters"], rel=1e-9)
            assert 1e-5 < layer["update_ratio"] < 1


def test_every_layer_has_its_activations_and_a_pooling_layer_no_parameters(run):
    memory, _, _, _ = run
    for record in memory.updates:
        assert all(layer["activations"] > 0 for layer in record["layers"].values()), record["iteration"]
        pooling = record["layers"]["1_SubsamplingLayer"]
        assert pooling["parameters"] is None and pooling["update_ratio"] is None


def test_epoch_records_carry_the_history_with_validation(run):
    memory, _, history, _ = run
    epochs = memory.epochs
    assert [r["epoch"] for r in epochs] == [0, 1] and [r["iteration"] for r in epochs] == [16, 32]
    assert [r["val_accuracy"] for r in epochs] == history.history["val_accuracy"]
    assert [r["val_loss"] for r in epochs] == history.history["val_loss"]
    assert all(r["completed"] and r["loss"] == h for r, h in zip(epochs, history.history["loss"]))


def test_the_file_holds_the_same_records_as_strict_json_lines(run):
    memory, run_dir, _, _ = run
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()

    def strict(text):
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in metrics.jsonl"))

    records = [strict(line) for line in lines]
    assert [r["kind"] for r in records] == [r["kind"] for r in memory.records]
    assert [r["kind"] for r in records][:2] == ["static", "stats"] and records[-1]["kind"] == "epoch"
    times = [r["time"] for r in records]
    assert times == sorted(times) and times[0] >= 0
    assert records[1]["layers"] == memory.updates[0]["layers"]


def test_no_metrics_file_stays_open_after_a_fit_or_a_write_of_ones_own(tmp_path):
    x, y = torch.rand(64, 784), torch.randint(0, 10, (64,))
    config = NetworkConfig(seed=1, updater=Sgd(0.1), input_type=InputType.feed_forward(784),
                           layers=[DenseLayer(n_out=8), OutputLayer(n_out=10)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        logger = MetricsLogger(tmp_path / "a" / "metrics.jsonl", every=1)
        stats = StatsListener(tmp_path / "b", frequency=1, score_every=1)
        MultiLayerNetwork(config, backend="cpu").fit((x, y), epochs=1, batch_size=16, listeners=[logger, stats])
        logger.write({"kind": "evaluation", "test_accuracy": 0.5})  # after the fit, as the runner does
        stats.write({"kind": "evaluation", "test_accuracy": 0.5})
        del logger, stats
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], [str(w.message) for w in caught]
    a = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in a] == ["iteration"] * 4 + ["epoch", "evaluation"]
    assert [r["kind"] for r in b] == ["static"] + ["iteration", "stats"] * 4 + ["epoch", "evaluation"]


def test_bad_settings_are_named():
    with pytest.raises(TypeError, match="storage must be a StatsStorage"):
        StatsListener(object())
    with pytest.raises(ValueError, match="frequency must be a whole number"):
        StatsListener(InMemoryStatsStorage(), frequency=-1)


def test_spawned_workers_relay_worker_0s_stats_to_the_listener_in_this_process(mnist):
    """Worker 0 reads its replica; the records reach the storage of this process (an
    in-memory one: nothing else could fill it) with the model's iteration numbers."""
    from dl4py.parallel import ParallelWrapper

    memory = InMemoryStatsStorage()
    model = MultiLayerNetwork(lenet_ish(), backend="cpu")
    # Shared gradients: each step applies lr * the workers' mean gradient, which stays in .grad.
    with ParallelWrapper(model, workers=2, parallelism={"kind": "data", "sync": "shared_gradients"}) as wrapper:  # rounds: 2, 4, 6, 8
        wrapper.fit(MnistDataSetIterator(BATCH, train=True, seed=1, limit=256), epochs=1,
                    listeners=[StatsListener(memory, frequency=3, histogram_every=2)])
    assert memory.static[0]["workers"] == 2
    updates = memory.updates
    assert [r["iteration"] for r in updates] == [4, 6]  # passing 3 and 6
    # histograms on the record passing 6: binned on worker 0's replica like the rest
    assert "histograms" not in updates[0]
    sizes = {name: sum(p.numel() for p in layer.parameters()) for name, layer in zip(LAYERS, model.module)}
    assert list(updates[1]["histograms"]) == ["0_ConvolutionLayer", "2_DenseLayer", "3_OutputLayer"]
    for name, kinds in updates[1]["histograms"].items():
        assert list(kinds) == ["parameters", "gradients", "updates"], name
        assert all(sum(histogram["counts"]) == sizes[name] for histogram in kinds.values()), name
    for record in updates:
        assert list(record["layers"]) == LAYERS and record["samples_per_second"] > 0
        for name in ("0_ConvolutionLayer", "2_DenseLayer", "3_OutputLayer"):
            layer = record["layers"][name]
            assert layer["parameters"] > 0 and layer["gradients"] > 0 and layer["activations"] > 0
            assert layer["updates"] == pytest.approx(LR * layer["gradients"], rel=1e-4)
            assert layer["update_ratio"] == pytest.approx(layer["updates"] / layer["parameters"], rel=1e-9)
    assert [r["kind"] for r in memory.records] == ["static", "stats", "stats", "epoch"]


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh())
        self.out = torch.nn.Linear(8, 3)
        self.scale = torch.nn.Parameter(torch.ones(()))  # the root's own parameter

    def forward(self, x):
        return self.out(self.encoder(x)) * self.scale


def _sgd(params):
    return torch.optim.SGD(params, lr=LR)


def test_a_torch_model_names_layers_by_module_path_and_master_weights_give_the_true_gradients():
    from dl4py import TorchModel

    x, y = torch.randn(64, 5, generator=torch.Generator().manual_seed(0)), torch.arange(64) % 3
    memory = InMemoryStatsStorage()
    model = TorchModel(_Net(), loss=torch.nn.functional.cross_entropy, optimizer=_sgd, backend="cpu")
    model.fit((x, y), epochs=1, batch_size=16, listeners=[StatsListener(memory, frequency=2)])
    assert memory.static[0]["model"]["layers"] == ["model", "encoder.0", "out"]
    # bfloat16 parameters with float32 masters: the optimizer steps the masters, which hold
    # the gradients after the step; the 16-bit module's were moved there.
    config = NetworkConfig(seed=1, updater=Sgd(LR), input_type=InputType.feed_forward(5),
                           layers=[DenseLayer(n_out=8, activation="tanh"), OutputLayer(n_out=3)])
    network = MultiLayerNetwork(config, backend="cpu", precision="bfloat16")
    network.fit((x, y), epochs=1, batch_size=16, listeners=[StatsListener(memory, frequency=2)])
    assert network.precision_state.keeps_masters
    for record in memory.updates:  # 2 from each fit
        for name, layer in record["layers"].items():
            assert layer["updates"] == pytest.approx(LR * layer["gradients"], rel=1e-4), name
            assert layer["activations"] > 0
    assert len(memory.updates) == 4
