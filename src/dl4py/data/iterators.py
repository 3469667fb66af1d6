"""The iterator protocol the trainer consumes, and the in-memory iterator.

An iterator yields one epoch of `DataSet` batches per ``__iter__``. The shuffle order
of epoch ``e`` is a pure function of ``(seed, e)``, so a run stopped mid-way, or one
shard of it in another process, can replay exactly the same batches.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from dl4py.data.dataset import DataSet
from dl4py.errors import DataError, DataSizeError

__all__ = ["DataSetIterator", "ArrayDataSetIterator"]


class DataSetIterator:
    """Base of every dl4py iterator (DL4J's ``DataSetIterator``).

    Subclasses implement ``__iter__``, ``__len__``, ``total_examples``, ``num_classes``
    and ``input_shape``; the epoch counter lives here. Each ``__iter__`` takes the next
    epoch number (0, 1, 2, ...) unless ``set_epoch`` chose it.
    """

    batch_size: int
    _next_epoch = 0  # a class default, so subclasses need not call super().__init__()
    # Whether reading a batch may draw from numpy's or python's global generators, which the
    # trainer then seeds for each batch as it does torch's (train/randomness.py). Assumed of
    # an iterator dl4py does not know; dl4py's own draw from generators of their own.
    draws_from_global_generators = True

    def __iter__(self) -> Iterator[DataSet]:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def total_examples(self) -> int:
        raise NotImplementedError

    def num_classes(self) -> int | None:
        raise NotImplementedError

    def input_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def max_label(self) -> tuple[int, int] | None:
        """The largest class label and its example's index, found when the data was loaded,
        so a model checks every label against its output layer once, before training.
        None: regression targets, or an iterator that cannot tell without reading its batches
        (the trainer then checks the first batch only)."""
        return None

    def locate(self, index: int) -> str:
        """Where example ``index`` comes from, for messages (a CSV names its file and line)."""
        return f"example {index}"

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``__iter__`` use the order of ``epoch``; later ones continue from it."""
        self._next_epoch = _non_negative_int(epoch, "epoch")

    def replay_refusal(self) -> str | None:
        """Why an epoch of this iterator, read again, may not give the same batches in the same
        order (a resumed epoch reads its first batches again and skips them); None when it does."""
        return None

    def reset(self) -> None:
        """DL4J's name for "start over". Every ``__iter__`` already starts at the first
        batch, so this only exists for code written against DL4J; the epoch counter is
        left alone (DL4J's ``reset`` also reshuffles), use ``set_epoch`` to replay one."""

    def _take_epoch(self) -> int:
        epoch = self._next_epoch
        self._next_epoch += 1
        return epoch


class WrappedIterator(DataSetIterator):
    """An iterator over another's batches (moved to a device, say): sizes, classes, shape
    and the epoch counter are the wrapped iterator's, so both give the same order."""

    def __init__(self, iterator):
        self.iterator = iterator
        self.batch_size = getattr(iterator, "batch_size", None)

    def __len__(self) -> int:
        return len(self.iterator)

    def total_examples(self) -> int:
        return self.iterator.total_examples()

    def num_classes(self) -> int | None:
        return self.iterator.num_classes()

    def input_shape(self) -> tuple[int, ...]:
        return self.iterator.input_shape()

    def max_label(self) -> tuple[int, int] | None:
        inner = getattr(self.iterator, "max_label", None)  # user iterators may predate it
        return inner() if inner is not None else None

    def locate(self, index: int) -> str:
        inner = getattr(self.iterator, "locate", None)
        return inner(index) if inner is not None else f"example {index}"

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.iterator, "set_epoch"):
            self.iterator.set_epoch(epoch)

    @property
    def draws_from_global_generators(self) -> bool:
        return getattr(self.iterator, "draws_from_global_generators", True)

    def replay_refusal(self) -> str | None:
        inner = getattr(self.iterator, "replay_refusal", None)
        return inner() if inner is not None else None

    def _take_epoch(self) -> int:
        return self.iterator._take_epoch()


