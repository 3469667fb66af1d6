"""Normalizers (DL4J's ``NormalizerStandardize``, ``NormalizerMinMaxScaler``,
``ImagePreProcessingScaler``): statistics fitted on the training data, applied to every
input the model sees afterwards.

``fit`` reads the training batches once (a streaming source need not fit in memory), in
float64. Statistics are per feature: per column of ``[n, features]`` data, per channel
(dimension 1) of ``[n, channels, ...]`` data -- DL4J's ``tailor2d``. A model holds its
normalizer (``model.set_normalizer``), applies it on its device to the raw features of
``fit``, ``evaluate``, ``score`` and ``output``, and saves it inside its model file, so the
iterators stay raw and a loaded model normalizes exactly as the trained one did.

>>> norm = NormalizerStandardize().fit(train)        # one pass over the training batches
>>> model.set_normalizer(norm).fit(train, epochs=2)  # saved with the model from now on
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from dl4py.config.run import NormalizerSection
from dl4py.data.adapters import as_iterator
from dl4py.errors import DataError

__all__ = [
    "Normalizer",
    "NormalizerStandardize",
    "NormalizerMinMaxScaler",
    "ImagePreProcessingScaler",
    "normalizer_from_state",
]

# DL4J's Nd4j.EPS_THRESHOLD: a constant feature's std (or max - min) is raised to it, so it
# maps to 0 (or to the range's low end) instead of dividing by zero.
EPS = 1e-5


class Normalizer:
    """Base of the normalizers: ``fit(data)`` once, then ``transform(features)``."""

    type_name = ""
    _stat_names: tuple[str, ...] = ()  # the fitted float64 tensors, as saved

    def __init__(self):
        self._on_device: dict = {}  # (device, dtype, rank) -> stats shaped to broadcast there

    # -- fitting ------------------------------------------------------------------

    def fit(self, data) -> "Normalizer":
        """Fit on ``data``: a features array, or anything ``fit`` trains on (a DataSetIterator,
        one pass; a DataSet; an ``(x, y)`` pair; a DataFrame with ``label``-free columns ...)."""
        accumulator = self._accumulator()
        for features in _feature_batches(data):
            accumulator.add(_rows(features))
        if accumulator.count == 0:
            raise DataError(f"{type(self).__name__}.fit: the data has no examples")
        self._set_stats(accumulator)
        return self

    @property
    def is_fitted(self) -> bool:
        return all(getattr(self, name, None) is not None for name in self._stat_names)

    # -- applying -----------------------------------------------------------------

    def transform(self, features: torch.Tensor) -> torch.Tensor:
        """Normalized copy of ``features`` (``[n, ...]``, on any device); never in place,
        since the batch may be the iterator's own memory."""
        if not features.is_floating_point():
            features = features.to(torch.float32)
        center, divisor, offset = self._affine(features)
        # (x - center) / divisor rather than x * scale + shift: no cancellation when the
        # mean is large against the spread (pixels around 100, std 2).
        return (features - center) / divisor + offset

    def revert(self, features: torch.Tensor) -> torch.Tensor:
        """The inverse of ``transform`` (DL4J's ``revertFeatures``)."""
        center, divisor, offset = self._affine(features)
        return (features - offset) * divisor + center

    def _affine(self, features: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(center, divisor, offset) with ``transform(x) = (x - center) / divisor + offset``,
        shaped and placed for ``features``; cached per device, dtype and rank."""
        if not self.is_fitted:
            raise DataError(f"{type(self).__name__} is not fitted: call fit(training_data) first")
        key = (features.device, features.dtype, features.dim())
        cached = self._on_device.get(key)
        if cached is None:
            parts = self._center_divisor_offset()  # float64 on the CPU, one value per feature
            width = max(t.numel() for t in parts)
            if width > 1:
                self._check_width(features, width)
            shape = _broadcast_shape(features.dim(), width)
            cached = tuple(t.expand(width).reshape(shape).to(features.device, features.dtype) for t in parts)
            self._on_device[key] = cached
        return cached

    def _check_width(self, features: torch.Tensor, width: int) -> None:
        if features.dim() < 2 or features.shape[1] != width:
            what = "features (columns)" if features.dim() == 2 else "channels (dimension 1)"
            raise DataError(
                f"{type(self).__name__} was fitted on data with {width} features per example, but these "
                f"features have shape {list(features.shape)}; expected {width} {what}"
            )

    # -- saving -------------------------------------------------------------------

    def settings(self) -> dict[str, Any]:
        """Kind and options, JSON-ready: ``{"type": "minmax", "min_range": 0.0, "max_range": 1.0}``."""
        return {"type": self.type_name, **self._settings()}

    def state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """(settings, float64 statistics) as the model file stores them."""
        return self.settings(), {
            name: getattr(self, name).contiguous() for name in self._stat_names
        }

    def __getstate__(self):  # pickled with a model: device copies stay behind
        return {**self.__dict__, "_on_device": {}}

    def __repr__(self) -> str:
        settings = ", ".join(f"{k}={v!r}" for k, v in self._settings().items())
        return f"{type(self).__name__}({settings}{'' if self.is_fitted else ', unfitted'})"

    # -- subclass hooks -------------------------------------------------------------

    def _settings(self) -> dict[str, Any]:
        return {}

    def _accumulator(self):
        raise NotImplementedError

    def _set_stats(self, accumulator) -> None:
        raise NotImplementedError

    def _center_divisor_offset(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError


@NormalizerSection.builds  # what a run config's data.normalizer section builds, by type name
class NormalizerStandardize(Normalizer):
    """Zero mean, unit variance per feature: ``(x - mean) / std``, with the population std
    (DL4J's ``var(false)``) raised to at least 1e-5."""

    type_name = "standardize"
    _stat_names = ("mean", "std")

    def __init__(self, mean=None, std=None):
        super().__init__()
        self.mean = self.std = None
        if (mean is None) != (std is None):
            raise ValueError("NormalizerStandardize: give both mean and std, or neither (then fit)")
        if mean is not None:
            self.mean, self.std = _stats_pair(mean, std, "mean", "std")
            self.std = self.std.clamp(min=EPS)

    def _accumulator(self):
        return _MeanVariance()

    def _set_stats(self, acc) -> None:
        self.mean = acc.mean
        self.std = (acc.m2 / acc.count).sqrt().clamp(min=EPS)
        self._on_device = {}

    def _center_divisor_offset(self):
        return self.mean, self.std, _scalar(0.0)


@NormalizerSection.builds
class NormalizerMinMaxScaler(Normalizer):
    """Each feature's training range mapped onto ``[min_range, max_range]`` (default [0, 1]):
    ``(x - min) / (max - min) * (max_range - min_range) + min_range``; a constant feature's
    max is raised to min + 1e-5, as DL4J's ``MinMaxStats`` does."""

    type_name = "minmax"
    _stat_names = ("min", "max")

    def __init__(self, min_range: float = 0.0, max_range: float = 1.0):
        super().__init__()
        self.min_range, self.max_range = _finite(min_range, "min_range"), _finite(max_range, "max_range")
        if self.max_range <= self.min_range:
            raise ValueError(f"max_range must be above min_range, got [{min_range}, {max_range}]")
        self.min = self.max = None

    def _settings(self):
        return {"min_range": self.min_range, "max_range": self.max_range}

    def _accumulator(self):
        return _MinMax()

    def _set_stats(self, acc) -> None:
        self.min, self.max = acc.low, torch.maximum(acc.high, acc.low + EPS)
        self._on_device = {}

    def _center_divisor_offset(self):
        return self.min, (self.max - self.min) / (self.max_range - self.min_range), _scalar(self.min_range)


@NormalizerSection.builds
class ImagePreProcessingScaler(Normalizer):
    """Pixel values ``[0, 2**max_bits - 1]`` mapped onto ``[min_range, max_range]`` (default
    8 bits onto [0, 1]): ``x / (2**max_bits - 1) * (max_range - min_range) + min_range``.
    Nothing to fit; ``fit`` returns at once, reading no data (as DL4J's)."""

    type_name = "image_scaler"

    def __init__(self, min_range: float = 0.0, max_range: float = 1.0, max_bits: int = 8):
        super().__init__()
        self.min_range, self.max_range = _finite(min_range, "min_range"), _finite(max_range, "max_range")
        if isinstance(max_bits, bool) or not isinstance(max_bits, int) or not 1 <= max_bits <= 32:
            raise ValueError(f"max_bits must be an integer from 1 to 32, got {max_bits!r}")
        self.max_bits = max_bits

    @property
    def max_pixel_value(self) -> float:
        return float(2**self.max_bits - 1)

    def fit(self, data) -> "ImagePreProcessingScaler":
        return self

    def _settings(self):
        return {"min_range": self.min_range, "max_range": self.max_range, "max_bits": self.max_bits}

    def _center_divisor_offset(self):
        divisor = self.max_pixel_value / (self.max_range - self.min_range)
        return _scalar(0.0), _scalar(divisor), _scalar(self.min_range)


KINDS = {cls.type_name: cls for cls in (NormalizerStandardize, NormalizerMinMaxScaler, ImagePreProcessingScaler)}


def normalizer_from_state(settings: Any, stats: dict[str, torch.Tensor]) -> Normalizer:
    """Rebuild a saved normalizer; a ValueError says what is wrong (the file reader names the file)."""
    kind = settings.get("type") if isinstance(settings, dict) else None
    if not isinstance(kind, str) or kind not in KINDS:
        got = f"type {kind!r}" if isinstance(settings, dict) else f"{type(settings).__name__}, not an object"
        raise ValueError(f"type must be one of {', '.join(KINDS)}; got {got}")
    cls = KINDS[settings["type"]]
    options = {k: v for k, v in settings.items() if k != "type"}
    expected = set(cls()._settings())
    if set(options) != expected:
        raise ValueError(f"{cls.__name__} settings must be {sorted(expected) or 'none'}, got {sorted(options)}")
    try:
        normalizer = cls(**options)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{cls.__name__}: {exc}") from None
    if set(stats) != set(cls._stat_names):
        raise ValueError(f"{cls.__name__} needs tensors {list(cls._stat_names)}, the file has {sorted(stats)}")
    if cls._stat_names:
        first, second = _stats_pair(*(stats[name] for name in cls._stat_names), *cls._stat_names)
        if cls is NormalizerStandardize:
            if bool((second <= 0).any()):
                raise ValueError("std must be positive everywhere")
            normalizer.mean, normalizer.std = first, second
        else:
            if bool((second <= first).any()):
                raise ValueError("max must be above min for every feature")
            normalizer.min, normalizer.max = first, second
    return normalizer


# ---- statistics, one batch at a time, in float64 ------------------------------------------

class _MeanVariance:
    """Count, mean and sum of squared deviations (M2) per feature, merged batch by batch with
    Chan et al.'s parallel update: exact to rounding for any batch sizes, with no cancellation
    of a sum-of-squares formula."""

    def __init__(self):
        self.count, self.mean, self.m2 = 0, None, None

    def add(self, rows: torch.Tensor) -> None:
        n = rows.shape[0]
        if n == 0:
            return
        mean = rows.mean(0)
        m2 = ((rows - mean) ** 2).sum(0)
        if self.mean is None:
            self.count, self.mean, self.m2 = n, mean, m2
            return
        _same_width(self.mean, rows)
        total = self.count + n
        delta = mean - self.mean
        self.mean = self.mean + delta * (n / total)
        self.m2 = self.m2 + m2 + delta**2 * (self.count * n / total)
        self.count = total


class _MinMax:
    def __init__(self):
        self.count, self.low, self.high = 0, None, None

    def add(self, rows: torch.Tensor) -> None:
        if rows.shape[0] == 0:
            return
        low, high = rows.amin(0), rows.amax(0)
        if self.low is None:
            self.low, self.high = low, high
        else:
            _same_width(self.low, rows)
            self.low, self.high = torch.minimum(self.low, low), torch.maximum(self.high, high)
        self.count += rows.shape[0]


def _feature_batches(data):
    """The feature tensors of ``data``: one features array, or the batches of anything ``fit``
    trains on (a DataSetIterator, a DataSet, an ``(x, y)`` pair, a DataFrame, a DataLoader, ...);
    its labels are not read."""
    if isinstance(data, (torch.Tensor, np.ndarray)):
        yield torch.as_tensor(data)
        return
    try:
        iterator = as_iterator(data)  # not training: arrays are read in order
    except DataError as exc:
        raise DataError(f"normalizer fit: {exc}") from None
    for batch in iterator:
        yield batch.features


def _rows(features: torch.Tensor) -> torch.Tensor:
    """``[n, f]`` stays; ``[n, c, ...]`` -> ``[n * ..., c]`` (per-channel statistics); float64, CPU."""
    features = torch.as_tensor(features)
    if features.dim() < 2:
        raise DataError(f"normalizer: features must be [n, ...] with at least 2 dimensions, got {list(features.shape)}")
    features = features.detach().to("cpu", torch.float64)
    if features.dim() > 2:
        features = features.movedim(1, -1).reshape(-1, features.shape[1])
    return features


def _same_width(stat: torch.Tensor, rows: torch.Tensor) -> None:
    if rows.shape[1] != stat.shape[0]:
        raise DataError(f"normalizer: batches differ in width: {stat.shape[0]} features, then {rows.shape[1]}")


def _broadcast_shape(rank: int, width: int) -> tuple[int, ...]:
    """Statistics of ``width`` features shaped to broadcast over dimension 1 of a rank-``rank`` batch."""
    if width == 1:
        return (1,) * max(rank, 1)
    return (1, width) + (1,) * (rank - 2)


def _stats_pair(first, second, first_name: str, second_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    pair = []
    for value, name in ((first, first_name), (second, second_name)):
        tensor = torch.as_tensor(value).detach().to("cpu", torch.float64).reshape(-1).clone()
        if tensor.numel() == 0 or not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{name} must be a non-empty vector of finite numbers")
        pair.append(tensor)
    if pair[0].shape != pair[1].shape:
        raise ValueError(f"{first_name} has {pair[0].numel()} values but {second_name} has {pair[1].numel()}")
    return pair[0], pair[1]


def _scalar(value: float) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float64)


def _finite(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)
