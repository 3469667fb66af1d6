"""A whole in-memory data set held on the training device, shuffled and sliced there.

Small data sets (MNIST is 188 MB as float32) fit in a GPU's memory many times over. Held
there, a batch is one gather on the device instead of a gather, a host-to-device copy and
a wait; for a small network that per-step cost is most of the step. The batches are the
ones the host iterator yields, value for value: the epoch's order is the iterator's own
``epoch_order`` (computed on the host, a small index tensor) and the gather is the same
``index_select``. The environment's ``device_data`` setting decides when ``fit`` does this
(``use_device_data``).
"""

from __future__ import annotations

from typing import Iterator

import torch

from dl4py.backend.device_memory import device_memory
from dl4py.data.dataset import DataSet
from dl4py.data.iterators import ArrayDataSetIterator, WrappedIterator
from dl4py.errors import DataError

__all__ = ["DeviceDataSetIterator", "dataset_fits", "use_device_data"]

# Share of the free device memory a data set may take under ``device_data: auto`` when the
# training step's own needs are unknown (a TorchModel); the rest is for its activations.
DEVICE_DATA_FRACTION = 0.25
# With the step's needs estimated (dl4py.memory), data and step may take this share together;
# the rest covers what the estimate leaves out (fragmentation, cuDNN workspaces).
DEVICE_DATA_WITH_ESTIMATE = 0.85


def dataset_fits(nbytes: int, device, free_bytes: int | None = None, step_bytes: int | None = None) -> bool:
    """Whether ``nbytes`` of data may be kept on ``device`` beside training.

    ``step_bytes``: what the memory estimator says a training step needs on top of the
    parameters already there; data and step must then fit in DEVICE_DATA_WITH_ESTIMATE of
    the free memory. Without it, the data may take DEVICE_DATA_FRACTION. ``free_bytes``
    defaults to what CUDA reports now, within any memory cap. A CPU "device" is host
    memory, where the data already is: always True."""
    device = torch.device(device)
    if device.type != "cuda":
        return True
    if free_bytes is None:
        free_bytes = _free_bytes(device)
    if step_bytes is None:
        return nbytes <= DEVICE_DATA_FRACTION * free_bytes
    return nbytes + step_bytes <= DEVICE_DATA_WITH_ESTIMATE * free_bytes


def _free_bytes(device: torch.device) -> int:

    return device_memory(device).bytes  # free CUDA memory, within any max_device_cache


def holds_arrays(iterator) -> bool:
    """An ArrayDataSetIterator (MNIST, CSV, arrays) that batches the standard way, so its
    batches can be cut from a copy of its tensors."""
    kind = type(iterator)
    return (isinstance(iterator, ArrayDataSetIterator)
            and kind._batch is ArrayDataSetIterator._batch and kind.__iter__ is ArrayDataSetIterator.__iter__)


def data_bytes(iterator: ArrayDataSetIterator) -> int:
    return sum(t.numel() * t.element_size() for t in (iterator.features, iterator.labels))


def use_device_data(setting: str, iterator, device: torch.device, step_bytes: int | None = None) -> bool:
    """The environment's ``device_data`` for this iterator and device.

    ``auto``: on for an in-memory iterator on CUDA when ``dataset_fits`` (with the step's
    estimated ``step_bytes``); ``on``: on for any device, a DataError for an iterator that
    is not in memory; ``off``: never.
    """
    if setting == "off" or isinstance(iterator, DeviceDataSetIterator):
        return False
    if not holds_arrays(iterator):
        if setting == "on":
            raise DataError(
                f"environment setting device_data=on, but {type(iterator).__name__} does not hold its "
                "data in memory as an ArrayDataSetIterator does (MNIST, CSV, arrays), so it cannot be "
                "copied to the device; set device_data to auto (its batches are then prefetched) or off"
            )
        return False
    return setting == "on" or (device.type == "cuda" and dataset_fits(data_bytes(iterator), device,
                                                                      step_bytes=step_bytes))


class DeviceDataSetIterator(WrappedIterator):
    """``iterator``'s features and labels copied once to ``device``; its batches cut there.

    The epoch counter stays the wrapped iterator's, so both give the same order whichever
    is iterated. The copy is taken at construction: later changes to the iterator's
    tensors are not seen.

    >>> train = MnistDataSetIterator(128, train=True, seed=123)          # doctest: +SKIP
    >>> model.fit(DeviceDataSetIterator(train, "cuda"), epochs=2)       # doctest: +SKIP
    """

    def __init__(self, iterator: ArrayDataSetIterator, device):
        if not holds_arrays(iterator):
            raise DataError(
                f"DeviceDataSetIterator needs an in-memory ArrayDataSetIterator (MNIST, CSV, arrays), "
                f"got {type(iterator).__name__}"
            )
        super().__init__(iterator)
        self.device = torch.device(device)
        self._sources = (iterator.features, iterator.labels)
        self.features = iterator.features.to(self.device)
        self.labels = iterator.labels.to(self.device)

    def copies(self, iterator) -> bool:
        """Whether this is a copy of ``iterator``'s current tensors."""
        return (self.iterator is iterator and self._sources[0] is iterator.features
                and self._sources[1] is iterator.labels)

    def __iter__(self) -> Iterator[DataSet]:
        it = self.iterator
        epoch = it._take_epoch()
        size, stop = it.batch_size, it.total_examples()
        if not it.shuffle:
            return (DataSet(self.features[i : i + size], self.labels[i : i + size]) for i in range(0, stop, size))
        order = it.epoch_order(epoch).to(self.device)
        return (self._gather(order[i : i + size]) for i in range(0, stop, size))

    def _gather(self, rows: torch.Tensor) -> DataSet:
        return DataSet(self.features.index_select(0, rows), self.labels.index_select(0, rows))

    def __repr__(self) -> str:
        return f"DeviceDataSetIterator({self.iterator!r}, device={self.device})"