class ArrayDataSetIterator(DataSetIterator):
    """Batches over features and labels held in memory.

    ``features``: ``[n, ...]`` tensor or numpy array, converted once to float32.
    ``labels``: ``[n]`` integer class indices (-> int64) or ``[n, k]`` float targets
    (-> float32); for sequences ``[n, time, size]``, per-step labels too: ``[n, time]`` class
    indices or ``[n, time, k]`` targets (an ``rnn_output`` layer's). ``num_classes`` defaults to
    ``max(label) + 1`` for class indices.

    >>> it = ArrayDataSetIterator(np.zeros((10, 3)), np.arange(10) % 2, batch_size=4)
    >>> [b.num_examples() for b in it]
    [4, 4, 2]
    """

    _source = ""  # what the data is, for messages ("" for arrays; a CSV names its file)

    def __init__(
        self,
        features,
        labels,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        limit: int | None = None,
        *,
        num_classes: int | None = None,
    ):
        self.batch_size = _positive_int(batch_size, "batch_size")
        self.seed = _int(seed, "seed")
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.limit = None if limit is None else _positive_int(limit, "limit")

        features = _as_tensor(features, "features")
        labels = _as_tensor(labels, "labels")
        if features.is_complex():
            raise DataError(f"features must be real numbers, got dtype {features.dtype}")
        if features.dim() < 2:
            raise DataError(
                f"features must be [n, ...] with at least 2 dimensions, got shape {tuple(features.shape)}; "
                "for one value per example use features.reshape(-1, 1)"
            )
        n = features.shape[0]
        if labels.shape[0] != n:
            raise DataError(f"features has {n} rows but labels has {labels.shape[0]}; they must match")
        if n == 0:
            raise DataError("features and labels are empty (0 rows)")
        if self.limit is not None:
            if self.limit > n:
                raise DataSizeError(self.limit, n, self._source)
            # Limit before converting: the dtype copy then only touches kept rows.
            features, labels = features[: self.limit], labels[: self.limit]
            n = self.limit
        if self.drop_last and n < self.batch_size:
            raise ValueError(
                f"drop_last=True with batch_size={self.batch_size} and only {n} examples leaves no batch"
            )

        self.labels, self._num_classes, self._max_label = _prepare_labels(labels, num_classes, features)
        self.features = features.to(torch.float32).contiguous()
        self._n = n

    # -- protocol ---------------------------------------------------------------

    def __len__(self) -> int:
        full, rest = divmod(self._n, self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def total_examples(self) -> int:
        """Examples yielded per epoch: all of them, less the partial batch under drop_last."""
        return self._n - self._n % self.batch_size if self.drop_last else self._n

    def num_classes(self) -> int | None:
        return self._num_classes

    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.features.shape[1:])

    def max_label(self) -> tuple[int, int] | None:
        return self._max_label

    def __iter__(self) -> Iterator[DataSet]:
        # The epoch is taken now, not at the first next(), so iter() order is what counts.
        epoch = self._take_epoch()
        bs, stop = self.batch_size, self.total_examples()
        if not self.shuffle:
            return (self._batch(slice(i, min(i + bs, stop))) for i in range(0, stop, bs))
        order = self.epoch_order(epoch).to(self.features.device)
        return (self._batch(order[i : i + bs]) for i in range(0, stop, bs))

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """Example indices in the order epoch ``epoch`` visits them (a pure function of seed, epoch)."""
        if not self.shuffle:
            return torch.arange(self._n)
        generator = torch.Generator().manual_seed(self.seed + _non_negative_int(epoch, "epoch"))
        return torch.randperm(self._n, generator=generator)

    @property
    def draws_from_global_generators(self) -> bool:
        # Its shuffle has a generator of its own; a subclass that makes its batches its own way may draw.
        return type(self)._batch is not ArrayDataSetIterator._batch

    def _batch(self, indices: slice | torch.Tensor) -> DataSet:
        # The only per-batch work: a view for slices, one gather per tensor otherwise.
        if isinstance(indices, slice):
            return DataSet(self.features[indices], self.labels[indices])
        return DataSet(self.features.index_select(0, indices), self.labels.index_select(0, indices))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(n={self._n}, batch_size={self.batch_size}, shuffle={self.shuffle}, "
            f"seed={self.seed}, drop_last={self.drop_last})"
        )


