"""Iterators over batches someone else makes: a torch DataLoader, or any iterable of
``(features, labels)`` batches (a list, a generator, a function returning a fresh one).

Their length may be unknown until one pass has been made (an iterable Dataset, a
generator): ``batches_per_epoch()`` then says None and ``len()`` raises
`UnknownLengthError`, a DataError that is also the TypeError ``len()`` callers expect.
Training needs no length; `ProgressBar` draws without one.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from torch.utils.data.dataloader import _InfiniteConstantSampler

from dl4py.data.columns import dict_arrays
from dl4py.data.dataset import DataSet
from dl4py.data.iterators import DataSetIterator, per_step_labels
from dl4py.errors import DataError

__all__ = ["BatchStreamIterator", "LoaderIterator", "BatchesIterator", "UnknownLengthError", "to_dataset"]


class UnknownLengthError(DataError, TypeError):
    """An iterator cannot tell how many batches an epoch has before it has made one pass."""


class BatchStreamIterator(DataSetIterator):
    """What a stream of batches knows: counts learned from its last full pass, the input
    shape from its first batch. Subclasses implement ``_epoch_batches(epoch)``."""

    batch_size = None
    label = features = None  # column names for dict batches
    _known_batches = _known_examples = None
    _input_shape = None

    def batches_per_epoch(self) -> int | None:
        """Batches in one epoch, or None while unknown (before a full pass of a stream)."""
        return self._known_batches

    def __len__(self) -> int:
        n = self.batches_per_epoch()
        if n is None:
            raise UnknownLengthError(
                f"{self!r} does not know how many batches an epoch has before one full pass; "
                "fit() and ProgressBar(batches_per_epoch=None) work without it"
            )
        return n

    def total_examples(self) -> int:
        if self._known_examples is None:
            raise UnknownLengthError(f"{self!r} does not know how many examples it holds before one full pass")
        return self._known_examples

    def num_classes(self) -> int | None:
        return None  # not known without reading every label; the model checks each first batch

    def input_shape(self) -> tuple[int, ...]:
        if self._input_shape is None:
            self._input_shape = tuple(self._peek().features.shape[1:])
        return self._input_shape

    def _peek(self) -> DataSet:
        raise DataError(f"{self!r}: the input shape is unknown before the first batch")

    def __iter__(self) -> Iterator[DataSet]:
        # The epoch is taken now, not at the first next(), as ArrayDataSetIterator does.
        return self._counted(self._epoch_batches(self._take_epoch()))

    def _counted(self, batches) -> Iterator[DataSet]:
        count = examples = 0
        for raw in batches:
            batch = to_dataset(raw, repr(self), self.label, self.features)
            if self._input_shape is None:
                self._input_shape = tuple(batch.features.shape[1:])
            count += 1
            examples += batch.features.shape[0]
            yield batch
        self._known_batches, self._known_examples = count, examples  # reached only after a full pass

    def _epoch_batches(self, epoch: int):
        raise NotImplementedError


class LoaderIterator(BatchStreamIterator):
    """A torch ``DataLoader``'s batches as DataSets, in the loader's own order.

    Each epoch calls ``set_epoch(epoch)`` on the loader's sampler and dataset where they
    have one (``DistributedSampler``, a dl4py table dataset), and reseeds ``generator``
    (the one dl4py gave a Dataset it batches itself) with ``seed + epoch``, the order an
    ArrayDataSetIterator with the same seed visits. A generator of the user's (the loader's,
    a sampler's) gets ``s + epoch``, ``s`` the seed it had when dl4py first read it, as a
    DistributedSampler reseeds itself: an epoch's order then depends on its number alone,
    and an epoch read again (resumed part-way) is read in the same order. A sampler without
    a generator draws from torch's, which the trainer seeds (``train/randomness.py``)."""

    def __init__(self, loader, generator: torch.Generator | None = None, seed: int = 0,
                 label=None, features=None):
        self.loader, self.generator, self.seed = loader, generator, seed
        self.label, self.features = label, features
        self.batch_size = loader.batch_size
        try:
            self._known_batches = len(loader)
        except TypeError:  # an iterable Dataset without __len__: learned after one pass
            pass
        try:
            n = len(loader.dataset)
            if loader.batch_size is not None and getattr(loader, "drop_last", False):
                n -= n % loader.batch_size
            self._known_examples = n
        except TypeError:
            pass

    def _epoch_batches(self, epoch: int):
        if self.generator is not None:
            self.generator.manual_seed(self.seed + epoch)
        for generator in self._users_generators():
            _reseed(generator, epoch)
        for part in (self.loader.sampler, self.loader.batch_sampler, self.loader.dataset):
            set_epoch = getattr(part, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)
        return iter(self.loader)

    def _users_generators(self) -> list[torch.Generator]:
        loader = self.loader
        found = [loader.generator] + [getattr(part, "generator", None) for part in _samplers(loader)]
        unique = {id(g): g for g in found if isinstance(g, torch.Generator) and g is not self.generator}
        return list(unique.values())

    def replay_refusal(self) -> str | None:
        loader = self.loader
        if loader.num_workers > 0 and loader.persistent_workers:
            return ("the DataLoader keeps its worker processes (persistent_workers=True), and their random state, "
                    "which carries over from the epochs before, cannot be restored; use persistent_workers=False")
        for part in _samplers(loader):
            if type(part) not in _REPLAYABLE_SAMPLERS and not callable(getattr(part, "set_epoch", None)):
                return (f"the DataLoader's {type(part).__name__} may give another order each time it is read, "
                        "which dl4py cannot replay; give it a set_epoch(epoch) that makes its order depend on "
                        "the epoch alone (as DistributedSampler's does)")
        return None

    def _peek(self) -> DataSet:
        return to_dataset(next(iter(self.loader)), repr(self), self.label, self.features)

    def __repr__(self) -> str:
        return f"LoaderIterator({type(self.loader.dataset).__name__}, batch_size={self.batch_size})"


