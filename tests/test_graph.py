"""Computation graphs: GraphConfig as data, ComputationGraph training like a MultiLayerNetwork.

What is checked: shapes inferred for every vertex equal the real ones; each vertex's
arithmetic and its gradients (double precision, finite differences); a named error for each
impossible graph; YAML/JSON round trips, save/load; the residual CNN of
``examples/resnet_mnist.yaml`` against the seed's LeNet on the same MNIST slice; a graph of
two inputs (each half of an image) and a graph of two outputs; ParallelWrapper, a 16-bit
precision, early stopping and the command line on graphs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dl4py import (
    Adam,
    ArrayDataSetIterator,
    ComputationGraph,
    ConfigError,
    DataError,
    FineTuneConfiguration,
    GraphConfig,
    MnistDataSetIterator,
    MultiLayerNetwork,
    OutputLayer,
    RunConfig,
    TransferLearning,
    load,
)
from dl4py.cli import main
from dl4py.parallel import ParallelWrapper

from devices import backend_for, on_devices
from toy import toy  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESNET_YAML = ROOT / "examples" / "resnet_mnist.yaml"
LENET_YAML = ROOT / "examples" / "lenet_mnist.yaml"
TRAIN, TEST = 2048, 2000


@pytest.fixture(scope="module")
def mnist_slices():
    """Training and test slices of MNIST as tensors, flat 784-value rows."""
    from conftest import require_mnist

    require_mnist()
    train = next(iter(MnistDataSetIterator(TRAIN, train=True, seed=12345, limit=TRAIN)))
    test = next(iter(MnistDataSetIterator(TEST, train=False, shuffle=False, limit=TEST)))
    return train.features, train.labels, test.features, test.labels


def graph(vertices: dict, inputs=None, outputs=("out",), **network) -> GraphConfig:
    inputs = inputs or {"x": {"type": "feed_forward", "size": 6}}
    return GraphConfig.from_dict({"inputs": inputs, "vertices": vertices, "outputs": list(outputs),
                                  "activation": "tanh", **network})


def layer(inputs, **spec) -> dict:
    return {"inputs": list(inputs), "layer": spec}


def vertex(inputs, **spec) -> dict:
    return {"inputs": list(inputs), "vertex": spec}


def out(inputs, n_out=3, **spec) -> dict:
    return layer(inputs, type="output", n_out=n_out, **spec)


# ---- shapes and vertex arithmetic -------------------------------------------------------
def every_vertex_graph() -> GraphConfig:
    """One of each vertex kind, over flat and convolutional values."""
    return graph({
        "a": layer(["x"], type="dense", n_out=8),
        "b": layer(["x"], type="dense", n_out=8),
        "sum": vertex(["a", "b"], type="elementwise", op="add"),
        "diff": vertex(["a", "b"], type="elementwise", op="subtract"),
        "prod": vertex(["a", "b", "sum"], type="elementwise", op="product"),
        "mean": vertex(["a", "b"], type="elementwise", op="average"),
        "max": vertex(["a", "b"], type="elementwise", op="max"),
        "cat": vertex(["sum", "diff", "prod", "mean", "max"], type="merge"),  # 40
        "part": vertex(["cat"], type="subset", from_index=4, to_index=39),  # 36 values
        "image": vertex(["part"], type="preprocessor", preprocessor="feed_forward_to_cnn",
                        height=3, width=3, channels=4),
        "conv": layer(["image"], type="convolution", n_out=2, kernel_size=2),  # 2x2x2
        "conv2": layer(["image"], type="convolution", n_out=3, kernel_size=2),
        "maps": vertex(["conv", "conv2"], type="merge"),  # 5 channels of 2x2
        "flat": vertex(["maps"], type="preprocessor", preprocessor="cnn_to_feed_forward"),
        "out": out(["flat"]),
    })


@on_devices
def test_inferred_shapes_are_the_real_shapes_for_every_vertex(device):
    config = every_vertex_graph()
    net = ComputationGraph(config, backend=backend_for(device)).init()
    values = net.feed_forward(torch.randn(5, 6))
    inferred = {v.name: v.output for v in config.vertex_shapes()}
    assert inferred["cat"].dims == (40,) and inferred["part"].dims == (36,) and inferred["maps"].dims == (5, 2, 2)
    for name, shape in inferred.items():
        assert tuple(values[name].shape) == (5, *shape.dims), name


@on_devices
def test_vertices_compute_what_dl4j_defines(device):
    net = ComputationGraph(every_vertex_graph(), backend=backend_for(device)).init()
    v = net.feed_forward(torch.randn(4, 6))
    assert v["out"].device.type == device
    a, b = v["a"], v["b"]
    torch.testing.assert_close(v["sum"], a + b)
    torch.testing.assert_close(v["diff"], a - b)
    torch.testing.assert_close(v["prod"], a * b * (a + b))
    torch.testing.assert_close(v["mean"], (a + b) / 2)
    torch.testing.assert_close(v["max"], torch.maximum(a, b))
    torch.testing.assert_close(v["cat"], torch.cat([v["sum"], v["diff"], v["prod"], v["mean"], v["max"]], 1))
    torch.testing.assert_close(v["part"], v["cat"][:, 4:40])  # DL4J's to_index is included
    torch.testing.assert_close(v["image"], v["part"].reshape(4, 4, 3, 3))
    torch.testing.assert_close(v["maps"], torch.cat([v["conv"], v["conv2"]], 1))
    torch.testing.assert_close(v["out"], torch.softmax(net.module.vertices["out"](v["flat"]), 1))


@on_devices
def test_gradients_match_finite_differences_in_double_precision(device):
    """Of the loss, with respect to the input and every parameter (DL4J's GradientCheckUtil)."""
    net = ComputationGraph(every_vertex_graph(), backend=backend_for(device), precision="double").init()
    names = [name for name, _ in net.module.named_parameters()]
    labels = torch.tensor([0, 2, 1], device=device)

    def loss_of(x, *params):
        scores = torch.func.functional_call(net.module, dict(zip(names, params)), (x,))
        return net.loss(scores, labels)

    x = torch.randn(3, 6, dtype=torch.float64, device=device, requires_grad=True)
    params = tuple(p.detach().clone().requires_grad_() for p in net.module.parameters())
    # fast mode: finite differences along random directions (all inputs at once), not one by one;
    # on CUDA some backward kernels add with atomics: two backwards differ in the last bits
    assert torch.autograd.gradcheck(loss_of, (x, *params), fast_mode=True,
                                    nondet_tol=1e-12 if device == "cuda" else 0.0)


# ---- configuration errors name the vertex ------------------------------------------------
@pytest.mark.parametrize("vertices, outputs, where, words", [
    ({"c": layer(["x"], type="dense", n_out=4), "a": vertex(["c", "b"], type="elementwise"),
      "b": layer(["a"], type="dense", n_out=4), "out": out(["a"])},
     ("out",), "network.vertices", "the vertices a <- b <- a form a cycle"),
    ({"a": layer(["nowhere"], type="dense", n_out=4), "out": out(["a"])},
     ("out",), "network.vertices.a.inputs[0]", "'nowhere' is neither an input"),
    ({"a": layer(["x"], type="dense", n_out=4), "b": layer(["x"], type="dense", n_out=5),
      "add": vertex(["a", "b"], type="elementwise", op="add"), "out": out(["add"])},
     ("out",), "network.vertices.add.vertex", "one shape"),
    ({"a": layer(["x"], type="dense", n_out=4), "b": layer(["x"], type="dense", n_out=5),
      "idle": layer(["x"], type="dense", n_out=5), "cat": vertex(["a", "b"], type="merge"), "out": out(["cat"])},
     ("out",), "network.vertices.idle", "read by no vertex"),
    ({"a": layer(["x"], type="dense", n_out=4), "out": out(["a"])},
     ("a",), "network.outputs[0]", "must be an output layer"),
    ({"a": layer(["x"], type="dense", n_out=4), "out": out(["a"]), "out2": out(["a"])},
     ("out",), "network.vertices.out2", "not listed in network.outputs"),
    ({"a": layer(["x"], type="dense", n_out=4), "b": layer(["x", "a"], type="dense", n_out=4), "out": out(["b"])},
     ("out",), "network.vertices.b.inputs", "a layer takes one input"),
    ({"a": layer(["x"], type="dense", n_out=4), "s": vertex(["a"], type="subset", from_index=1, to_index=4),
      "out": out(["s"])}, ("out",), "network.vertices.s.vertex.to_index", "below the input's 4"),
    ({"a": vertex(["x"], type="merge"), "out": out(["a"])},
     ("out",), "network.vertices.a.inputs", "at least 2"),
    ({"a": {"inputs": ["x"], "layer": {"type": "dense", "n_out": 4}, "vertex": {"type": "merge"}},
      "out": out(["a"])}, ("out",), "network.vertices.a", "exactly one of 'layer'"),
    ({"a": layer(["x"], type="dense", n_out=4), "out": out(["a"]), "more": layer(["out"], type="dense", n_out=2)},
     ("out",), "network.vertices", "feed no other vertex"),
])
def test_an_impossible_graph_is_an_error_naming_the_vertex(vertices, outputs, where, words):
    with pytest.raises(ConfigError) as caught:
        graph(vertices, outputs=outputs)
    assert caught.value.where.startswith(where), caught.value.where
    assert words in str(caught.value)


def test_merge_of_maps_of_different_sizes_names_the_vertex():
    image = {"img": {"type": "convolutional", "height": 8, "width": 8, "channels": 1}}
    with pytest.raises(ConfigError, match=r"network\.vertices\.cat\.vertex: merge needs inputs of the same "
                                          r"height and width, got 4x6x6 and 4x8x8"):
        graph({"c1": layer(["img"], type="convolution", n_out=4, kernel_size=3),
               "c2": layer(["img"], type="convolution", n_out=4, kernel_size=1),
               "cat": vertex(["c1", "c2"], type="merge"), "out": out(["cat"])}, inputs=image)


def test_a_run_config_names_errors_inside_a_graph(tmp_path):
    text = RESNET_YAML.read_text().replace("inputs: [conv2, pool1]", "inputs: [conv2, stem]")
    (tmp_path / "bad.yaml").write_text(text)
    with pytest.raises(ConfigError) as caught:
        RunConfig.from_file(tmp_path / "bad.yaml")
    assert "network.vertices.add.vertex" in str(caught.value)
    assert "16x14x14 and 16x28x28" in str(caught.value)


# ---- data and persistence ------------------------------------------------------------------
def test_yaml_and_json_round_trip_and_save_load(tmp_path):
    config = RunConfig.from_file(RESNET_YAML).network
    assert GraphConfig.from_yaml(config.to_yaml()) == config
    assert GraphConfig.from_json(config.to_json()) == config
    net = ComputationGraph(config)
    x, y = torch.rand(64, 784), torch.randint(0, 10, (64,))
    net.fit((x, y), epochs=1, batch_size=16, verbose=0)
    net.save(tmp_path / "graph.dl4py")
    again = load(tmp_path / "graph.dl4py")
    assert isinstance(again, ComputationGraph) and again.config == config
    assert torch.equal(again.output(x), net.output(x))
    net.fit((x, y), epochs=1, batch_size=16, shuffle=False, verbose=0)  # the updater's state came back too
    again.fit((x, y), epochs=1, batch_size=16, shuffle=False, verbose=0)
    for (name, a), b in zip(net.module.state_dict().items(), again.module.state_dict().values()):
        assert torch.equal(a, b), name


# ---- training ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained_resnet(mnist_slices):
    """The residual CNN of examples/resnet_mnist.yaml, two epochs on the training slice."""
    x, y, _, _ = mnist_slices
    resnet = ComputationGraph(RunConfig.from_file(RESNET_YAML).network)
    resnet.fit(ArrayDataSetIterator(x, y, batch_size=32, seed=1), epochs=2, verbose=0)
    return resnet


@pytest.mark.slow
def test_the_residual_cnn_from_yaml_learns_at_least_as_well_as_lenet(mnist_slices, trained_resnet):
    """Same slice, epochs, batch size and shuffling; each with its example's updater."""
    x, y, tx, ty = mnist_slices
    lenet = MultiLayerNetwork(RunConfig.from_file(LENET_YAML).network)
    lenet.fit(ArrayDataSetIterator(x, y, batch_size=32, seed=1), epochs=2, verbose=0)
    lenet_accuracy = lenet.evaluate((tx, ty)).accuracy()
    resnet_accuracy = trained_resnet.evaluate((tx, ty)).accuracy()
    assert lenet_accuracy > 0.85
    assert resnet_accuracy >= lenet_accuracy, (resnet_accuracy, lenet_accuracy)


def test_transfer_learning_freezes_a_graph_below_its_dense_layer(mnist_slices, trained_resnet):
    """DL4J's TransferLearning.GraphBuilder: digits 0-4 on the frozen residual features."""
    x, y, tx, ty = mnist_slices
    before = {k: v.clone() for k, v in trained_resnet.module.state_dict().items()}
    graph = (TransferLearning.GraphBuilder(trained_resnet)
             .fine_tune_configuration(FineTuneConfiguration(updater=Adam(learning_rate=1e-3), seed=7))
             .set_feature_extractor("pool2")
             .remove_vertex_and_connections("out")
             .add_layer("out5", OutputLayer(n_out=5), "dense")
             .set_outputs("out5")
             .build())
    frozen = ("vertices.stem.", "vertices.conv1.", "vertices.conv2.")
    assert all(not p.requires_grad for n, p in graph.module.named_parameters() if n.startswith(frozen))
    stepped = {id(p) for group in graph.optimizer.param_groups for p in group["params"]}
    assert {n for n, p in graph.module.named_parameters() if id(p) in stepped} == {
        "vertices.dense.op.weight", "vertices.dense.op.bias", "vertices.out5.op.weight", "vertices.out5.op.bias"}
    assert torch.equal(graph.module.vertices["dense"].op.weight, before["vertices.dense.op.weight"])  # kept
    low, test_low = y < 5, ty < 5
    graph.fit((x[low], y[low]), epochs=1, batch_size=32, verbose=0)
    after = graph.module.state_dict()
    for name in before:
        if name.startswith(frozen):
            assert torch.equal(after[name], before[name]), name
    assert not torch.equal(after["vertices.dense.op.weight"], before["vertices.dense.op.weight"])
    assert graph.evaluate((tx[test_low], ty[test_low])).accuracy() > 0.9
    with pytest.raises(ConfigError, match="'nowhere' is not a vertex"):
        TransferLearning.GraphBuilder(trained_resnet).set_feature_extractor("nowhere")


def halves_graph(**network) -> GraphConfig:
    """Two inputs, the top and the bottom half of a digit, each read by its own convolution."""
    half = {"type": "convolutional_flat", "height": 14, "width": 28, "channels": 1}
    return GraphConfig.from_dict({
        "inputs": {"top": half, "bottom": half},
        "vertices": {
            "top_conv": layer(["top"], type="convolution", n_out=8, kernel_size=5, activation="relu"),
            "bottom_conv": layer(["bottom"], type="convolution", n_out=8, kernel_size=5, activation="relu"),
            "both": vertex(["top_conv", "bottom_conv"], type="merge"),
            "pool": layer(["both"], type="subsampling", kernel_size=2, stride=2),
            "out": out(["pool"], n_out=10),
        },
        "outputs": ["out"], "seed": 7, "weight_init": "relu",
        "updater": {"type": "adam", "learning_rate": 0.005}, **network,
    })


def halves(x: torch.Tensor) -> list[torch.Tensor]:
    return [x[:, :392], x[:, 392:]]


def test_a_two_input_graph_learns_from_both_inputs(mnist_slices):
    x, y, tx, ty = mnist_slices
    net = ComputationGraph(halves_graph())
    net.fit((halves(x), y), epochs=1, batch_size=32, verbose=0)
    packed = net.pack_inputs(*halves(tx))
    assert torch.equal(packed, tx)  # side by side, in the order of config.inputs
    accuracy = net.evaluate((packed, ty)).accuracy()
    assert accuracy > 0.8, accuracy
    # Each input matters: blanking one half costs accuracy.
    blank_top = net.evaluate((net.pack_inputs(torch.zeros(TEST, 392), tx[:, 392:]), ty)).accuracy()
    assert blank_top < accuracy - 0.2, (blank_top, accuracy)
    with pytest.raises(DataError, match=r"input 'bottom': \[5, 100\] has 100 values per example"):
        net.pack_inputs(torch.zeros(5, 392), torch.zeros(5, 100))


def test_a_sequence_input_and_a_vector_input_travel_side_by_side():
    config = graph({
        "seq": layer(["words"], type="last_time_step", layer={"type": "lstm", "n_out": 4}),
        "both": vertex(["seq", "extra"], type="merge"),
        "out": out(["both"]),
    }, inputs={"words": {"type": "recurrent", "size": 3, "length": 5}, "extra": {"type": "feed_forward", "size": 2}})
    net = ComputationGraph(config).init()
    words, extra = torch.randn(7, 5, 3), torch.randn(7, 2)
    values = net.feed_forward([words, extra])
    assert torch.equal(values["words"], words) and torch.equal(values["extra"], extra)
    assert values["both"].shape == (7, 6) and torch.equal(values["both"][:, 4:], extra)
    torch.testing.assert_close(net.output([words, extra]), net.activate(net.module([words, extra])))


@on_devices
def test_two_outputs_sum_their_losses(device):
    config = graph({
        "hidden": layer(["x"], type="dense", n_out=8),
        "digit": out(["hidden"], n_out=3),
        "odd": out(["hidden"], n_out=1, loss="xent"),
    }, outputs=("digit", "odd"), updater={"type": "adam", "learning_rate": 0.01})
    net = ComputationGraph(config, backend=backend_for(device)).init()
    x = torch.randn(64, 6, generator=torch.Generator().manual_seed(7))  # not the global generator: the order of tests moves it
    digit = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    odd = (x[:, 2] > 0).float().unsqueeze(1)
    labels = net.pack_labels(digit, odd)
    assert labels.shape == (64, 4) and torch.equal(labels[:, :3].argmax(1), digit)
    scores = net.module(x.to(device))
    expected = torch.nn.functional.cross_entropy(scores[0], digit.to(device)) + \
        torch.nn.functional.binary_cross_entropy_with_logits(scores[1], odd.to(device))
    torch.testing.assert_close(net.loss(scores, labels.to(device)), expected)
    before = net.score((x, [digit, odd]))
    net.fit((x, [digit, odd]), epochs=30, batch_size=16, verbose=0)
    assert net.score((x, [digit, odd])) < 0.5 * before
    digit_probs, odd_probs = net.output(x)
    assert digit_probs.shape == (64, 3) and odd_probs.shape == (64, 1)
    accuracy = (digit_probs.argmax(1).cpu() == digit).float().mean()
    assert accuracy > 0.8, accuracy
    with pytest.raises(DataError, match="evaluate needs a graph with one output"):
        net.evaluate((x, [digit, odd]))


@on_devices
def test_a_graph_trains_in_bfloat16_and_with_early_stopping(device):
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bfloat16 needs a GPU of compute capability 8.0 or later")
    from dl4py.train.early_stopping import DataSetLossCalculator, EarlyStoppingConfiguration, EarlyStoppingTrainer
    from dl4py.train.early_stopping import MaxEpochs

    config = graph({
        "a": layer(["x"], type="dense", n_out=16),
        "b": layer(["x"], type="dense", n_out=16),
        "both": vertex(["a", "b"], type="merge"),
        "out": out(["both"]),
    }, inputs={"x": {"type": "feed_forward", "size": 5}}, updater={"type": "adam", "learning_rate": 0.01})
    x, y = toy(512)
    tx, ty = toy(256, seed=1)
    net = ComputationGraph(config, backend=backend_for(device), precision="mixed-bf16")
    settings = EarlyStoppingConfiguration(score_calculator=DataSetLossCalculator(ArrayDataSetIterator(tx, ty, 128)),
                                          epoch_conditions=[MaxEpochs(4)])
    result = EarlyStoppingTrainer(settings, net, ArrayDataSetIterator(x, y, batch_size=32)).fit()
    assert result.total_epochs == 4
    scores = [result.score_vs_epoch[e] for e in sorted(result.score_vs_epoch)]
    assert all(later < earlier for earlier, later in zip(scores, scores[1:])), scores  # held-out loss falls
    best = result.best_model(backend=backend_for(device))
    assert isinstance(best, ComputationGraph) and best.precision.name == "mixed-bf16"
    assert best.evaluate((tx, ty)).accuracy() > 0.75  # three classes: chance is about 0.4


# ---- ParallelWrapper -----------------------------------------------------------------------
@pytest.mark.slow
def test_two_workers_train_the_residual_graph(mnist_slices):
    x, y, tx, ty = mnist_slices
    net = ComputationGraph(RunConfig.from_file(RESNET_YAML).network, backend="cpu")
    ParallelWrapper(net, workers=2, averaging_frequency=1).fit(ArrayDataSetIterator(x, y, batch_size=32, seed=1),
                                                                epochs=2)
    assert net.iteration_count == 2 * TRAIN // 32
    assert net.evaluate((tx, ty)).accuracy() > 0.85


def test_two_workers_on_a_two_input_graph_step_on_the_mean_gradient():
    """Shared gradients: each round's update is the mean gradient of the workers' batches,
    so the packed inputs reach every worker whole and in order."""
    torch.manual_seed(0)
    x, y = torch.rand(64, 784), torch.randint(0, 10, (64,))
    config = halves_graph(updater={"type": "sgd", "learning_rate": 0.1})
    reference = ComputationGraph(config).init()
    params = list(reference.module.parameters())
    for start in range(0, 64, 32):  # 4 batches of 16: 2 rounds of 2 workers
        grads = []
        for b in (start, start + 16):
            reference.module.zero_grad()
            reference.loss(reference.module(x[b:b + 16]), y[b:b + 16]).backward()
            grads.append([p.grad.clone() for p in params])
        with torch.no_grad():
            for i, p in enumerate(params):
                p -= 0.1 * (grads[0][i] + grads[1][i]) / 2
    net = ComputationGraph(config, backend="cpu")
    data = ArrayDataSetIterator(net.pack_inputs(*halves(x)), y, batch_size=16, shuffle=False)
    ParallelWrapper(net, workers=2, parallelism={"kind": "data", "sync": "shared_gradients"}).fit(data, epochs=1)
    for (name, a), b in zip(net.module.named_parameters(), reference.module.parameters()):
        assert torch.allclose(a, b, atol=1e-5), name


# ---- command line --------------------------------------------------------------------------
def test_dl4py_train_and_summary_take_a_graph(tmp_path, mnist, capsys):
    out = tmp_path / "run"
    args = ["train", RESNET_YAML, "--epochs", 1, "--output", out, "--set", "data.limit_train=512",
            "--set", "data.limit_test=200", "--no-progress"]
    assert main([str(a) for a in args]) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["status"] == "completed" and result["test_accuracy"] > 0.3
    assert isinstance(load(out / "model.dl4py"), ComputationGraph)
    capsys.readouterr()
    assert main(["summary", str(RESNET_YAML)]) == 0
    table = capsys.readouterr().out
    assert "add" in table and "elementwise add  conv2, pool1" in table and "Total parameters: 55,690" in table
