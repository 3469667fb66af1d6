"""MNIST: find, verify, download and parse the IDX files; DL4J's MnistDataSetIterator.

Each file is looked up, raw or ``.gz``, in the first folder of: ``data_dir`` (when
given) or ``$DL4PY_DATA/mnist``, then the cache ``$XDG_CACHE_HOME/dl4py/mnist``
(default ``~/.cache/dl4py/mnist``). A file found nowhere is downloaded into the cache
from the mirrors (``$DL4PY_MNIST_MIRRORS``, comma-separated, overrides them). Every
file is checked against its SHA-256 before use: a bad file is an error, never data.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import http.client
import os
import shutil
import struct
import tempfile
import urllib.request
import zlib
from pathlib import Path

import numpy as np
import torch

from dl4py.config.run import MNIST_EXAMPLES
from dl4py.data.iterators import ArrayDataSetIterator, _positive_int
from dl4py.errors import DataError, DataSizeError

__all__ = ["MnistDataSetIterator", "load_mnist"]

# SHA-256 of the uncompressed files: recompressed .gz files differ, their content must not.
SHA256 = {
    "train-images-idx3-ubyte": "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
    "train-labels-idx1-ubyte": "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
    "t10k-images-idx3-ubyte": "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
    "t10k-labels-idx1-ubyte": "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
}
_MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
    "http://yann.lecun.com/exdb/mnist/",
)
# Examples per split of the files above (their SHA-256 fixes them): config/run.py holds the
# numbers, as it checks a config's limits against them before anything is read.
EXAMPLES = MNIST_EXAMPLES
_TIMEOUT_S = 30
_IMAGES_MAGIC, _LABELS_MAGIC = 2051, 2049  # 0x0803: uint8, 3 dims; 0x0801: uint8, 1 dim
_FIX = "Delete it and run again to re-download it, or replace it with a good copy"


def load_mnist(train: bool, data_dir=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Images ``uint8 [n, 28, 28]`` and labels ``int64 [n]``; fresh tensors on each call."""
    images, labels = _load_arrays(train, data_dir)
    return torch.from_numpy(images.copy()), torch.from_numpy(labels.astype(np.int64))


class MnistDataSetIterator(ArrayDataSetIterator):
    """MNIST as DL4J serves it: features ``float32 [b, 784]`` = pixel / 255, labels ``int64 [b]``.

    >>> it = MnistDataSetIterator(batch_size=64, train=True, seed=123)  # doctest: +SKIP
    >>> len(it), it.num_classes(), it.input_shape()                      # doctest: +SKIP
    (938, 10, (784,))
    """

    def __init__(
        self,
        batch_size: int,
        train: bool = True,
        seed: int = 123,
        shuffle: bool = True,
        limit: int | None = None,
        data_dir=None,
        drop_last: bool = False,
    ):
        images, labels = _load_arrays(train, data_dir)
        n = len(labels)
        k = n if limit is None else _positive_int(limit, "limit")
        if k > n:
            raise DataSizeError(k, n, f"MNIST {'training' if train else 'test'} set")
        # Scale only the kept rows. The cached arrays are read-only and these are new
        # copies, so no iterator can change another's data.
        features = torch.from_numpy(images[:k].reshape(k, 28 * 28).astype(np.float32)).div_(255)
        targets = torch.from_numpy(labels[:k].astype(np.int64))
        super().__init__(
            features, targets, batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last,
            limit=limit, num_classes=10,
        )
        self.train = bool(train)
        self._data_dir = data_dir

    def __reduce__(self):
        # Sent to another process (a parallel worker) as its constructor arguments, so
        # the worker reads MNIST from disk itself instead of receiving 188 MB of tensors.
        args = (self.batch_size, self.train, self.seed, self.shuffle, self.limit, self._data_dir, self.drop_last)
        return (MnistDataSetIterator, args, {"_next_epoch": self._next_epoch})


def _load_arrays(train: bool, data_dir) -> tuple[np.ndarray, np.ndarray]:
    prefix = "train" if train else "t10k"
    images = _read_file(f"{prefix}-images-idx3-ubyte", data_dir)
    labels = _read_file(f"{prefix}-labels-idx1-ubyte", data_dir)
    if images.shape[1:] != (28, 28):
        raise DataError(f"MNIST {prefix} images are {images.shape[1:]}, expected 28x28")
    if len(images) != len(labels):
        raise DataError(f"MNIST {prefix}: {len(images)} images but {len(labels)} labels")
    return images, labels


def _read_file(name: str, data_dir) -> np.ndarray:
    path = _locate(name, data_dir) or _download(name, data_dir)
    stat = path.stat()
    gz = path.name.endswith(".gz")
    return _read_idx(str(path.resolve()), gz, _magic(name), SHA256.get(name), stat.st_mtime_ns, stat.st_size)


def _magic(name: str) -> int:
    return _IMAGES_MAGIC if "-images-" in name else _LABELS_MAGIC


