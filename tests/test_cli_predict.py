"""`dl4py predict`: a saved model's predictions for a CSV file or a .npy array, as CSV or
JSON; a bad input file is one line naming it. On each backend (``--backend``) the command
answers what the saved model, loaded on that backend, outputs."""

from __future__ import annotations

import json

import numpy as np
import pytest
from devices import backend_for, on_devices, tolerance

from dl4py import NetworkConfig, load
from dl4py.cli import main
from dl4py.data import MnistDataSetIterator
from dl4py.nn import MultiLayerNetwork


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A small classifier trained on 256 MNIST rows, saved as a run directory's model, and
    30 test rows with labels: (run_dir, model, features, labels)."""
    from conftest import require_mnist

    require_mnist()
    train = next(iter(MnistDataSetIterator(256, train=True, seed=12345, limit=256)))
    test = next(iter(MnistDataSetIterator(30, train=False, shuffle=False, limit=30)))
    config = NetworkConfig.from_dict({
        "seed": 5, "updater": {"type": "adam", "learning_rate": 0.005},
        "input_type": {"type": "feed_forward", "size": 784},
        "layers": [{"type": "dense", "n_out": 32, "activation": "relu"},
                   {"type": "output", "n_out": 10, "activation": "softmax", "loss": "negativeloglikelihood"}],
    })
    model = MultiLayerNetwork(config, backend="cpu").init()
    model.fit((train.features, train.labels), epochs=2, batch_size=64)
    run_dir = tmp_path_factory.mktemp("run")
    model.save(run_dir / "model.dl4py")
    return run_dir, model, test.features.numpy(), test.labels.numpy()


def predict(capsys, *args, device="cpu") -> tuple[int, str, str]:
    code = main(["predict", *map(str, args), "--backend", backend_for(device)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def outputs_on(model_file, device, features) -> np.ndarray:
    """What the saved model outputs on ``device``'s backend (the command's reference: the same
    device, so the same kernels), on the CPU."""
    return load(model_file, backend=backend_for(device)).output(features).cpu().numpy()


@on_devices
def test_csv_with_label_column_gives_class_indices(saved, tmp_path, capsys, device):
    run_dir, model, features, labels = saved
    path = tmp_path / "test.csv"
    np.savetxt(path, np.column_stack([features, labels]), delimiter=",", fmt="%.8g")
    code, out, _ = predict(capsys, run_dir, path, device=device)
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "prediction"
    assert [int(v) for v in lines[1:]] == outputs_on(run_dir / "model.dl4py", device, features).argmax(axis=1).tolist()


@on_devices
def test_npy_probabilities_as_json_file(saved, tmp_path, capsys, device):
    run_dir, model, features, _ = saved
    path, output = tmp_path / "x.npy", tmp_path / "out" / "p.json"
    np.save(path, features)
    code, out, _ = predict(capsys, run_dir / "model.dl4py", path, "--proba", "--output", output, device=device)
    assert code == 0 and out == ""
    probabilities = np.array(json.loads(output.read_text())["probabilities"])
    np.testing.assert_allclose(probabilities, outputs_on(run_dir / "model.dl4py", device, features), atol=1e-7, rtol=0)
    # and, within the device's tolerance, what the model trained on the CPU outputs there
    np.testing.assert_allclose(probabilities, model.output(features).numpy(), **tolerance(device, cpu=1e-7))


@on_devices
def test_features_only_csv_with_header_as_json(saved, tmp_path, capsys, device):
    run_dir, model, features, _ = saved
    path = tmp_path / "features.csv"
    np.savetxt(path, features[:7], delimiter=",", fmt="%.8g", header=",".join(f"f{i}" for i in range(784)),
               comments="")
    code, out, _ = predict(capsys, run_dir, path, "--skip-lines", "1", "--format", "json", device=device)
    assert code == 0
    expected = outputs_on(run_dir / "model.dl4py", device, features[:7]).argmax(axis=1).tolist()
    assert json.loads(out) == {"predictions": expected}


@pytest.mark.parametrize("content, complaint", [
    ("1,2,x\n", "line 1, column 3: 'x' is not a number"),
    ("1,2,3\n", "3 columns, but the model takes 784 features"),
])
def test_bad_csv_is_one_line_naming_the_file(saved, tmp_path, capsys, content, complaint):
    path = tmp_path / "bad.csv"
    path.write_text(content)
    code, out, err = predict(capsys, saved[0], path)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and str(path) in err and complaint in err, err


def test_bad_npy_is_one_line_naming_the_file(saved, tmp_path, capsys):
    path = tmp_path / "broken.npy"
    path.write_bytes(b"not an array")
    code, _, err = predict(capsys, saved[0], path)
    assert code == 2 and err.count("\n") == 1 and str(path) in err and "not a readable .npy" in err, err
    np.save(path, np.zeros((3, 5), dtype=np.float32))
    code, _, err = predict(capsys, saved[0], path)
    assert code == 2 and err.count("\n") == 1 and "[3, 5]" in err and "[n, 784]" in err, err


@on_devices
def test_image_folder_names_each_file(tmp_path, capsys, device):
    from PIL import Image

    from dl4py.data import ImagePreProcessingScaler

    config = NetworkConfig.from_dict({
        "seed": 9, "input_type": {"type": "convolutional", "height": 8, "width": 8, "channels": 1},
        "layers": [{"type": "convolution", "n_out": 3, "kernel_size": 3, "activation": "relu"},
                   {"type": "output", "n_out": 4, "activation": "softmax"}],
    })
    model = MultiLayerNetwork(config, backend="cpu").init().set_normalizer(ImagePreProcessingScaler())
    model.save(tmp_path / "model.dl4py")
    pixels = np.random.default_rng(0).integers(0, 256, size=(3, 8, 8), dtype=np.uint8)
    folder = tmp_path / "images"
    for name, image in zip(["b/2.png", "a.png", "b/1.png"], pixels):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image, mode="L").save(folder / name)
    code, out, _ = predict(capsys, tmp_path / "model.dl4py", folder, "--proba", device=device)
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "file,p0,p1,p2,p3"
    assert [line.split(",")[0] for line in lines[1:]] == ["a.png", "b/1.png", "b/2.png"]
    in_order = pixels[[1, 2, 0]].reshape(3, 1, 8, 8).astype(np.float32)
    got = np.array([[float(v) for v in line.split(",")[1:]] for line in lines[1:]])
    np.testing.assert_allclose(got, outputs_on(tmp_path / "model.dl4py", device, in_order), atol=1e-7, rtol=0)
