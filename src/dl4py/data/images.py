"""ImageFolderIterator: a folder per class of PNG/JPEG images (DL4J's ``ImageRecordReader``
with a ``ParentPathLabelGenerator``).

``ROOT/CLASS/IMAGE.png``: each image is resized to ``height x width`` with ``channels``
channels (1 grey, 3 RGB, 4 RGBA) and labelled by its folder, classes numbered in sorted
folder order. Batches are float32 ``[n, channels, height, width]`` holding raw pixel values
(0-255): scaling belongs to a normalizer (``ImagePreProcessingScaler``), which the model
applies on its device. Pillow decodes the files; it is the optional extra ``dl4py[data]``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from dl4py.data.dataset import DataSet
from dl4py.data.iterators import DataSetIterator, _int, _non_negative_int, _positive_int
from dl4py.errors import DataError

__all__ = ["ImageFolderIterator", "read_image"]

EXTENSIONS = (".png", ".jpg", ".jpeg")
# Decoded pixels (uint8) up to this size are decoded once, when the iterator is made; a
# larger set is decoded batch by batch, every epoch (slower, but it need not fit in memory).
DEFAULT_MEMORY_BUDGET = 2**30
_MODES = {1: "L", 3: "RGB", 4: "RGBA"}
_AUGMENT_STREAM = 0xA46  # keeps the augmentation draws apart from the shuffle's (seed + epoch)


def read_image(path, height: int, width: int, channels: int) -> np.ndarray:
    """One image file -> uint8 ``[channels, height, width]``; a DataError naming the file
    when it cannot be decoded, or when it has more pixels than Pillow's limit."""
    image_module = _pillow()
    try:
        with warnings.catch_warnings():
            # Between its limit and twice it Pillow only warns, and would then decode it all.
            warnings.simplefilter("error", image_module.DecompressionBombWarning)
            with image_module.open(path) as image:
                image = image.convert(_MODES[channels])  # decodes the whole file: truncation shows here
                if image.size != (width, height):
                    image = image.resize((width, height), image_module.BILINEAR)
                pixels = np.asarray(image, dtype=np.uint8)
    except (image_module.DecompressionBombError, image_module.DecompressionBombWarning):
        raise DataError(_too_many_pixels(image_module, path)) from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:  # Pillow's errors for bad data
        raise DataError(f"{path}: not a readable image ({type(exc).__name__}: {exc})") from None
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    return pixels.transpose(2, 0, 1).copy()  # contiguous, and writable (Pillow's may be read-only)


def _too_many_pixels(image_module, path) -> str:
    size = _header_size(image_module, path)
    shown = f"{size[0]}x{size[1]} = {size[0] * size[1]:,} pixels" if size else "too many pixels"
    return (f"{path}: {shown}, over Pillow's limit of {image_module.MAX_IMAGE_PIXELS:,} for one image "
            "(its guard against decompression bombs); shrink the file, or if you trust it raise "
            "PIL.Image.MAX_IMAGE_PIXELS before reading (None turns the guard off)")


