"""DL4J's ``normalizer.bin`` (``NormalizerSerializer``) read and written, and mapped onto dl4py's
normalizers both ways.

The layout (big-endian, Java's ``DataOutputStream``), from ``NormalizerSerializer.writeHeader``
and the strategies' ``write``:

- header: ``writeUTF("NORMALIZER")``, ``writeInt(1)`` (the version), ``writeUTF(type)``, one of
  ``NormalizerType``'s names; a ``CUSTOM`` type is followed by ``writeUTF(strategy class)``;
- ``STANDARDIZE`` (``StandardizeSerializerStrategy``): ``writeBoolean(fitLabel)``, the mean and
  the std as ND4J arrays (``Nd4j.write``), then the labels' mean and std when fitLabel;
- ``MIN_MAX`` (``MinMaxSerializerStrategy``): ``writeBoolean(fitLabel)``, ``writeDouble(targetMin)``,
  ``writeDouble(targetMax)``, the min and the max arrays, then the labels' when fitLabel;
- ``IMAGE_MIN_MAX`` (``ImagePreProcessingSerializerStrategy``): ``writeDouble`` of minRange,
  maxRange and maxPixelVal, nothing else.

The multi-input normalizers (``MULTI_*``), ``IMAGE_VGG16`` and ``CUSTOM`` ones are refused by
name: dl4py has no counterpart, and a custom strategy is a Java class. ``write_normalizer``
writes its arrays in the current ND4J header, so a file DL4J 1.0.0-beta or later wrote is written
again byte for byte.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dl4py.data.normalizers import (EPS, ImagePreProcessingScaler, Normalizer, NormalizerMinMaxScaler,
                                    NormalizerStandardize, normalizer_from_state)
from dl4py.dl4j.ndarray import DL4JFileError, source_bytes, write_array
# The ND4J array reader that stops where an array ends (read_array wants the array alone);
# private to this package, shared rather than parsed twice.
from dl4py.dl4j.ndarray import _read as _read_nd4j_array
from dl4py.dl4j.ndarray import _Reader

HEADER, VERSION = "NORMALIZER", 1
STANDARDIZE, MIN_MAX, IMAGE_MIN_MAX = "STANDARDIZE", "MIN_MAX", "IMAGE_MIN_MAX"
# The array names of each type, in file order: features first, then the labels' when fitLabel.
ARRAYS = {STANDARDIZE: ("mean", "std", "label_mean", "label_std"), MIN_MAX: ("min", "max", "label_min", "label_max"),
          IMAGE_MIN_MAX: ()}
_REFUSED = {
    "IMAGE_VGG16": "VGG16ImagePreProcessor", "MULTI_STANDARDIZE": "MultiNormalizerStandardize",
    "MULTI_MIN_MAX": "MultiNormalizerMinMaxScaler", "MULTI_HYBRID": "MultiNormalizerHybrid",
}
_JAVA_CLASS = {STANDARDIZE: "NormalizerStandardize", MIN_MAX: "NormalizerMinMaxScaler",
               IMAGE_MIN_MAX: "ImagePreProcessingScaler"}


@dataclass
class NormalizerRecord:
    """What a ``normalizer.bin`` holds, as DL4J wrote it: the type, ``fit_labels``, the target
    range (``MIN_MAX``: targetMin/targetMax; ``IMAGE_MIN_MAX``: minRange/maxRange), the image
    scaler's ``max_pixel_value``, and the arrays by the names of ``ARRAYS``, as read."""

    kind: str
    fit_labels: bool = False
    min_range: float = 0.0
    max_range: float = 1.0
    max_pixel_value: float = 255.0
    arrays: dict = field(default_factory=dict)


def read_normalizer(source, name: str | None = None) -> NormalizerRecord:
    """The normalizer in ``source`` (a path, bytes, or a binary file object); ``name`` says where
    the bytes came from in an error. Anything but a whole, known normalizer is one DL4JFileError."""
    data, name = source_bytes(source, name, "normalizer.bin")
    reader = _Reader(data, name)
    kind = _read_header(reader)
    record = NormalizerRecord(kind)
    if kind == IMAGE_MIN_MAX:
        ranges_and_pixel = _doubles(reader, 3, "minRange, maxRange, maxPixelVal")
        record.min_range, record.max_range, record.max_pixel_value = ranges_and_pixel
    else:
        record.fit_labels = _boolean(reader)
        if kind == MIN_MAX:
            record.min_range, record.max_range = _doubles(reader, 2, "targetMin, targetMax")
        names = ARRAYS[kind] if record.fit_labels else ARRAYS[kind][:2]
        record.arrays = {array_name: _read_nd4j_array(reader) for array_name in names}
    if reader.left:
        raise DL4JFileError(name, f"{reader.left} bytes follow the {_JAVA_CLASS[kind]}")
    return record