# -- locating ---------------------------------------------------------------------


def search_dirs(data_dir) -> list[Path]:
    """Where MNIST is looked for, in order: ``data_dir`` (else ``$DL4PY_DATA/mnist``), then the cache."""
    first = Path(data_dir) if data_dir is not None else None
    if first is None and os.environ.get("DL4PY_DATA"):
        first = Path(os.environ["DL4PY_DATA"]) / "mnist"
    return ([first] if first is not None else []) + [_cache_dir()]


def _cache_dir() -> Path:
    # XDG says a relative (or empty) XDG_CACHE_HOME is to be ignored.
    base = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(base) if os.path.isabs(base) else Path.home() / ".cache"
    return root / "dl4py" / "mnist"


def _locate(name: str, data_dir) -> Path | None:
    for folder in search_dirs(data_dir):
        for candidate in (folder / name, folder / f"{name}.gz"):
            if candidate.is_file():
                return candidate
    return None


# -- reading and verifying ----------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _read_idx(
    path: str, gz: bool, magic: int, sha256: str | None, mtime_ns: int = 0, size: int = 0
) -> np.ndarray:
    """Parse and verify one IDX file, as a read-only array.

    ``mtime_ns`` and ``size`` are unused except as cache keys: a replaced file is re-read.
    """
    raw = Path(path).read_bytes()
    if gz:
        try:
            data = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise DataError(f"{path}: not a valid gzip stream ({e}). {_FIX}.") from None
    else:
        data = raw
    where = f"{path} (uncompressed)" if gz else path
    array = _parse_idx(data, where, magic)
    if sha256 is not None:
        got = hashlib.sha256(data).hexdigest()
        if got != sha256:
            raise DataError(f"{where}: SHA-256 mismatch: expected {sha256}, got {got}. {_FIX}.")
    return array


def _parse_idx(data: bytes, where: str, magic: int) -> np.ndarray:
    if len(data) < 4:
        raise DataError(f"{where}: truncated: {len(data)} bytes, too short for an IDX header. {_FIX}.")
    got = int.from_bytes(data[:4], "big")
    if got != magic:
        kind = "images" if magic == _IMAGES_MAGIC else "labels"
        raise DataError(
            f"{where}: not an IDX {kind} file: magic number {got}, expected {magic}. {_FIX}."
        )
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DataError(f"{where}: truncated: {len(data)} bytes, the header alone needs {header}. {_FIX}.")
    dims = struct.unpack(f">{ndim}I", data[4:header])
    expected = header + int(np.prod(dims))
    if len(data) != expected:
        problem = "truncated" if len(data) < expected else "trailing bytes"
        raise DataError(
            f"{where}: {problem}: expected {expected} bytes for dims {dims}, got {len(data)}. {_FIX}."
        )
    # frombuffer over immutable bytes gives a read-only array: cached data stays intact.
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


# -- downloading ------------------------------------------------------------------


def _mirrors() -> list[str]:
    env = os.environ.get("DL4PY_MNIST_MIRRORS")
    if env is None:
        return list(_MIRRORS)
    return [m.strip() for m in env.split(",") if m.strip()]


def _download(name: str, data_dir) -> Path:
    """Fetch ``name.gz`` into the cache folder, verified before it gets its real name."""
    folder = _cache_dir()
    target = folder / f"{name}.gz"
    errors = []
    for base in _mirrors():
        url = base if base.endswith("/") else base + "/"
        url += f"{name}.gz"
        tmp = None
        try:
            folder.mkdir(parents=True, exist_ok=True)
            # Same folder as the target, so os.replace is an atomic rename.
            part = tempfile.NamedTemporaryFile(dir=folder, prefix=f".{name}.", suffix=".part", delete=False)
            tmp = Path(part.name)
            with part as f:
                with urllib.request.urlopen(url, timeout=_TIMEOUT_S) as response:
                    shutil.copyfileobj(response, f, length=1 << 20)
            try:
                _read_idx.__wrapped__(str(tmp), True, _magic(name), SHA256.get(name))
            except DataError as e:
                raise DataError(f"the downloaded file failed verification: {e}") from None
            os.replace(tmp, target)
            return target
        except (OSError, ValueError, http.client.HTTPException, DataError) as e:
            errors.append(f"  {url}: {e}")
        finally:
            if tmp is not None and tmp.exists():
                tmp.unlink()
    searched = "\n".join(f"  {d}" for d in search_dirs(data_dir))
    where = data_dir if data_dir is not None else "$DL4PY_DATA/mnist (or pass data_dir=)"
    tried = "\n".join(errors) if errors else "  (no mirrors: DL4PY_MNIST_MIRRORS is empty)"
    raise DataError(
        f"MNIST file {name} (raw or .gz) not found. Searched:\n{searched}\n"
        f"Download failed:\n{tried}\n"
        f"Put the MNIST files (raw or .gz) in {where} or in {folder}."
    )
