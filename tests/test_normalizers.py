"""Normalizers: fitted in one streaming pass on the training data, applied by the model on
its device, saved inside the model file (DL4J's NormalizerStandardize, NormalizerMinMaxScaler,
ImagePreProcessingScaler and ModelSerializer.addNormalizerToModel)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save as st_save

from dl4py import (
    ArrayDataSetIterator,
    DataSet,
    ImagePreProcessingScaler,
    MultiLayerNetwork,
    NetworkConfig,
    NormalizerMinMaxScaler,
    NormalizerStandardize,
)
from dl4py.config import RunConfig
from dl4py.errors import ConfigError, DataError, ModelFileError
from dl4py.nn.loading import load
from dl4py.runner import train_run

ROOT = Path(__file__).resolve().parents[1]
NETWORK = {
    "seed": 1,
    "updater": {"type": "adam", "learning_rate": 0.01},
    "input_type": {"type": "feed_forward", "size": 4},
    "layers": [{"type": "dense", "n_out": 8, "activation": "tanh"},
               {"type": "output", "n_out": 3, "activation": "softmax", "loss": "mcxent"}],
}


def _batches(x: np.ndarray, sizes) -> list[DataSet]:
    assert sum(sizes) == len(x)
    parts = np.split(x, np.cumsum(sizes)[:-1])
    return [DataSet(torch.from_numpy(p), torch.zeros(len(p), dtype=torch.int64)) for p in parts]


# ---- the statistics ------------------------------------------------------------------------
def test_one_streaming_pass_equals_the_whole_array_statistics():
    rng = np.random.default_rng(0)
    # Large offsets against small spreads: a sum-of-squares formula loses digits here.
    x = rng.normal(size=(1234, 5)) * np.array([1e-3, 1, 10, 1e3, 0.5]) + np.array([1e4, -3, 0, 5e5, 7])
    fitted = NormalizerStandardize().fit(_batches(x, [1, 7, 300, 2, 513, 411]))
    np.testing.assert_allclose(fitted.mean.numpy(), x.mean(0), rtol=0, atol=1e-9)
    np.testing.assert_allclose(fitted.std.numpy(), x.std(0), rtol=1e-9, atol=1e-9)  # population std, as DL4J
    # An iterator's shuffled batches (the last one short) give the numbers of its float32 copy.
    it = ArrayDataSetIterator(x, np.zeros(len(x), dtype=np.int64), batch_size=100, seed=3)
    from_iterator, held = NormalizerStandardize().fit(it), it.features.double().numpy()
    np.testing.assert_allclose(from_iterator.mean.numpy(), held.mean(0), rtol=0, atol=1e-9)
    np.testing.assert_allclose(from_iterator.std.numpy(), held.std(0), rtol=1e-9, atol=1e-9)

    minmax = NormalizerMinMaxScaler().fit(_batches(x, [600, 1, 633]))
    np.testing.assert_array_equal(minmax.min.numpy(), x.min(0))
    np.testing.assert_array_equal(minmax.max.numpy(), x.max(0))


def test_fit_takes_what_model_fit_takes_and_names_what_it_cannot():
    """A Keras-style ``(x, y)`` pair and a DataSet give the statistics of x alone; a value that is
    no data at all is one DataError, not an AttributeError from inside."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(50, 3)).astype(np.float32)
    y = np.arange(50) % 2
    alone = NormalizerStandardize().fit(x)
    for data in ((x, y), DataSet(torch.from_numpy(x), torch.from_numpy(y))):
        fitted = NormalizerStandardize().fit(data)
        torch.testing.assert_close(fitted.mean, alone.mean)
        torch.testing.assert_close(fitted.std, alone.std)
    with pytest.raises(DataError, match=r"normalizer fit: cannot train on int"):
        NormalizerStandardize().fit(5)


def test_images_are_normalized_per_channel():
    rng = np.random.default_rng(1)
    images = rng.uniform(0, 255, size=(37, 3, 4, 5)) + np.array([0, 100, -50])[None, :, None, None]
    fitted = NormalizerStandardize().fit(_batches(images, [10, 20, 7]))
    per_channel = images.transpose(1, 0, 2, 3).reshape(3, -1)
    np.testing.assert_allclose(fitted.mean.numpy(), per_channel.mean(1), atol=1e-9)
    np.testing.assert_allclose(fitted.std.numpy(), per_channel.std(1), rtol=1e-9)
    out = fitted.transform(torch.from_numpy(images))
    assert out.shape == images.shape
    np.testing.assert_allclose(out.numpy().transpose(1, 0, 2, 3).reshape(3, -1).mean(1), 0, atol=1e-9)