# Samplers whose order is their generator's (or torch's) draw and nothing else: the same
# seeds give the same order. Others must say so with a set_epoch.
_REPLAYABLE_SAMPLERS = (SequentialSampler, RandomSampler, SubsetRandomSampler, WeightedRandomSampler, BatchSampler,
                        DistributedSampler, _InfiniteConstantSampler)
# id of a user's generator -> (the generator, the seed it had when dl4py first read it, the seed
# dl4py gave it last). Held by id, not by weak reference: torch 2.11's Generator takes none (a
# TypeError on the first GPU run). The generator is kept, so its id cannot be reused, and the
# oldest are forgotten past a bound: met again, such a generator counts from the seed it then has.
_FIRST_SEEDS: "OrderedDict[int, tuple[torch.Generator, int, int]]" = OrderedDict()
REMEMBERED_GENERATORS = 64


def _samplers(loader) -> list:
    """The loader's sampler and batch sampler (with the sampler a batch sampler wraps)."""
    parts = [loader.sampler]
    if loader.batch_sampler is not None:
        parts += [loader.batch_sampler, getattr(loader.batch_sampler, "sampler", None)]
    return [part for part in dict.fromkeys(parts) if part is not None]


def _reseed(generator: torch.Generator, epoch: int) -> None:
    """``generator`` seeded with ``first + epoch``: ``first`` is its seed when dl4py first
    read it, or the one its owner gave it since (a fit per epoch, or a fresh process, counts
    from the same seed)."""
    _, first, given = _FIRST_SEEDS.pop(id(generator), (None, None, None))
    if first is None or generator.initial_seed() != given:
        first = generator.initial_seed()
    seed = (first + epoch) % 2**64
    generator.manual_seed(seed)
    _FIRST_SEEDS[id(generator)] = (generator, first, seed)  # the newest last
    while len(_FIRST_SEEDS) > REMEMBERED_GENERATORS:
        _FIRST_SEEDS.popitem(last=False)


class BatchesIterator(BatchStreamIterator):
    """Any iterable of ``(features, labels)`` batches, or a zero-argument function that
    returns a fresh one each epoch. A generator is one pass: a second epoch is an error
    that says to pass the function instead."""

    def __init__(self, source, label=None, features=None, name: str | None = None):
        self.source, self.label, self.features = source, label, features
        self.name = name or type(source).__name__
        self._one_pass = not callable(source) and iter(source) is source
        self._passes = 0
        if not callable(source) and hasattr(source, "__len__"):
            self._known_batches = len(source)

    def _epoch_batches(self, epoch: int):
        if self._one_pass and self._passes:
            raise DataError(  # epochs counted from 1, as train/numbering.py counts (dl4py.train imports data)
                f"the {self.name} given as data can be read once, and epoch {epoch + 1} found it used up; "
                "pass a function that returns a fresh one instead, e.g. fit(lambda: make_batches())"
            )
        self._passes += 1
        if not callable(self.source):
            return iter(self.source)
        fresh = self.source()
        try:
            return iter(fresh)
        except TypeError:
            raise DataError(
                f"the function given as data returned {type(fresh).__name__}, not an iterable of "
                "(features, labels) batches"
            ) from None

    def _peek(self) -> DataSet:
        if self._one_pass:
            return super()._peek()  # peeking would use up the only pass
        fresh = self.source() if callable(self.source) else self.source
        return to_dataset(next(iter(fresh)), repr(self), self.label, self.features)

    def __repr__(self) -> str:
        return f"BatchesIterator({self.name})"


def to_dataset(batch, where: str, label=None, features=None) -> DataSet:
    """One batch -> DataSet: float32 features, int64 class indices or float targets [n, k].
    Only dtypes are looked at, so this costs nothing per step."""
    if isinstance(batch, DataSet):
        return batch
    if isinstance(batch, dict):
        x, y = dict_arrays(batch, label, features, f"{where}, a dict batch")
        return DataSet(torch.from_numpy(np.ascontiguousarray(x)), y)
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        kind = f"a {len(batch)}-element {type(batch).__name__}" if isinstance(batch, (tuple, list)) else type(batch).__name__
        raise DataError(
            f"{where}: each batch must be a (features, labels) pair, a dict of columns or a DataSet; got {kind}"
        )
    x, y = _tensor(batch[0], where, "features"), _tensor(batch[1], where, "labels")
    if x.dtype != torch.float32:
        x = x.to(torch.float32)
    if per_step_labels(y, x):  # [n, time] class indices or [n, time, k] targets of sequences
        y = y.to(torch.float32 if y.is_floating_point() else torch.int64)
    elif not (y.is_floating_point() or y.is_complex()):
        if y.dtype != torch.int64:
            y = y.to(torch.int64)
        if y.dim() != 1:
            raise DataError(f"{where}: class-index labels must be 1-D (or [n, time] for sequences [n, time, size]), "
                            f"got shape {tuple(y.shape)}")
    elif y.dim() in (2, 4):  # [n, k] targets; [n, c, h, w]: a cnn_loss layer's
        if y.dtype != torch.float32:
            y = y.to(torch.float32)
    else:
        raise DataError(
            f"{where}: labels must be 1-D integer class indices or 2-D float targets, got shape "
            f"{tuple(y.shape)} dtype {y.dtype}; for a regression target use y.reshape(-1, 1)"
        )
    return DataSet(x, y)


def _tensor(value, where: str, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, (list, tuple)):
        return torch.as_tensor(value)
    raise DataError(f"{where}: batch {name} must be a tensor or numeric numpy array, got {type(value).__name__}")
