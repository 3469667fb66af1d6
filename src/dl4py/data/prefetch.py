"""Batches copied to a CUDA device ahead of use: pinned host memory, a side stream.

A copy from pageable host memory makes the host wait for it; from pinned (page-locked)
memory it is asynchronous, and issued on a stream of its own it overlaps the training
step running on the default stream. The step's stream then waits for the copy's event,
and the batch's memory is recorded as used there, so the caching allocator does not hand
it out again before the step is done with it. On a CPU all of this is a no-op.
"""

from __future__ import annotations

from collections import deque
from typing import Iterator

import torch

from dl4py.data.dataset import DataSet
from dl4py.data.iterators import WrappedIterator

__all__ = ["PrefetchIterator", "copy_to_device", "wait_for_copy"]

PREFETCH_DEPTH = 2  # batches in flight ahead of the one being trained on


def copy_to_device(batch: DataSet, device: torch.device, pin: bool,
                   stream: torch.cuda.Stream | None) -> tuple[DataSet, torch.cuda.Event | None]:
    """``batch`` on ``device``, and the event that marks its copy done (None when there is
    nothing to wait for: a CPU device, or data already there)."""
    x, y, mask = batch.features, batch.labels, batch.features_mask  # the mask of padded sequences
    if device.type != "cuda" or stream is None or (x.device == device and y.device == device):
        return DataSet(x.to(device), y.to(device), None if mask is None else mask.to(device)), None
    if pin:
        x, y = _pinned(x), _pinned(y)
        mask = None if mask is None else _pinned(mask)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        moved = DataSet(x.to(device, non_blocking=True), y.to(device, non_blocking=True),
                        None if mask is None else mask.to(device, non_blocking=True))
        event = torch.cuda.Event()
        event.record(stream)
    return moved, event


def _pinned(t: torch.Tensor) -> torch.Tensor:
    return t.pin_memory() if t.device.type == "cpu" and not t.is_pinned() else t


def wait_for_copy(batch: DataSet, event: torch.cuda.Event | None, device: torch.device) -> DataSet:
    """Make the current stream wait for ``batch``'s copy; call on the thread that trains."""
    if event is not None:
        current = torch.cuda.current_stream(device)
        current.wait_event(event)
        batch.features.record_stream(current)
        batch.labels.record_stream(current)
        if batch.features_mask is not None:
            batch.features_mask.record_stream(current)
    return batch


class PrefetchIterator(WrappedIterator):
    """``iterator``'s batches on ``device``, each copied ``depth`` batches before it is used.

    Single-threaded: the copies are asynchronous, so issuing them early is enough for them to
    overlap the GPU's work. The epoch counter stays the wrapped iterator's.
    """

    def __init__(self, iterator, device, pin: bool = True, depth: int = PREFETCH_DEPTH):
        super().__init__(iterator)
        self.device = torch.device(device)
        self.pin = pin
        self.depth = depth

    def __iter__(self) -> Iterator[DataSet]:
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        pending: deque = deque()
        for batch in self.iterator:
            pending.append(copy_to_device(batch, self.device, self.pin, stream))
            if len(pending) > self.depth:
                yield wait_for_copy(*pending.popleft(), self.device)
        while pending:
            yield wait_for_copy(*pending.popleft(), self.device)
