"""ImageFolderIterator: a folder per class of PNG/JPEG files, trained on from a run config."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dl4py.config.run import DataConfig
from dl4py.data.images import ImageFolderIterator
from dl4py.errors import ConfigError, DataError

Image = pytest.importorskip("PIL.Image")

SIZE = 16
KINDS = ("disc", "hstripes", "vstripes")


def _draw(kind: str, rng, size: int = SIZE) -> np.ndarray:
    """A random-coloured disc, or horizontal or vertical stripes, under noise: easy for a
    small CNN, impossible by colour alone."""
    image = np.zeros((size, size, 3))
    yy, xx = np.mgrid[:size, :size]
    if kind == "disc":
        cy, cx, r = rng.uniform(5, size - 5), rng.uniform(5, size - 5), rng.uniform(3, 4.5)
        mask = (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r
    else:
        period, phase = int(rng.integers(3, 5)), int(rng.integers(0, 4))
        mask = ((yy if kind == "hstripes" else xx) + phase) % period == 0
    image[mask] = rng.uniform(0.4, 1.0, size=3)
    image += rng.normal(0, 0.08, image.shape)
    return (np.clip(image, 0, 1) * 255).astype(np.uint8)


def _make_folder(root: Path, per_class: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    for kind in KINDS:
        (root / kind).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(_draw(kind, rng)).save(root / kind / f"{i:03d}.png")
    return root


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("shapes")
    _make_folder(root / "train", 80, seed=1)
    _make_folder(root / "test", 30, seed=2)
    return root


def _config(shapes: Path, **data) -> dict:
    return {
        "network": {
            "seed": 1, "weight_init": "xavier", "updater": {"type": "adam", "learning_rate": 0.01},
            "input_type": {"type": "convolutional", "height": SIZE, "width": SIZE, "channels": 3},
            "layers": [
                {"type": "convolution", "kernel_size": [3, 3], "n_out": 8, "activation": "relu"},
                {"type": "subsampling", "pooling_type": "max", "kernel_size": [2, 2], "stride": [2, 2]},
                {"type": "dense", "n_out": 32, "activation": "relu"},
                {"type": "output", "n_out": 3, "activation": "softmax", "loss": "negativeloglikelihood"},
            ],
        },
        "data": {"dataset": "image_folder", "train_path": str(shapes / "train"),
                 "test_path": str(shapes / "test"), **data},
        "training": {"epochs": 6, "batch_size": 32, "backend": "cpu", "score_every": 0},
    }


def _train_cli(config: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    path = tmp_path / "run.json"
    path.write_text(json.dumps(config))
    return subprocess.run([sys.executable, "-m", "dl4py", "train", str(path), "--output", str(tmp_path / "run"),
                           "--no-progress"], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_an_image_folder_trains_from_a_run_config(shapes, tmp_path):
    config = _config(shapes, height=SIZE, width=SIZE, channels=3, random_crop=1, flip=True,
                     normalizer="image_scaler")
    proc = _train_cli(config, tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["test_accuracy"] > 0.8  # chance is 1/3
    assert result["test_examples"] == 90


@pytest.mark.slow
def test_a_corrupt_image_is_one_line_naming_the_file(shapes, tmp_path):
    train = tmp_path / "train"
    for kind in KINDS:
        (train / kind).mkdir(parents=True)
        for source in sorted((shapes / "train" / kind).iterdir())[:3]:
            (train / kind / source.name).write_bytes(source.read_bytes())
    good = (train / "hstripes" / "001.png").read_bytes()
    (train / "hstripes" / "001.png").write_bytes(good[: len(good) // 2])  # truncated mid-stream
    config = _config(shapes, train_path=str(train))
    proc = _train_cli(config, tmp_path)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "GPU backend unavailable" not in line]
    assert len(lines) == 1, proc.stderr
    assert str(train / "hstripes" / "001.png") in lines[0] and "not a readable image" in lines[0]

    (train / "hstripes" / "001.png").write_bytes(b"this is no PNG")  # not an image at all
    with pytest.raises(DataError, match=r"hstripes[/\\]001\.png: not a readable image"):
        ImageFolderIterator(train, 4, SIZE, SIZE, 3)


def test_labels_come_from_sorted_folder_names(tmp_path):
    # Created out of order; each class's images hold one grey level, so a batch shows its labels.
    for name, level in (("zebra", 200), ("apple", 10), ("mango", 120)):
        (tmp_path / "train" / name).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(np.full((5, 7), level, np.uint8)).save(tmp_path / "train" / name / f"{i}.png")
    it = ImageFolderIterator(tmp_path / "train", 4, height=5, width=7, channels=1, seed=3)
    assert it.labels == it.class_names == ["apple", "mango", "zebra"]
    assert (it.num_classes(), it.input_shape(), len(it), it.total_examples()) == (3, (1, 5, 7), 3, 9)
    assert it.max_label() == (2, 6)
    level_of = torch.tensor([10.0, 120.0, 200.0])
    for batch in it:
        assert batch.features.dtype == torch.float32 and batch.features.shape[1:] == (1, 5, 7)
        assert torch.equal(batch.features.mean(dim=(1, 2, 3)), level_of[batch.labels])

    # A test folder holding some of the classes is numbered as the training set is.
    (tmp_path / "test" / "zebra").mkdir(parents=True)
    Image.fromarray(np.full((5, 7), 200, np.uint8)).save(tmp_path / "test" / "zebra" / "0.png")
    test = ImageFolderIterator(tmp_path / "test", 4, 5, 7, 1, labels=it.labels)
    assert next(iter(test)).labels.tolist() == [2] and test.num_classes() == 3
    (tmp_path / "test" / "kiwi").mkdir()
    Image.fromarray(np.zeros((5, 7), np.uint8)).save(tmp_path / "test" / "kiwi" / "0.png")
    with pytest.raises(DataError, match="kiwi.*not one of the classes"):
        ImageFolderIterator(tmp_path / "test", 4, 5, 7, 1, labels=it.labels)


def test_crop_and_flip_are_deterministic_per_seed_and_epoch(shapes):
    def epoch(it, e):
        it.set_epoch(e)
        return [(b.features, b.labels) for b in it]

    def same(a, b):
        return all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))

    make = lambda **kw: ImageFolderIterator(shapes / "train", 50, SIZE, SIZE, 3, seed=7, **kw)  # noqa: E731
    first, second = make(random_crop=2, flip=True), make(random_crop=2, flip=True)
    assert same(epoch(first, 3), epoch(second, 3))  # a resumed run replays epoch 3 exactly
    assert not same(epoch(first, 3), epoch(first, 4))
    unshuffled = make(shuffle=False, random_crop=2, flip=True)  # so only the augmentation can differ
    assert not same(epoch(unshuffled, 3), epoch(unshuffled, 4))
    assert same(epoch(unshuffled, 4), epoch(make(shuffle=False, random_crop=2, flip=True), 4))
    other_seed = ImageFolderIterator(shapes / "train", 50, SIZE, SIZE, 3, seed=8, random_crop=2, flip=True)
    assert not same(epoch(first, 3), epoch(other_seed, 3))

    # Each augmented image is a window of the zero-padded original, mirrored when drawn so.
    plain = make(shuffle=False)
    augmented = make(shuffle=False, random_crop=2, flip=True)
    raw = torch.cat([b.features for b in plain])
    out = torch.cat([b.features for b in augmented])
    dy, dx, flips = augmented.augmentation(0)
    padded = torch.nn.functional.pad(raw, (2, 2, 2, 2))
    for i in range(raw.shape[0]):
        window = padded[i, :, dy[i] : dy[i] + SIZE, dx[i] : dx[i] + SIZE]
        assert torch.equal(out[i], window.flip(-1) if flips[i] else window)
    assert 0.3 < flips.float().mean() < 0.7 and dy.unique().numel() == 5


def test_images_beyond_the_memory_budget_are_decoded_per_batch(shapes):
    eager = ImageFolderIterator(shapes / "test", 16, 12, 10, 1, seed=2, flip=True)
    lazy = ImageFolderIterator(shapes / "test", 16, 12, 10, 1, seed=2, flip=True, memory_budget=0)
    assert eager.pixels is not None and lazy.pixels is None
    for a, b in zip(eager, lazy):
        assert torch.equal(a.features, b.features) and torch.equal(a.labels, b.labels)
    assert a.features.shape[1:] == (1, 12, 10)  # resized and made grey


def test_without_pillow_the_error_names_the_extra(shapes, monkeypatch):
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(DataError, match=r'pip install "dl4py\[data\]"'):
        ImageFolderIterator(shapes / "train", 8, SIZE, SIZE, 3)


def test_folder_mistakes_are_errors_naming_the_folder(tmp_path):
    with pytest.raises(DataError, match="no such directory"):
        ImageFolderIterator(tmp_path / "missing", 8, 4, 4)
    with pytest.raises(DataError, match="no class folders"):
        ImageFolderIterator(tmp_path, 8, 4, 4)
    (tmp_path / "cats").mkdir()
    (tmp_path / "cats" / "notes.txt").write_text("no images here")
    with pytest.raises(DataError, match=r"cats: class folder holds no images"):
        ImageFolderIterator(tmp_path, 8, 4, 4)


@pytest.mark.parametrize("data, key", [
    ({"dataset": "image_folder"}, "data.train_path"),
    ({"dataset": "image_folder", "train_path": "x", "channels": 2}, "data.channels"),
    ({"dataset": "image_folder", "train_path": "x", "random_crop": -1}, "data.random_crop"),
    ({"dataset": "image_folder", "train_path": "x", "limit_train": 5}, "data.limit_train"),
    ({"dataset": "mnist", "flip": True}, "data.flip"),
    ({"dataset": "csv", "train_path": "x", "height": 4}, "data.height"),
])
def test_image_keys_are_checked_by_name(data, key):
    with pytest.raises(ConfigError, match=rf"^{key}: "):
        DataConfig.from_dict(data, "data")