def write_normalizer(record: NormalizerRecord, target=None) -> bytes | None:
    """Write ``record`` as ``NormalizerSerializer`` does, to ``target`` (a path or a binary file
    object); with no target, return the bytes."""
    if record.kind not in ARRAYS:
        raise ValueError(f"write_normalizer: kind must be one of {', '.join(ARRAYS)}, got {record.kind!r}")
    parts = [_java_utf(HEADER), struct.pack(">i", VERSION), _java_utf(record.kind)]
    if record.kind == IMAGE_MIN_MAX:
        parts.append(struct.pack(">3d", record.min_range, record.max_range, record.max_pixel_value))
    else:
        parts.append(struct.pack(">?", record.fit_labels))
        if record.kind == MIN_MAX:
            parts.append(struct.pack(">2d", record.min_range, record.max_range))
        names = ARRAYS[record.kind] if record.fit_labels else ARRAYS[record.kind][:2]
        missing = [array_name for array_name in names if array_name not in record.arrays]
        if missing:
            raise ValueError(f"write_normalizer: {record.kind} needs arrays {list(names)}, missing {missing}")
        parts.extend(write_array(record.arrays[array_name]) for array_name in names)
    data = b"".join(parts)
    if target is None:
        return data
    if isinstance(target, (str, Path)):
        Path(target).write_bytes(data)
    else:
        target.write(data)
    return None


def normalizer_from_dl4j(record: NormalizerRecord, where: str = "normalizer.bin") -> Normalizer:
    """dl4py's normalizer that transforms features as DL4J's does, with DL4J's own guards applied
    first (a std below 1e-5 raised to it; a min-max range below 1e-5 widened by raising the max,
    the target max at least the target min + 1e-5). What dl4py cannot hold is one DL4JFileError."""
    java = _JAVA_CLASS.get(record.kind, record.kind)
    if record.fit_labels:
        raise DL4JFileError(where, f"the {java} also normalizes labels (fitLabel=true), which dl4py's "
                                   "normalizers do not; the model's outputs would be in normalized units")
    # The guards run in the statistics' own precision, as DL4J runs them on the arrays it read.
    try:
        if record.kind == STANDARDIZE:
            mean, std = (_vector(record.arrays[n]) for n in ("mean", "std"))
            std = np.maximum(std, std.dtype.type(EPS))  # DistributionStats' constructor
            return normalizer_from_state({"type": "standardize"}, {"mean": _wide(mean), "std": _wide(std)})
        if record.kind == MIN_MAX:
            low, high = (_vector(record.arrays[n]) for n in ("min", "max"))
            if low.shape == high.shape:  # MinMaxStats' constructor pads the max
                high = high + (np.maximum(high - low, high.dtype.type(EPS)) - (high - low))
            settings = {"type": "minmax", "min_range": record.min_range,
                        "max_range": max(record.max_range, record.min_range + EPS)}  # MinMaxStrategy's
            return normalizer_from_state(settings, {"min": _wide(low), "max": _wide(high)})
        if record.kind == IMAGE_MIN_MAX:
            return normalizer_from_state({"type": "image_scaler", "min_range": record.min_range,
                                          "max_range": record.max_range, "max_bits": _bits(record.max_pixel_value)},
                                         {})
    except (KeyError, ValueError) as exc:
        raise DL4JFileError(where, f"{java}: {exc}") from None
    raise DL4JFileError(where, f"normalizer type {record.kind!r} is not one dl4py reads ({', '.join(ARRAYS)})")