def test_minmax_maps_the_training_range_as_dl4j_does():
    train = torch.tensor([[0.0, 10.0, 5.0], [4.0, 30.0, 5.0]], dtype=torch.float64)
    default = NormalizerMinMaxScaler().fit(train)  # DL4J's default range is [0, 1]
    assert (default.min_range, default.max_range) == (0.0, 1.0)
    np.testing.assert_allclose(default.transform(train)[:, :2].numpy(), [[0, 0], [1, 1]])
    # A constant feature: max raised to min + 1e-5 (DL4J's MinMaxStats), so it maps to min_range.
    assert default.max[2].item() == pytest.approx(5 + 1e-5) and default.transform(train)[0, 2] == 0
    # Later data outside the training range is not clipped.
    np.testing.assert_allclose(default.transform(torch.tensor([[8.0, 0.0, 5.0]], dtype=torch.float64))[0, :2].numpy(),
                               [2.0, -0.5])
    ranged = NormalizerMinMaxScaler(-1, 1).fit(train)
    np.testing.assert_allclose(ranged.transform(torch.tensor([[2.0, 20.0, 5.0]], dtype=torch.float64)).numpy(),
                               [[0, 0, -1]], atol=1e-12)
    torch.testing.assert_close(ranged.revert(ranged.transform(train))[:, :2], train[:, :2])
    with pytest.raises(ValueError, match="max_range must be above min_range"):
        NormalizerMinMaxScaler(1, 1)


def test_image_scaler_divides_by_the_largest_pixel_value_as_dl4j_does():
    scaler = ImagePreProcessingScaler()  # DL4J: (0, 1, 8 bits)
    assert (scaler.min_range, scaler.max_range, scaler.max_bits, scaler.max_pixel_value) == (0, 1, 8, 255)
    pixels = torch.tensor([[0.0, 51.0, 255.0]])
    torch.testing.assert_close(scaler.transform(pixels), torch.tensor([[0.0, 0.2, 1.0]]))
    torch.testing.assert_close(ImagePreProcessingScaler(-1, 1).transform(pixels), torch.tensor([[-1.0, -0.6, 1.0]]))
    torch.testing.assert_close(ImagePreProcessingScaler(max_bits=16).transform(torch.tensor([[65535.0]])),
                               torch.tensor([[1.0]]))
    uint8 = torch.tensor([[0, 255]], dtype=torch.uint8)  # integer pixels come out as floats
    assert scaler.transform(uint8).dtype == torch.float32

    class Unreadable:
        def __iter__(self):
            raise AssertionError("ImagePreProcessingScaler.fit must not read the data")

    assert scaler.fit(Unreadable()) is scaler


# ---- the model applies it, saves it, and a fresh process gets the same outputs ----------------
def _toy(seed: int, n: int, offset: float, scale: float):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0).astype(np.int64)
    return x * scale + offset, y


