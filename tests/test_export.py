"""dl4py.export: ONNX (run in ONNX Runtime), TorchScript and the weights-only model file
answer what model.output answers, and `dl4py export` writes them. A model trained on a GPU
exports the same network (the files compute on the CPU: its output is compared under the
GPU's tolerance)."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from devices import backend_for, on_devices, tolerance

from dl4py import GraphConfig, NetworkConfig, NormalizerStandardize, RunConfig, load
from dl4py.cli import main
from dl4py.data import MnistDataSetIterator
from dl4py.errors import MissingDependencyError
from dl4py.export import export
from dl4py.nn import ComputationGraph, MultiLayerNetwork

ort = pytest.importorskip("onnxruntime")
# torch 2.13 deprecates TorchScript in favour of torch.export; the format is still read.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:DeprecationWarning")

ROOT = Path(__file__).resolve().parents[1]
LENET_YAML = ROOT / "examples" / "lenet_mnist.yaml"
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def mnist_rows():
    """256 MNIST training rows (flat, 0-1) and their labels."""
    from conftest import require_mnist

    require_mnist()
    batch = next(iter(MnistDataSetIterator(256, train=True, seed=12345, limit=256)))
    return batch.features, batch.labels


def made_once(make):
    """``get(device)``: ``make(device)``, made the first time a test asks for that device."""
    made = {}

    def get(device):
        if device not in made:
            made[device] = make(device)
        return made[device]

    return get


@pytest.fixture(scope="module")
def lenet_on(mnist_rows):
    """``lenet_on(device)``: the seed's LeNet after 4 steps on ``device``: trained weights, so
    an export that rebuilt the network from its config (the seed's initial weights) would not match."""
    def make(device):
        model = MultiLayerNetwork(RunConfig.from_file(LENET_YAML).network, backend=backend_for(device)).init()
        model.fit(mnist_rows, epochs=1, batch_size=64)
        return model

    return made_once(make)


@pytest.fixture(scope="module")
def batchnorm_on(mnist_rows):
    """``batchnorm_on(device)``: batch normalization and dropout, with a standardizing
    normalizer fitted on raw pixels shifted far from zero (so leaving the normalizer out changes
    every answer), after 8 steps on ``device``: running statistics away from their initial 0
    and 1. (model, raw features)."""
    return made_once(lambda device: _batchnorm_model(mnist_rows, device))


def _batchnorm_model(mnist_rows, device):
    features, labels = mnist_rows
    raw = features * 200.0 + 50.0
    config = NetworkConfig.from_dict({
        "seed": 7, "updater": {"type": "adam", "learning_rate": 0.01},
        "input_type": {"type": "feed_forward", "size": 784},
        "layers": [{"type": "dense", "n_out": 32, "activation": "identity"},
                   {"type": "batch_normalization"},
                   {"type": "activation", "activation": "relu"},
                   {"type": "dropout", "rate": 0.5},
                   {"type": "output", "n_out": 10, "activation": "softmax", "loss": "negativeloglikelihood"}],
    })
    model = MultiLayerNetwork(config, backend=backend_for(device)).init()
    model.set_normalizer(NormalizerStandardize().fit(raw))
    model.fit((raw, labels), epochs=2, batch_size=64)
    return model, raw


def onnx_outputs(path, features) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (name,) = [i.name for i in session.get_inputs()]
    return session.run(None, {name: np.ascontiguousarray(features, dtype=np.float32)})[0]


def expected(model, features) -> np.ndarray:
    return model.output(features).float().cpu().numpy()


def close_to_output(device) -> dict:
    """How close a file's answer (computed on the CPU) comes to ``model.output`` on ``device``:
    on the CPU float32 rounding apart; a GPU's convolutions run in TF32."""
    return {"atol": TOLERANCE, "rtol": 0} if device == "cpu" else tolerance(device)


@on_devices
def test_lenet_onnx_matches_output_at_any_batch_size(lenet_on, device, mnist_rows, tmp_path):
    lenet = lenet_on(device)
    path = export(lenet, tmp_path / "lenet.onnx")
    features = mnist_rows[0].numpy()
    for batch in (1, 37):  # the export traced a batch of 2: the batch dimension is dynamic
        got = onnx_outputs(path, features[:batch])
        assert got.shape == (batch, 10)
        np.testing.assert_allclose(got, expected(lenet, features[:batch]), **close_to_output(device))
    assert np.allclose(got.sum(axis=1), 1.0, atol=1e-5)  # the softmax is in the file


@on_devices
def test_batchnorm_dropout_onnx_in_inference_mode_with_normalizer(batchnorm_on, device, tmp_path):
    model, raw = batchnorm_on(device)
    (norm,) = [m for m in model.module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    assert not torch.allclose(norm.running_var, torch.ones_like(norm.running_var))
    path = export(model, tmp_path / "bn.onnx")
    features = raw[:50].numpy()
    got = onnx_outputs(path, features)
    np.testing.assert_allclose(got, expected(model, features), **close_to_output(device))
    np.testing.assert_array_equal(onnx_outputs(path, features), got)  # no dropout: the same twice
    # The normalizer is in the file: unnormalized, the same network answers otherwise.
    bare = MultiLayerNetwork(model.config, backend=backend_for(device)).init()
    bare.module.load_state_dict(model.module.state_dict())
    assert np.abs(expected(bare, features) - got).max() > 1e-2


@on_devices
def test_graph_onnx_matches_output(mnist_rows, tmp_path, device):
    config = GraphConfig.from_dict({
        "seed": 3, "updater": {"type": "sgd", "learning_rate": 0.1}, "activation": "tanh",
        "inputs": {"image": {"type": "convolutional_flat", "height": 28, "width": 28, "channels": 1}},
        "vertices": {
            "conv": {"inputs": ["image"], "layer": {"type": "convolution", "n_out": 4, "kernel_size": 3, "padding": 1}},
            "conv2": {"inputs": ["conv"], "layer": {"type": "convolution", "n_out": 4, "kernel_size": 3, "padding": 1}},
            "add": {"inputs": ["conv2", "conv"], "vertex": {"type": "elementwise", "op": "add"}},
            "out": {"inputs": ["add"], "layer": {"type": "output", "n_out": 10}},
        },
        "outputs": ["out"],
    })
    graph = ComputationGraph(config, backend=backend_for(device)).init()
    features = mnist_rows[0][:64]
    graph.fit((features, mnist_rows[1][:64]), epochs=1, batch_size=32)
    path = export(graph, tmp_path / "graph.onnx")
    got = onnx_outputs(path, features[:9].numpy())
    np.testing.assert_allclose(got, expected(graph, features[:9]), **close_to_output(device))


@on_devices
def test_torchscript_loads_and_matches(batchnorm_on, device, tmp_path):
    model, raw = batchnorm_on(device)
    path = export(model, tmp_path / "bn.pt", format="torchscript")
    scripted = torch.jit.load(str(path))
    with torch.no_grad():
        got = scripted(raw[:23]).numpy()
    np.testing.assert_allclose(got, expected(model, raw[:23]), **close_to_output(device))


@on_devices
def test_weights_only_file_loads_predicts_identically_and_is_smaller(batchnorm_on, device, tmp_path):
    model, raw = batchnorm_on(device)
    full, light = tmp_path / "full.dl4py", tmp_path / "light.dl4py"
    model.save(full)
    export(model, light, format="safetensors")
    with zipfile.ZipFile(light) as archive:
        names = set(archive.namelist())
    assert not names & {"updater.json", "updater.safetensors"} and "weights.safetensors" in names
    loaded = load(light, backend=backend_for(device))
    # The same network on the same device: the same bits on the CPU. The normalizer came along.
    torch.testing.assert_close(loaded.output(raw[:40]).cpu(), model.output(raw[:40]).cpu(), **tolerance(device))
    assert light.stat().st_size < 0.6 * full.stat().st_size  # Adam's two moments stay behind


@on_devices
def test_cli_export_writes_beside_the_model(lenet_on, device, mnist_rows, tmp_path, capsys):
    lenet = lenet_on(device)
    lenet.save(tmp_path / "model.dl4py")
    assert main(["export", str(tmp_path), "--format", "torchscript"]) == 0
    written = Path(capsys.readouterr().out.strip())
    assert written == tmp_path / "model.pt"
    scripted = torch.jit.load(str(written))
    with torch.no_grad():
        np.testing.assert_allclose(scripted(mnist_rows[0][:5]).numpy(), expected(lenet, mnist_rows[0][:5]),
                                   **close_to_output(device))


def test_missing_onnxscript_names_the_extra(lenet_on, tmp_path, monkeypatch, capsys):
    lenet = lenet_on("cpu")
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # as if it were not installed
    with pytest.raises(MissingDependencyError, match=r'pip install "dl4py\[export\]"'):
        export(lenet, tmp_path / "x.onnx")
    lenet.save(tmp_path / "model.dl4py")
    assert main(["export", str(tmp_path / "model.dl4py")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "dl4py[export]" in err