def _header_size(image_module, path) -> tuple[int, int] | None:
    """(width, height) from the file's header, read by its format's own opener, which unlike
    ``Image.open`` applies no size guard (nothing is decoded); None if that fails."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(16)
            for name in image_module.ID:
                factory, accept = image_module.OPEN[name]
                accepted = accept(prefix) if accept is not None else True
                if accepted and not isinstance(accepted, str):  # a str is Pillow's "no, because ..."
                    f.seek(0)
                    return factory(f, str(path)).size
    except Exception:  # only a detail of the message is lost
        return None
    return None


def _pillow():
    try:
        from PIL import Image  # optional: PIL (extra data)
    except ImportError:
        raise DataError('reading image folders needs Pillow: pip install "dl4py[data]"') from None
    return Image


class ImageFolderIterator(DataSetIterator):
    """Batches of the images under ``root``, one folder per class.

    ``labels``: the class names to number by (the training set's, for a test set whose
    folders may be fewer); default: the sorted folder names. ``random_crop=N`` pads each
    image by N pixels (zeros) and takes a random ``height x width`` window from it;
    ``flip`` mirrors half the images left-right. Both are drawn per example from
    ``(seed, epoch)``, so a resumed run replays them; use them on training data only.

    >>> train = ImageFolderIterator("shapes/train", 32, height=20, width=20, channels=3, flip=True)
    >>> train.labels, train.input_shape()
    (['circle', 'square', 'stripes'], (3, 20, 20))
    """

    def __init__(
        self,
        root,
        batch_size: int,
        height: int,
        width: int,
        channels: int = 3,
        *,
        shuffle: bool = True,
        seed: int = 0,
        random_crop: int = 0,
        flip: bool = False,
        labels: Sequence[str] | None = None,
        memory_budget: int = DEFAULT_MEMORY_BUDGET,
    ):
        self.batch_size = _positive_int(batch_size, "batch_size")
        self.height, self.width = _positive_int(height, "height"), _positive_int(width, "width")
        self.channels = _int(channels, "channels")
        if self.channels not in _MODES:
            raise ValueError(f"channels must be 1 (grey), 3 (RGB) or 4 (RGBA), got {channels!r}")
        self.shuffle, self.seed, self.flip = bool(shuffle), _int(seed, "seed"), bool(flip)
        self.random_crop = _non_negative_int(random_crop, "random_crop")
        self.root = Path(root)
        _pillow()  # the missing extra is named before any folder is listed
        self.files, targets, self.class_names = _list_images(self.root, labels)
        self.targets = torch.tensor(targets, dtype=torch.int64)
        top = int(self.targets.argmax())
        self._max_label = (int(self.targets[top]), top)
        self._n = len(self.files)
        nbytes = self._n * self.channels * self.height * self.width
        # uint8 [n, C, H, W], or None: decoded per batch
        self.pixels = self._decode_all() if nbytes <= memory_budget else None

    @property
    def labels(self) -> list[str]:
        """The class names, label i being ``labels[i]`` (DL4J's ``getLabels()``)."""
        return self.class_names

    # -- protocol ---------------------------------------------------------------

    def __len__(self) -> int:
        return -(-self._n // self.batch_size)

    def total_examples(self) -> int:
        return self._n

    def num_classes(self) -> int:
        return len(self.class_names)

    def input_shape(self) -> tuple[int, ...]:
        return (self.channels, self.height, self.width)

    def max_label(self) -> tuple[int, int]:
        return self._max_label

    def locate(self, index: int) -> str:
        return str(self.files[index])

    def __iter__(self) -> Iterator[DataSet]:
        epoch = self._take_epoch()  # now, not at the first next(): iter() order is what counts
        order = self.epoch_order(epoch)
        augment = self.augmentation(epoch)
        bs = self.batch_size
        return (self._batch(order[i : i + bs], augment) for i in range(0, self._n, bs))

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """Example indices in the order epoch ``epoch`` visits them (as ArrayDataSetIterator's)."""
        if not self.shuffle:
            return torch.arange(self._n)
        generator = torch.Generator().manual_seed(self.seed + _non_negative_int(epoch, "epoch"))
        return torch.randperm(self._n, generator=generator)

    def augmentation(self, epoch: int):
        """Per-example (row shift, column shift, flip) of epoch ``epoch``, indexed by example,
        a pure function of (seed, epoch); None when neither crop nor flip is asked for."""
        if not self.random_crop and not self.flip:
            return None
        rng = np.random.default_rng([self.seed % 2**64, _non_negative_int(epoch, "epoch"), _AUGMENT_STREAM])
        span = 2 * self.random_crop + 1
        shifts = torch.from_numpy(rng.integers(0, span, size=(2, self._n)))
        flips = torch.from_numpy(rng.random(self._n) < 0.5) if self.flip else torch.zeros(self._n, dtype=torch.bool)
        return shifts[0], shifts[1], flips

    # -- batches ----------------------------------------------------------------

    def _batch(self, rows: torch.Tensor, augment) -> DataSet:
        if self.pixels is not None:
            pixels = self.pixels.index_select(0, rows)
        else:
            pixels = torch.from_numpy(np.stack([self._read(int(i)) for i in rows]))
        if augment is not None:
            pixels = self._augment(pixels, *(part.index_select(0, rows) for part in augment))
        return DataSet(pixels.to(torch.float32), self.targets.index_select(0, rows))

    def _augment(self, pixels: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, flips: torch.Tensor):
        pad = self.random_crop
        if pad:
            padded = torch.nn.functional.pad(pixels, (pad, pad, pad, pad))
            # One gather: row r of example b is padded row dy[b] + r (and so for columns).
            rows = (dy[:, None] + torch.arange(self.height))[:, None, :, None]
            cols = (dx[:, None] + torch.arange(self.width))[:, None, None, :]
            batch = torch.arange(pixels.shape[0])[:, None, None, None]
            channel = torch.arange(self.channels)[None, :, None, None]
            pixels = padded[batch, channel, rows, cols]
        if flips.any():
            pixels = torch.where(flips[:, None, None, None], pixels.flip(-1), pixels)
        return pixels

    def _read(self, index: int) -> np.ndarray:
        return read_image(self.files[index], self.height, self.width, self.channels)

    def _decode_all(self) -> torch.Tensor:
        pixels = torch.empty((self._n, self.channels, self.height, self.width), dtype=torch.uint8)
        for index in range(self._n):
            pixels[index] = torch.from_numpy(self._read(index))
        return pixels

    def __repr__(self) -> str:
        return (
            f"ImageFolderIterator({str(self.root)!r}, n={self._n}, classes={len(self.class_names)}, "
            f"batch_size={self.batch_size}, shape={self.input_shape()}, shuffle={self.shuffle}, "
            f"seed={self.seed}, random_crop={self.random_crop}, flip={self.flip}, "
            f"in_memory={self.pixels is not None})"
        )


def _list_images(root: Path, labels: Sequence[str] | None) -> tuple[list[Path], list[int], list[str]]:
    """-> (image files, their class indices, class names); classes in sorted folder order."""
    if not root.is_dir():
        raise DataError(f"{root}: {'not a directory' if root.exists() else 'no such directory'}")
    try:
        folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError as exc:
        raise DataError(f"{root}: cannot list the folder: {exc.strerror or exc}") from None
    if not folders:
        raise DataError(f"{root}: no class folders; images go in ROOT/CLASS_NAME/IMAGE.png")
    names = [p.name for p in folders] if labels is None else [str(name) for name in labels]
    if len(set(names)) != len(names) or not names:
        raise DataError(f"labels must be distinct class names, got {list(names)}")
    number = {name: i for i, name in enumerate(names)}
    files, targets = [], []
    for folder in folders:
        if folder.name not in number:
            raise DataError(f"{folder}: class {folder.name!r} is not one of the classes {names}")
        images = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in EXTENSIONS)
        if not images:
            raise DataError(f"{folder}: class folder holds no images ({', '.join(EXTENSIONS)})")
        files += images
        targets += [number[folder.name]] * len(images)
    return files, targets, names
