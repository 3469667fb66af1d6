"""SequenceDataSetIterator: variable-length sequences as padded batches with a mask.

Each batch is ``[n, time, size]``, ``time`` the longest sequence in that batch; shorter
ones are padded with zeros at the end and ``features_mask`` ``[n, time]`` marks their real
steps (DL4J's ``ALIGN_START`` padding with a feature mask array). Labels are one class
index per sequence (``[n]``, for LastTimeStep + output) or one per step (``[n, time]``,
padded with 0 where the mask is 0, for RnnOutputLayer).
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np
import torch

from dl4py.data.dataset import DataSet
from dl4py.data.iterators import DataSetIterator
from dl4py.errors import DataError


class SequenceDataSetIterator(DataSetIterator):
    """Batches of padded sequences. Example::

        it = SequenceDataSetIterator([[3, 1, 4], [1, 5]], labels=[0, 1], batch_size=2)

    ``sequences``: arrays ``[time_i, size]``, or ``[time_i]`` of indices (one value per step,
    as EmbeddingSequenceLayer takes them). ``labels``: a class index per sequence, or an
    array of ``time_i`` class indices per sequence. ``shuffle`` reorders sequences each
    epoch by ``seed + epoch``.
    """

    def __init__(self, sequences: Sequence, labels: Sequence, batch_size: int, shuffle: bool = False,
                 seed: int = 0, *, num_classes: int | None = None):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise DataError(f"batch_size must be a positive integer, got {batch_size!r}")
        if len(sequences) != len(labels):
            raise DataError(f"{len(sequences)} sequences but {len(labels)} labels; they must match")
        if not len(sequences):
            raise DataError("sequences is empty")
        self.sequences = [_as_steps(s, i) for i, s in enumerate(sequences)]
        sizes = {s.shape[1] for s in self.sequences}
        if len(sizes) != 1:
            raise DataError(f"every sequence needs the same number of values per step, got sizes {sorted(sizes)}")
        self.per_step = not np.isscalar(labels[0]) and np.ndim(labels[0]) == 1
        self.labels = [np.asarray(y, dtype=np.int64) for y in labels]
        for i, (x, y) in enumerate(zip(self.sequences, self.labels)):
            if self.per_step and y.shape != (x.shape[0],):
                raise DataError(f"sequence {i} has {x.shape[0]} steps but {y.shape[0] if y.ndim else 1} labels")
        top = max(int(y.max()) for y in self.labels)
        self._num_classes = num_classes if num_classes is not None else top + 1
        self._max_label = (top, next(i for i, y in enumerate(self.labels) if int(y.max()) == top))
        self.batch_size, self.shuffle, self.seed = batch_size, bool(shuffle), int(seed)

    def __len__(self) -> int:
        return -(-len(self.sequences) // self.batch_size)

    def total_examples(self) -> int:
        return len(self.sequences)

    def num_classes(self) -> int | None:
        return self._num_classes

    def input_shape(self) -> tuple[int | None, ...]:
        return (None, self.sequences[0].shape[1])

    def max_label(self) -> tuple[int, int] | None:
        return self._max_label

    def __iter__(self) -> Iterator[DataSet]:
        epoch = self._take_epoch()
        order = np.arange(len(self.sequences))
        if self.shuffle:
            order = torch.randperm(len(order), generator=torch.Generator().manual_seed(self.seed + epoch)).numpy()
        return (self._batch(order[i : i + self.batch_size]) for i in range(0, len(order), self.batch_size))

    def _batch(self, rows) -> DataSet:
        chosen = [self.sequences[r] for r in rows]
        steps = max(s.shape[0] for s in chosen)
        features = np.zeros((len(chosen), steps, chosen[0].shape[1]), dtype=np.float32)
        mask = np.zeros((len(chosen), steps), dtype=np.float32)
        labels = np.zeros((len(chosen), steps), dtype=np.int64) if self.per_step else np.zeros(len(chosen), np.int64)
        for j, r in enumerate(rows):
            t = self.sequences[r].shape[0]
            features[j, :t], mask[j, :t] = self.sequences[r], 1.0
            if self.per_step:
                labels[j, :t] = self.labels[r]
            else:
                labels[j] = self.labels[r]
        return DataSet(torch.from_numpy(features), torch.from_numpy(labels), torch.from_numpy(mask))

    def __repr__(self) -> str:
        return f"SequenceDataSetIterator(n={len(self.sequences)}, batch_size={self.batch_size}, shuffle={self.shuffle})"


def _as_steps(sequence, index: int) -> np.ndarray:
    steps = np.asarray(sequence, dtype=np.float32)
    if steps.ndim == 1:
        steps = steps[:, None]
    if steps.ndim != 2 or steps.shape[0] == 0:
        raise DataError(f"sequence {index} must be [time, size] (or [time]) with at least one step, "
                        f"got shape {list(steps.shape)}")
    return steps
