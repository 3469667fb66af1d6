"""Training's randomness as a function of where it is: (seed, epoch, batch, stream).

Before each batch of an epoch is read, torch's generator (and the model's GPU's) is seeded
from the model's seed, the epoch, the batch's index in the epoch and the stream (a
parallel worker's rank); numpy's and python's global generators too, when the batches come
from a source that may draw from them (a DataLoader, an iterable: ``draws_from_global_generators``).
Whatever draws until the next batch is read -- reading this one (a DataLoader's shuffle,
a Dataset's augmentation in this process), then its step's dropout -- draws the same
numbers whenever that batch is trained. So a run resumed part-way through an epoch, which
reads the epoch's first batches again and skips them, goes on exactly as the uninterrupted
run did, in one process or in any number of workers, and its checkpoint needs no
generator state. The caller's generators are as they were when the epoch ends.
"""

from __future__ import annotations

import hashlib
import random

import numpy as np
import torch

from dl4py.data.iterators import WrappedIterator


def position_seed(seed: int, epoch: int, batch: int, stream: int) -> int:
    """A 64-bit seed for one position; nearby positions get unrelated seeds."""
    digest = hashlib.blake2b(f"{seed}/{epoch}/{batch}/{stream}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class EpochRandomness:
    """The random stream of epoch ``epoch`` (``stream``: a worker's rank, so each draws its
    own dropout masks). ``at(batch)`` seeds the generators for a batch; ``batches(iterable)``
    yields ``(index, batch)``, each read after ``at(index)``. ``cuda``: the GPU whose
    generator is seeded too; ``global_generators``: numpy's and python's also."""

    def __init__(self, seed: int, epoch: int, stream: int = 0, cuda: torch.device | None = None,
                 global_generators: bool = False):
        self.seed, self.epoch, self.stream = seed, epoch, stream
        self.cuda, self.global_generators = cuda, global_generators
        self._fork = self._saved = None

    def __enter__(self) -> "EpochRandomness":
        devices = [self.cuda.index or 0] if self.cuda is not None else []
        self._fork = torch.random.fork_rng(devices=devices)
        self._fork.__enter__()
        if self.global_generators:
            self._saved = (np.random.get_state(), random.getstate())
        self.at(0)
        return self

    def __exit__(self, *exc) -> None:
        if self._saved is not None:
            np.random.set_state(self._saved[0])
            random.setstate(self._saved[1])
            self._saved = None
        self._fork.__exit__(*exc)

    def at(self, batch: int) -> None:
        value = position_seed(self.seed, self.epoch, batch, self.stream)
        # Only the generators fork_rng restores: torch.manual_seed would reseed every GPU.
        torch.random.default_generator.manual_seed(value)
        if self.cuda is not None:
            with torch.cuda.device(self.cuda):
                torch.cuda.manual_seed(value)
        if self.global_generators:
            np.random.seed(value % 2**32)
            random.seed(value)

    def batches(self, iterable):
        """``(index, batch)`` of ``iterable``, each batch read just after ``at(index)``; the
        iterator is made after ``at(0)`` (a DataLoader draws its workers' seed there)."""
        self.at(0)
        batches = iter(iterable)
        index = 0
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            yield index, batch
            index += 1
            self.at(index)


def epoch_rng(model, epoch: int, stream: int = 0, data=None) -> EpochRandomness:
    """The randomness of ``model``'s epoch ``epoch``; numpy's and python's generators are
    seeded too when ``data`` may draw from them."""
    device = model.backend.device
    return EpochRandomness(getattr(model, "seed", 0), epoch, stream, cuda=device if device.type == "cuda" else None,
                           global_generators=data is not None and data.draws_from_global_generators)


class SeededReading(WrappedIterator):
    """``iterator``'s batches, each read with the generators seeded for its position (stream
    0, as one process reads them): what a parallel fit's coordinator deals to the workers, so a
    DataLoader's shuffle and a Dataset's augmentation draw what ``Model.fit`` would."""

    def __init__(self, iterator, seed: int):
        super().__init__(iterator)
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        super().set_epoch(epoch)

    def __iter__(self):
        epoch, self.epoch = self.epoch, self.epoch + 1  # the next epoch, unless set_epoch says otherwise
        with EpochRandomness(self.seed, epoch, global_generators=self.draws_from_global_generators) as rng:
            for _, batch in rng.batches(self.iterator):
                yield batch