@pytest.mark.slow
def test_a_loaded_model_normalizes_raw_inputs_as_the_saved_one(tmp_path):
    x, y = _toy(0, 256, offset=500.0, scale=40.0)  # raw scale a network trains badly on
    net = MultiLayerNetwork(NetworkConfig.from_dict(NETWORK), backend="cpu")
    normalizer = NormalizerStandardize().fit(ArrayDataSetIterator(x, y, batch_size=50))
    net.set_normalizer(normalizer).fit(ArrayDataSetIterator(x, y, batch_size=32, seed=1), epochs=20)
    assert net.evaluate((x, y)).accuracy() > 0.85  # evaluate normalizes too (the majority class is 0.5)
    probe = x[:20]
    before = net.output(probe).numpy()
    np.save(tmp_path / "probe.npy", probe)
    net.save(tmp_path / "m.dl4py")

    code = """
        import sys, numpy as np, dl4py
        model = dl4py.load(sys.argv[1], backend="cpu")
        np.save(sys.argv[3], model.output(np.load(sys.argv[2])).numpy())
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), tmp_path / "m.dl4py",
                           tmp_path / "probe.npy", tmp_path / "after.npy"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    np.testing.assert_allclose(np.load(tmp_path / "after.npy"), before, rtol=0, atol=1e-6)

    loaded = load(tmp_path / "m.dl4py", backend="cpu")
    np.testing.assert_array_equal(loaded.normalizer.mean.numpy(), normalizer.mean.numpy())
    assert not np.allclose(loaded.set_normalizer(None).output(probe).numpy(), before, atol=1e-3)


def test_set_normalizer_wants_a_fitted_normalizer():
    net = MultiLayerNetwork(NetworkConfig.from_dict(NETWORK), backend="cpu")
    with pytest.raises(DataError, match="NormalizerStandardize is not fitted"):
        net.set_normalizer(NormalizerStandardize())
    with pytest.raises(TypeError, match="needs a dl4py Normalizer"):
        net.set_normalizer(lambda x: x)
    net.set_normalizer(NormalizerStandardize().fit(torch.zeros(3, 5)))
    with pytest.raises(DataError, match=r"fitted on data with 5 features.*shape \[2, 4\]"):
        net.output(np.zeros((2, 4), dtype=np.float32))


# ---- from a run config: fitted on the training data only, kept on resume ---------------------
def _write_csv(path: Path, seed: int, offset: float, scale: float, n: int = 120) -> np.ndarray:
    x, y = _toy(seed, n, offset, scale)
    path.write_text("".join(",".join(f"{v:.6f}" for v in row) + f",{label}\n" for row, label in zip(x, y)))
    return np.loadtxt(path, delimiter=",")[:, :4]


def _run_config(tmp_path: Path, normalizer, epochs: int = 1) -> RunConfig:
    return RunConfig.from_dict({
        "network": NETWORK,
        "data": {"dataset": "csv", "train_path": str(tmp_path / "train.csv"), "test_path": str(tmp_path / "test.csv"),
                 "num_classes": 3, "normalizer": normalizer},
        "training": {"epochs": epochs, "batch_size": 32, "backend": "cpu", "score_every": 0},
    })


def test_a_run_fits_its_normalizer_on_the_training_data_only_and_resume_keeps_it(tmp_path):
    train = _write_csv(tmp_path / "train.csv", 0, offset=10.0, scale=2.0)
    _write_csv(tmp_path / "test.csv", 1, offset=-50.0, scale=9.0)  # other statistics entirely
    run = tmp_path / "run"
    train_run(_run_config(tmp_path, "standardize"), output=run, progress=False)
    model = load(run / "model.dl4py", backend="cpu")
    np.testing.assert_allclose(model.normalizer.mean.numpy(), train.mean(0), atol=1e-5)  # float32 CSV values
    np.testing.assert_allclose(model.normalizer.std.numpy(), train.std(0), rtol=1e-5)

    # --resume uses the checkpoint's normalizer: new training numbers do not refit it.
    _write_csv(tmp_path / "train.csv", 2, offset=1000.0, scale=1.0)
    train_run(_run_config(tmp_path, "standardize", epochs=2), output=run, resume=True, progress=False)
    resumed = load(run / "model.dl4py", backend="cpu")
    assert resumed.epoch_count == 2
    np.testing.assert_array_equal(resumed.normalizer.mean.numpy(), model.normalizer.mean.numpy())
    with pytest.raises(ConfigError, match=r"^data\.normalizer: .*minmax.*checkpoint"):
        train_run(_run_config(tmp_path, {"type": "minmax", "max_range": 2}, epochs=3), output=run, resume=True,
                  progress=False)


@pytest.mark.parametrize("value, key", [
    ("zscore", r"data\.normalizer\.type: unknown type 'zscore'"),
    ({"type": "minmax", "min_range": 1, "max_range": 0}, r"data\.normalizer\.max_range"),
    ({"type": "image_scaler", "max_bits": 0}, r"data\.normalizer\.max_bits"),
    ({"type": "standardize", "min_range": 0}, r"data\.normalizer\.min_range: unknown field"),
])
def test_normalizer_config_errors_name_the_key(tmp_path, value, key):
    with pytest.raises(ConfigError, match=key):
        _run_config(tmp_path, value)


@pytest.mark.parametrize("value, kind", [
    ("standardize", NormalizerStandardize),
    ({"type": "minmax", "min_range": -1, "max_range": 2}, NormalizerMinMaxScaler),
    ({"type": "image_scaler", "min_range": -1, "max_range": 1, "max_bits": 4}, ImagePreProcessingScaler),
])
def test_each_normalizer_section_builds_its_normalizer_with_its_options(tmp_path, value, kind):
    """config/ names the normalizers and data/ registers their classes (config imports no data/)."""
    section = _run_config(tmp_path, value).data.normalizer
    built = section.build()
    assert type(built) is kind
    assert built.settings() == section.to_dict()


# ---- a corrupt normalizer entry in a model file -----------------------------------------------
@pytest.fixture(scope="module")
def saved_entries(tmp_path_factory) -> dict[str, bytes]:
    net = MultiLayerNetwork(NetworkConfig.from_dict(NETWORK), backend="cpu")
    x, y = _toy(0, 16, 3.0, 2.0)
    net.set_normalizer(NormalizerStandardize().fit(x))
    path = tmp_path_factory.mktemp("norm") / "m.dl4py"
    net.save(path, save_updater=False)
    with zipfile.ZipFile(path) as zf:
        return {name: zf.read(name) for name in zf.namelist()}


def _rezip(entries: dict[str, bytes], **changes) -> bytes:
    out = dict(entries)
    for key, value in changes.items():
        name = key.replace("__", ".")
        if value is None:
            out.pop(name)
        else:
            out[name] = value
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for name, data in out.items():
            zf.writestr(name, data)
    return buffer.getvalue()


def _meta_without_flag(entries):
    meta = json.loads(entries["meta.json"])
    meta["has_normalizer"] = False
    return json.dumps(meta).encode()


CORRUPT = {
    "normalizer.json is not JSON": (dict(normalizer__json=b"{type: standardize"), "normalizer.json is not valid JSON"),
    "unknown kind": (dict(normalizer__json=b'{"type": "zscore"}'), "type must be one of"),
    "settings of another kind": (dict(normalizer__json=b'{"type": "standardize", "max_bits": 8}'), "settings"),
    "missing statistics": (dict(normalizer__safetensors=None), "entry normalizer.safetensors is missing"),
    "garbage statistics": (dict(normalizer__safetensors=b"\x07" * 40), "normalizer.safetensors is not a safetensors"),
    "NaN mean": (dict(normalizer__safetensors=st_save({"mean": torch.full((4,), float("nan"), dtype=torch.float64),
                                                        "std": torch.ones(4, dtype=torch.float64)})), "finite"),
    "zero std": (dict(normalizer__safetensors=st_save({"mean": torch.zeros(4, dtype=torch.float64),
                                                        "std": torch.zeros(4, dtype=torch.float64)})), "positive"),
    "lengths differ": (dict(normalizer__safetensors=st_save({"mean": torch.zeros(4, dtype=torch.float64),
                                                              "std": torch.ones(3, dtype=torch.float64)})), "4 values"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_a_corrupt_normalizer_entry_is_one_model_file_error(saved_entries, tmp_path, case):
    changes, needle = CORRUPT[case]
    path = tmp_path / "bad.dl4py"
    path.write_bytes(_rezip(saved_entries, **changes))
    with pytest.raises(ModelFileError) as caught:
        load(path, backend="cpu")
    message = str(caught.value)
    assert message.startswith(f"{path} is not a valid dl4py model: ") and needle in message
    assert "\n" not in message


def test_normalizer_entries_without_the_meta_flag_are_refused(saved_entries, tmp_path):
    path = tmp_path / "bad.dl4py"
    path.write_bytes(_rezip(saved_entries, meta__json=_meta_without_flag(saved_entries)))
    with pytest.raises(ModelFileError, match="normalizer.json is present but meta.json says has_normalizer is false"):
        load(path, backend="cpu")
    path.write_bytes(_rezip(saved_entries, normalizer__json=None, normalizer__safetensors=None))
    with pytest.raises(ModelFileError, match="entry normalizer.json is missing"):
        load(path, backend="cpu")


def test_a_corrupt_normalizer_is_one_line_from_the_command_line(saved_entries, tmp_path):
    path = tmp_path / "bad.dl4py"
    path.write_bytes(_rezip(saved_entries, normalizer__json=b'{"type": "zscore"}'))
    proc = subprocess.run([sys.executable, "-m", "dl4py", "evaluate", str(path)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"{path} is not a valid dl4py model: normalizer" in lines[0], proc.stderr