def normalizer_to_dl4j(normalizer: Normalizer) -> NormalizerRecord:
    """The record DL4J would write for ``normalizer``. The statistics go as FLOAT when every value
    is a float32 (as DL4J computes them, and as one imported from DL4J came), else as DOUBLE: never
    a lost bit. Vectors are rank 1, as DL4J 1.0's reductions give them."""
    if isinstance(normalizer, ImagePreProcessingScaler):
        return NormalizerRecord(IMAGE_MIN_MAX, min_range=normalizer.min_range, max_range=normalizer.max_range,
                                max_pixel_value=normalizer.max_pixel_value)
    if not isinstance(normalizer, (NormalizerStandardize, NormalizerMinMaxScaler)):
        raise TypeError(f"normalizer_to_dl4j: DL4J has no normalizer for {type(normalizer).__name__}")
    if not normalizer.is_fitted:
        raise ValueError(f"normalizer_to_dl4j: the {type(normalizer).__name__} is not fitted")
    if isinstance(normalizer, NormalizerStandardize):
        mean, std = _stored(normalizer.mean, normalizer.std)
        return NormalizerRecord(STANDARDIZE, arrays={"mean": mean, "std": std})
    low, high = _stored(normalizer.min, normalizer.max)
    return NormalizerRecord(MIN_MAX, min_range=normalizer.min_range, max_range=normalizer.max_range,
                            arrays={"min": low, "max": high})


def load_normalizer(source, name: str | None = None) -> Normalizer:
    """``normalizer.bin`` straight to dl4py's normalizer."""
    record = read_normalizer(source, name)
    return normalizer_from_dl4j(record, name or (str(source) if isinstance(source, (str, Path)) else "normalizer.bin"))


# ---- pieces ------------------------------------------------------------------------------

def _read_header(reader: _Reader) -> str:
    header = reader.utf("the header")
    if header != HEADER:
        raise DL4JFileError(reader.name, f"starts with {header[:40]!r}, not {HEADER!r} "
                                         "(not a NormalizerSerializer file)")
    (version,) = struct.unpack(">i", reader.take(4, "the version"))
    if version != VERSION:
        raise DL4JFileError(reader.name, f"is version {version}; NormalizerSerializer writes only version {VERSION}")
    kind = reader.utf("the normalizer type")
    if kind == "CUSTOM":
        strategy = reader.utf("the custom strategy class")
        raise DL4JFileError(reader.name, f"holds a CUSTOM normalizer (strategy class {strategy}), a Java class "
                                         "dl4py does not run")
    if kind in _REFUSED:
        raise DL4JFileError(reader.name, f"holds a {_REFUSED[kind]} ({kind}), which dl4py has no counterpart for "
                                         f"(it reads {', '.join(_JAVA_CLASS.values())})")
    if kind not in ARRAYS:
        raise DL4JFileError(reader.name, f"normalizer type {kind[:40]!r} is not one of DL4J's NormalizerType names")
    return kind


def _boolean(reader: _Reader) -> bool:
    (byte,) = reader.take(1, "fitLabel")
    if byte not in (0, 1):
        raise DL4JFileError(reader.name, f"fitLabel is the byte {byte}, not 0 or 1 (a damaged file)")
    return bool(byte)


def _doubles(reader: _Reader, count: int, what: str) -> tuple[float, ...]:
    return struct.unpack(f">{count}d", reader.take(8 * count, what))


def _java_utf(text: str) -> bytes:
    """Java's ``writeUTF`` for the ASCII names written here (modified UTF-8 equals UTF-8 there)."""
    encoded = text.encode("utf-8")
    return struct.pack(">H", len(encoded)) + encoded


def _vector(array) -> np.ndarray:
    """A row of per-feature statistics ([n] or DL4J's older [1, n]), flat, in its floating type."""
    array = np.asarray(array)
    if array.ndim > 2 or (array.ndim == 2 and array.shape[0] != 1):
        raise ValueError(f"statistics shaped {list(array.shape)}, not a row of per-feature values")
    return array.reshape(-1) if array.dtype.kind == "f" else array.reshape(-1).astype(np.float64)


def _wide(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(values.astype(np.float64))


def _bits(max_pixel_value: float) -> int:
    """``maxBits`` with ``2**maxBits - 1 == maxPixelVal``: all dl4py's image scaler holds."""
    bits = round(math.log2(max_pixel_value + 1)) if math.isfinite(max_pixel_value) and max_pixel_value > 0 else 0
    if not 1 <= bits <= 32 or 2.0**bits - 1 != max_pixel_value:
        raise ValueError(f"maxPixelVal {max_pixel_value!r} is not 2**bits - 1 for 1 to 32 bits, all dl4py's "
                         "ImagePreProcessingScaler holds")
    return bits


def _stored(*stats: torch.Tensor) -> list[np.ndarray]:
    """The statistics as one ND4J type: FLOAT if that keeps every bit of all of them, else DOUBLE."""
    values = [stat.detach().cpu().numpy().astype(np.float64).reshape(-1) for stat in stats]
    single = [v.astype(np.float32) for v in values]
    exact = all(np.array_equal(s.astype(np.float64), v) for s, v in zip(single, values))
    return single if exact else values