def _prepare_labels(labels: torch.Tensor, num_classes: int | None, features: torch.Tensor):
    """-> (labels, num_classes, (largest label, its row) or None for float targets)."""
    is_integer = not (labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool)
    if per_step_labels(labels, features):  # [n, time] or [n, time, k]: one per sequence step
        if not is_integer:
            return labels.to(torch.float32).contiguous(), None, None
        return _per_step_classes(labels.to(torch.int64).contiguous(), num_classes)
    if labels.dim() == 1 and is_integer:
        labels = labels.to(torch.int64).contiguous()
        # Every label is looked at here, once: the model then compares one number with its
        # output layer instead of checking each batch (a device sync per step).
        low, top_row = int(labels.min()), int(labels.argmax())
        high = int(labels[top_row])
        if low < 0:
            row = int((labels < 0).nonzero()[0])
            raise DataError(f"labels must be class indices >= 0, got {low} (row {row})")
        if num_classes is None:
            return labels, high + 1, (high, top_row)
        num_classes = _positive_int(num_classes, "num_classes")
        if high >= num_classes:
            row = int((labels >= num_classes).nonzero()[0])
            raise DataError(f"labels must be < num_classes={num_classes}, got {high} (row {row})")
        return labels, num_classes, (high, top_row)
    if labels.dim() in (2, 4) and labels.is_floating_point():  # [n, k] targets; [n, c, h, w]: a cnn_loss layer's
        if num_classes is not None:
            raise ValueError(f"num_classes applies to class-index labels only; these are {labels.dim()}-D float targets")
        return labels.to(torch.float32).contiguous(), None, None
    hint = ""
    if labels.dim() == 1 and labels.is_floating_point():
        hint = "; for a regression target use labels.reshape(-1, 1), for classes convert to an integer dtype"
    elif labels.dim() == 2:
        hint = ("; for one-hot labels pass labels.argmax(1), for regression convert to float (per-step labels "
                "[n, time] go with sequence features [n, time, size] of the same length)")
    elif labels.dim() == 4:
        hint = "; a cnn_loss layer takes float targets [n, channels, height, width] (one-hot for mcxent)"
    raise DataError(
        f"labels must be 1-D integer class indices or 2-D float targets, got shape "
        f"{tuple(labels.shape)} dtype {labels.dtype}{hint}"
    )


def _per_step_classes(labels: torch.Tensor, num_classes: int | None):
    """``_prepare_labels`` for class indices ``[n, time]``: errors name the row and the step."""
    flat, time = labels.reshape(-1), labels.shape[1]
    low, top = int(flat.min()), int(flat.argmax())
    high = int(flat[top])
    if low < 0:
        at = int((flat < 0).nonzero()[0])
        raise DataError(f"labels must be class indices >= 0, got {low} (row {at // time}, step {at % time})")
    if num_classes is not None:
        num_classes = _positive_int(num_classes, "num_classes")
        if high >= num_classes:
            at = int((flat >= num_classes).nonzero()[0])
            raise DataError(f"labels must be < num_classes={num_classes}, got {high} (row {at // time}, "
                            f"step {at % time})")
    return labels, high + 1 if num_classes is None else num_classes, (high, top // time)


def per_step_labels(labels: torch.Tensor, features: torch.Tensor) -> bool:
    """Whether ``labels`` are one per step of sequence ``features`` ``[n, time, size]``: class
    indices ``[n, time]`` or targets ``[n, time, k]``."""
    if features.dim() != 3 or labels.dim() not in (2, 3) or labels.shape[:2] != features.shape[:2]:
        return False
    integer = not (labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool)
    return labels.dim() == 2 if integer else labels.dim() == 3


def _as_tensor(value, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, np.ndarray):
        if value.dtype == object or not (
            np.issubdtype(value.dtype, np.number) or np.issubdtype(value.dtype, np.bool_)
        ):
            raise DataError(f"{name} must hold numbers, got numpy dtype {value.dtype}")
        if not value.flags.writeable:
            value = value.copy()  # torch cannot share read-only numpy memory
        return torch.from_numpy(np.ascontiguousarray(value))
    raise TypeError(f"{name} must be a torch.Tensor or numpy.ndarray, got {type(value).__name__}")


def _int(value, name: str) -> int:
    # bool is an int subclass; True as a batch size is surely a mistake.
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {value!r}")
    return int(value)


def _positive_int(value, name: str) -> int:
    if _int(value, name) <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _non_negative_int(value, name: str) -> int:
    if _int(value, name) < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return int(value)
