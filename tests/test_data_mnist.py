"""MNIST: the real files, the folder search, verification and the download path.

Everything but the real-data tests runs on small synthetic IDX files; no test touches
the network (mirrors are local http.server or file:// URLs).
"""

import functools
import gzip
import hashlib
import http.server
import os
import shutil
import socket
import struct
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from dl4py.data import MnistDataSetIterator, load_mnist
from dl4py.data import mnist
from dl4py.errors import DataError

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
NAMES = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """No real cache folder, no DL4PY_DATA and no download unless a test asks for it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("DL4PY_DATA", raising=False)
    monkeypatch.setenv("DL4PY_MNIST_MIRRORS", "")
    return tmp_path / "xdg" / "dl4py" / "mnist"


@pytest.fixture
def real(monkeypatch):
    if not (SHARED_DATA / "mnist").is_dir():
        pytest.skip(f"real MNIST files not found at {SHARED_DATA / 'mnist'}")
    monkeypatch.setenv("DL4PY_DATA", str(SHARED_DATA))


# -- synthetic files ----------------------------------------------------------------


def _images(n, seed):
    pixels = np.random.default_rng(seed).integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
    return struct.pack(">IIII", 2051, n, 28, 28) + pixels.tobytes()


def _labels(values):
    return struct.pack(">II", 2049, len(values)) + bytes(values)


@pytest.fixture
def synth(monkeypatch):
    """Contents of the four files (12 train, 5 test examples); their checksums are expected."""
    files = {
        NAMES[0]: _images(12, 0),
        NAMES[1]: _labels([0, 1, 2] * 4),
        NAMES[2]: _images(5, 1),
        NAMES[3]: _labels([2, 2, 1, 0, 1]),
    }
    for name, data in files.items():
        monkeypatch.setitem(mnist.SHA256, name, hashlib.sha256(data).hexdigest())
    return files


def _write(folder, files, names=NAMES, gz=True):
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        if gz:
            (folder / f"{name}.gz").write_bytes(gzip.compress(files[name]))
        else:
            (folder / name).write_bytes(files[name])
    return folder


def _pixels(data):
    return torch.from_numpy(np.frombuffer(data, np.uint8, offset=16).copy()).reshape(-1, 28, 28)


# -- real data ------------------------------------------------------------------------


def test_real_mnist_train_and_test_sets(real):
    train = MnistDataSetIterator(128, train=True)
    test = MnistDataSetIterator(128, train=False, shuffle=False)
    assert train.total_examples() == 60000 and len(train) == 469
    assert test.total_examples() == 10000
    assert torch.bincount(train.labels, minlength=10).tolist() == TRAIN_COUNTS
    assert train.num_classes() == 10 and train.input_shape() == (784,)
    assert train.features.dtype == torch.float32 and train.features.shape == (60000, 784)
    assert float(train.features.min()) == 0.0 and float(train.features.max()) == 1.0
    batch = next(iter(test))
    assert batch.features.shape == (128, 784) and batch.labels.dtype == torch.int64
    images, labels = load_mnist(train=False)
    assert images.dtype == torch.uint8 and images.shape == (10000, 28, 28)
    assert labels.dtype == torch.int64 and labels.shape == (10000,)
    assert torch.equal(batch.features, images[:128].reshape(128, 784).float() / 255)
    assert torch.equal(batch.labels, labels[:128])


def test_real_limit_and_seeded_shuffle(real):
    a = MnistDataSetIterator(100, seed=123, limit=1000)
    b = MnistDataSetIterator(100, seed=123, limit=1000)
    assert a.total_examples() == 1000 and len(a) == 10
    _, labels = load_mnist(train=True)
    assert torch.equal(a.labels, labels[:1000])
    first_a, first_b = next(iter(a)), next(iter(b))
    assert torch.equal(first_a.features, first_b.features) and torch.equal(first_a.labels, first_b.labels)
    with pytest.raises(ValueError, match="limit=60001 exceeds the 60000"):
        MnistDataSetIterator(100, limit=60001)


def test_loads_are_cached_and_callers_get_independent_copies(real, monkeypatch):
    images, labels = load_mnist(train=False)
    it_a = MnistDataSetIterator(10, train=False)

    def no_reading(*args, **kwargs):
        raise AssertionError("file decompressed again despite the in-process cache")

    monkeypatch.setattr(mnist.gzip, "decompress", no_reading)
    images[:] = 0
    labels[:] = 0
    it_a.features.zero_()
    it_a.labels.zero_()
    again_images, again_labels = load_mnist(train=False)
    it_b = MnistDataSetIterator(10, train=False)
    assert int(again_images.max()) == 255 and torch.bincount(again_labels).min() > 0
    assert float(it_b.features.max()) == 1.0 and torch.bincount(it_b.labels).min() > 0


def test_real_train_images_parse_from_a_cold_cache(real):
    """Decompress, hash and parse with nothing cached in the process: the file's own pixels.
    How long that takes is a benchmark's to record (benchmarks/mnist_parse.py), not a test's."""
    mnist._read_idx.cache_clear()
    images, labels = load_mnist(train=True)
    assert images.shape == (60000, 28, 28) and images.dtype == torch.uint8
    in_file = _pixels(gzip.decompress((SHARED_DATA / "mnist" / f"{NAMES[0]}.gz").read_bytes()))
    assert torch.equal(images, in_file), "the parsed pixels are not the file's"
    assert torch.bincount(labels, minlength=10).tolist() == TRAIN_COUNTS


def test_real_checksum_table_catches_a_changed_byte(real, tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    shutil.copy(SHARED_DATA / "mnist" / "t10k-images-idx3-ubyte.gz", folder)
    data = bytearray(gzip.decompress((SHARED_DATA / "mnist" / "t10k-labels-idx1-ubyte.gz").read_bytes()))
    data[100] = (data[100] + 1) % 10  # still a valid digit: only the checksum can tell
    (folder / "t10k-labels-idx1-ubyte").write_bytes(bytes(data))
    expected = mnist.SHA256["t10k-labels-idx1-ubyte"]
    with pytest.raises(DataError, match=f"t10k-labels-idx1-ubyte: SHA-256 mismatch: expected {expected}, got"):
        load_mnist(train=False, data_dir=folder)


# -- locating -----------------------------------------------------------------------


def test_raw_and_gz_files_both_read(synth, tmp_path):
    folder = _write(tmp_path / "d", synth, names=[NAMES[0]], gz=False)
    _write(folder, synth, names=[NAMES[1]], gz=True)
    images, labels = load_mnist(train=True, data_dir=folder)
    assert torch.equal(images, _pixels(synth[NAMES[0]]))
    assert labels.tolist() == [0, 1, 2] * 4


def test_data_dir_comes_first_and_replaces_dl4py_data(synth, tmp_path, monkeypatch):
    good = _write(tmp_path / "good", synth)
    env = tmp_path / "env"
    (env / "mnist").mkdir(parents=True)
    for name in NAMES:
        (env / "mnist" / name).write_bytes(b"garbage")  # would fail if it were read
    monkeypatch.setenv("DL4PY_DATA", str(env))
    assert load_mnist(train=True, data_dir=good)[1].tolist() == [0, 1, 2] * 4
    _write(env / "mnist", synth)
    for name in NAMES:
        (env / "mnist" / name).unlink()
    with pytest.raises(DataError, match="not found") as info:
        load_mnist(train=True, data_dir=tmp_path / "empty")
    assert str(tmp_path / "empty") in str(info.value) and str(env) not in str(info.value)


def test_dl4py_data_before_cache_and_per_file_fallback(synth, tmp_path, monkeypatch, isolated):
    _write(tmp_path / "env" / "mnist", synth, names=NAMES[:1])  # train images only
    isolated.mkdir(parents=True)
    (isolated / NAMES[0]).write_bytes(b"garbage")  # shadowed by DL4PY_DATA: never read
    _write(isolated, synth, names=NAMES[1:2])  # train labels only in the cache
    monkeypatch.setenv("DL4PY_DATA", str(tmp_path / "env"))
    images, labels = load_mnist(train=True)
    assert torch.equal(images, _pixels(synth[NAMES[0]])) and labels.tolist() == [0, 1, 2] * 4


def test_cache_folder_defaults_to_home_cache(synth, tmp_path, monkeypatch):
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    folder = _write(tmp_path / "home" / ".cache" / "dl4py" / "mnist", synth, names=NAMES[2:])
    assert mnist._cache_dir() == folder
    assert load_mnist(train=False)[1].tolist() == [2, 2, 1, 0, 1]


def test_iterator_on_synthetic_files(synth, tmp_path):
    folder = _write(tmp_path / "d", synth)
    it = MnistDataSetIterator(5, train=True, shuffle=False, data_dir=folder)
    assert it.num_classes() == 10  # although only digits 0..2 occur
    assert len(it) == 3 and it.total_examples() == 12
    assert torch.equal(it.features, _pixels(synth[NAMES[0]]).reshape(12, 784).float() / 255)
    with pytest.raises(ValueError, match="limit=13 exceeds the 12"):
        MnistDataSetIterator(5, data_dir=folder, limit=13)


# -- verification -------------------------------------------------------------------


def _truncated(data):
    return data[:-100]


def _trailing(data):
    return data + b"\0"


def _wrong_magic(data):
    return struct.pack(">I", 2049) + data[4:]


def _changed_pixel(data):
    return data[:500] + bytes([data[500] ^ 0xFF]) + data[501:]


@pytest.mark.parametrize(
    "corrupt, gz, pattern",
    [
        (_truncated, False, r"truncated: expected 9424 bytes for dims \(12, 28, 28\), got 9324"),
        (_trailing, True, r"\(uncompressed\): trailing bytes: expected 9424 bytes .* got 9425"),
        (_wrong_magic, False, "not an IDX images file: magic number 2049, expected 2051"),
        (_changed_pixel, True, "SHA-256 mismatch: expected [0-9a-f]{64}, got [0-9a-f]{64}"),
    ],
)
def test_corrupt_images_file_is_an_error_naming_file_and_fix(synth, tmp_path, corrupt, gz, pattern):
    folder = _write(tmp_path / "d", synth, names=NAMES[1:2])
    name = NAMES[0] + (".gz" if gz else "")
    data = corrupt(synth[NAMES[0]])
    (folder / name).write_bytes(gzip.compress(data) if gz else data)
    with pytest.raises(DataError, match=pattern) as info:
        load_mnist(train=True, data_dir=folder)
    assert str(folder / name) in str(info.value) and "Delete it" in str(info.value)


@pytest.mark.parametrize("cut", ["garbage", "truncated"])
def test_bad_gzip_stream_is_an_error(synth, tmp_path, cut):
    folder = _write(tmp_path / "d", synth, names=NAMES[2:])
    stream = gzip.compress(synth[NAMES[3]])
    bad = b"this is not gzip" if cut == "garbage" else stream[: len(stream) // 2]
    (folder / f"{NAMES[3]}.gz").write_bytes(bad)
    with pytest.raises(DataError, match=f"{NAMES[3]}.gz: not a valid gzip stream .*Delete it"):
        load_mnist(train=False, data_dir=folder)


def test_a_file_replaced_after_caching_is_read_again(synth, tmp_path):
    folder = _write(tmp_path / "d", synth, gz=False)
    assert load_mnist(train=False, data_dir=folder)[1].tolist() == [2, 2, 1, 0, 1]
    path = folder / NAMES[3]
    stat = path.stat()
    path.write_bytes(_labels([2, 2, 1, 0, 9]))  # same size, different bytes
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(DataError, match="SHA-256 mismatch"):
        load_mnist(train=False, data_dir=folder)


def test_image_and_label_counts_must_agree(synth, tmp_path, monkeypatch):
    short = _labels([0, 1, 2])
    monkeypatch.setitem(mnist.SHA256, NAMES[1], hashlib.sha256(short).hexdigest())
    folder = _write(tmp_path / "d", dict(synth, **{NAMES[1]: short}))
    with pytest.raises(DataError, match="12 images but 3 labels"):
        load_mnist(train=True, data_dir=folder)


# -- downloading ----------------------------------------------------------------------


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def http_mirror(tmp_path):
    """A local HTTP server over tmp_path/'mirror'; yields (folder, base URL)."""
    folder = tmp_path / "mirror"
    folder.mkdir()
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield folder, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def _closed_port_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/"


def test_download_from_the_first_working_mirror_into_the_cache(synth, http_mirror, monkeypatch, isolated):
    folder, url = http_mirror
    _write(folder, synth)
    monkeypatch.setenv("DL4PY_MNIST_MIRRORS", f"{_closed_port_url()}, {url}")
    images, labels = load_mnist(train=True)
    assert torch.equal(images, _pixels(synth[NAMES[0]])) and labels.tolist() == [0, 1, 2] * 4
    assert sorted(p.name for p in isolated.iterdir()) == [f"{NAMES[0]}.gz", f"{NAMES[1]}.gz"]
    (folder / f"{NAMES[0]}.gz").unlink()  # now served from the cache, not the mirror
    assert load_mnist(train=True)[1].tolist() == [0, 1, 2] * 4


def test_download_from_a_file_url(synth, tmp_path, monkeypatch, isolated):
    _write(tmp_path / "m", synth, names=NAMES[2:])
    monkeypatch.setenv("DL4PY_MNIST_MIRRORS", (tmp_path / "m").as_uri())
    assert load_mnist(train=False)[1].tolist() == [2, 2, 1, 0, 1]
    assert (isolated / f"{NAMES[2]}.gz").is_file()


def test_a_bad_download_never_lands_under_the_real_name(synth, http_mirror, monkeypatch, isolated):
    folder, url = http_mirror
    _write(folder, dict(synth, **{NAMES[2]: _changed_pixel(synth[NAMES[2]])}), names=NAMES[2:])
    monkeypatch.setenv("DL4PY_MNIST_MIRRORS", url)
    with pytest.raises(DataError, match="(?s)failed verification.*SHA-256 mismatch") as info:
        load_mnist(train=False)
    assert f"{url}/{NAMES[2]}.gz" in str(info.value)
    assert list(isolated.iterdir()) == []  # no half file, no temporary left behind


def test_missing_everywhere_lists_folders_errors_and_what_to_do(tmp_path, monkeypatch, isolated):
    monkeypatch.setenv("DL4PY_DATA", str(tmp_path / "env"))
    mirrors = [(tmp_path / "m1").as_uri(), _closed_port_url()]
    monkeypatch.setenv("DL4PY_MNIST_MIRRORS", ",".join(mirrors))
    with pytest.raises(DataError) as info:
        MnistDataSetIterator(10)
    message = str(info.value)
    assert f"{NAMES[0]} (raw or .gz) not found" in message
    assert str(tmp_path / "env" / "mnist") in message and str(isolated) in message
    assert f"{mirrors[0]}/{NAMES[0]}.gz" in message and f"{mirrors[1]}{NAMES[0]}.gz" in message
    assert "$DL4PY_DATA/mnist" in message


def test_default_mirrors_and_request_timeout(monkeypatch):
    monkeypatch.delenv("DL4PY_MNIST_MIRRORS")
    assert mnist._mirrors() == [
        "https://ossci-datasets.s3.amazonaws.com/mnist/",
        "https://storage.googleapis.com/cvdf-datasets/mnist/",
        "http://yann.lecun.com/exdb/mnist/",
    ]
    timeouts = []

    def fake_urlopen(url, timeout=None):  # stands in for the network
        timeouts.append(timeout)
        raise OSError("offline")

    monkeypatch.setattr(mnist.urllib.request, "urlopen", fake_urlopen)
    with pytest.raises(DataError, match="offline"):
        load_mnist(train=False)
    assert timeouts == [30, 30, 30]
