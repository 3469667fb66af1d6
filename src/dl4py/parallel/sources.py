"""Where each worker's batches come from, and the prefetch buffer that keeps them ready.

- ``ShardedSource``: dl4py's in-memory iterators (MNIST, arrays, CSV). Every worker holds
  the iterator (MNIST travels as its constructor arguments and is read from disk by each
  worker) and slices its own batches from the epoch's shuffle order: nothing per batch
  crosses a process boundary.
- ``QueueSource``: any other iterator. The coordinating process iterates it and deals
  batches round-robin into one bounded queue per worker (in tensor mode each batch to
  every rank of a tensor group: ``GroupCopies``). The queues serve every fit of
  a worker pool, so each batch carries its fit's number: one a stopped fit dealt but
  never read is skipped by the next.
- ``StrideSource``: any other iterator under torchrun (no coordinator): every process
  iterates it and keeps every ``world``-th batch.
- ``StreamShardSource``: a streamed source that can be sharded (``TableDirectoryIterator``):
  every worker reads its own files or row groups, so nothing goes through one queue and
  no worker holds the whole data (``OpenRoundPlan``).

Each yields ``(round_index, DataSet)`` for the rounds its worker trains in; ``start``
(the batches of the epoch trained before a resume) are left out, and rounds count from
there (``RoundPlan``). A batch's ``features_mask`` (padded sequences) travels with it
whichever way it comes, to the worker's device.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Iterator

import torch

from dl4py.data import ArrayDataSetIterator, DataSet
from dl4py.data.iterators import WrappedIterator
from dl4py.data.prefetch import copy_to_device, wait_for_copy
from dl4py.errors import DataError
from dl4py.parallel.plan import RoundPlan
from dl4py.train.numbering import epoch_name

POLL_SECONDS = 0.2
END_OF_EPOCH = "end-of-epoch"


def batches_per_epoch(iterator) -> int:
    try:
        return len(iterator)
    except TypeError:
        raise DataError(
            f"ParallelWrapper needs to know how many batches an epoch has: {type(iterator).__name__} "
            "has no len(); give it __len__, use an ArrayDataSetIterator, or stream files with a "
            "TableDirectoryIterator (each worker then reads its own shard)"
        ) from None


def is_shardable(iterator) -> bool:
    """A source every worker can read its own part of (``TableDirectoryIterator``)."""
    return callable(getattr(iterator, "shard", None)) and callable(getattr(iterator, "batches", None))


class StreamShardSource:
    """Worker ``rank`` of ``world`` reads shard ``rank`` of the source, and skips the rounds
    of the epoch trained before a resume (``start`` counts ``world`` batches a round)."""

    def __init__(self, iterator):
        self.iterator = iterator

    def batches(self, epoch: int, rank: int, world: int, start: int = 0) -> Iterator[tuple[int, DataSet]]:
        return self.iterator.batches(epoch, rank, world, start=start // world)


class ShardedSource:
    def __init__(self, iterator: ArrayDataSetIterator):
        self.iterator = iterator

    def batches(self, epoch: int, rank: int, world: int, start: int = 0) -> Iterator[tuple[int, DataSet]]:
        it = self.iterator
        plan = RoundPlan(len(it), world, start)
        size, stop = it.batch_size, it.total_examples()
        order = it.epoch_order(epoch) if it.shuffle else None
        # dl4py's own batching is replaced by a thread-friendly gather; a subclass that
        # builds its batches its own way keeps its way.
        own_batches = type(it)._batch is not ArrayDataSetIterator._batch
        for round_index in range(plan.rounds):
            index = plan.batch_of(round_index, rank)
            if index is None:
                return
            start, end = index * size, min((index + 1) * size, stop)
            if order is None:
                yield round_index, it._batch(slice(start, end))
            elif own_batches:
                yield round_index, it._batch(order[start:end])
            else:
                rows = order[start:end]
                yield round_index, DataSet(_gather(it.features, rows), _gather(it.labels, rows))


def _gather(tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows of ``tensor``. This runs on the prefetch thread: a torch op there would start a
    second OpenMP team beside the training thread's and, on a CPU worker, slow training by
    about a quarter (measured on 2 cores); numpy's single-threaded gather does not."""
    if tensor.device.type == "cpu":
        return torch.from_numpy(tensor.numpy()[rows.numpy()])
    return tensor.index_select(0, rows.to(tensor.device))


class StrideSource:
    def __init__(self, iterator):
        self.iterator = iterator

    def batches(self, epoch: int, rank: int, world: int, start: int = 0) -> Iterator[tuple[int, DataSet]]:
        if hasattr(self.iterator, "set_epoch"):
            self.iterator.set_epoch(epoch)
        for index, batch in enumerate(self.iterator):
            if index >= start and (index - start) % world == rank:
                yield (index - start) // world, batch


class GroupCopies(WrappedIterator):
    """Each batch of ``iterator`` ``copies`` times in a row: dealt round-robin to the workers,
    every rank of a tensor group (``copies`` consecutive ranks) gets its group's batches,
    which tensor mode trains together. Its batch ``b * copies + t`` is ``iterator``'s ``b``."""

    def __init__(self, iterator, copies: int):
        super().__init__(iterator)
        self.copies = copies

    def __len__(self) -> int:
        return len(self.iterator) * self.copies

    def __iter__(self) -> Iterator[DataSet]:
        for batch in self.iterator:
            for _ in range(self.copies):
                yield batch


class QueueSource:
    """Worker side of the coordinator's round-robin dealing, for fit number ``job``.

    ``close`` ends the fit's reading: a prefetch thread still waiting on the inbox (the
    fit stopped mid-epoch) gives up and is joined, so it cannot take a batch of the next fit."""

    def __init__(self, inbox, stop_event, timeout: float, job: int = 0):
        self.inbox = inbox
        self.stop_event = stop_event
        self.timeout = timeout
        self.job = job
        self._closed = threading.Event()
        self._readers: set[threading.Thread] = set()

    def batches(self, epoch: int, rank: int, world: int, start: int = 0) -> Iterator[tuple[int, DataSet]]:
        round_index = 0  # the coordinator deals from ``start`` on
        stopped = _EitherSet(self.stop_event, self._closed)
        while True:
            self._readers.add(threading.current_thread())
            job, item = get_bounded(self.inbox, stopped, self.timeout, f"batches for worker {rank}")
            if job != self.job:
                continue  # dealt for an earlier fit that stopped before reading it
            if isinstance(item, str) and item == END_OF_EPOCH:
                return
            features, labels, mask = item
            yield round_index, DataSet(features, labels, mask)
            round_index += 1

    def close(self) -> None:
        self._closed.set()
        for reader in self._readers - {threading.current_thread()}:
            reader.join(timeout=POLL_SECONDS * 10)  # it looks at ``_closed`` every POLL_SECONDS


class _EitherSet:
    """Set when either event is (``get_bounded``'s ``stop_event``)."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def is_set(self) -> bool:
        return (self.first is not None and self.first.is_set()) or self.second.is_set()


def deal_batches(iterator, inboxes, epochs: int, first_epoch: int, stop_event, timeout: float,
                 first_batch: int = 0, job: int = 0) -> None:
    """Coordinator side: batch ``b`` of each epoch goes to worker ``b % len(inboxes)``; in the
    first epoch, resumed at ``first_batch``, batch ``b`` goes to ``(b - first_batch) % len(inboxes)``.
    Each item is ``(job, batch)``: the number of the fit it belongs to."""
    expected = batches_per_epoch(iterator)
    for epoch in range(first_epoch, first_epoch + epochs):
        if hasattr(iterator, "set_epoch"):
            iterator.set_epoch(epoch)
        start = first_batch if epoch == first_epoch else 0
        count = 0
        for index, batch in enumerate(iterator):
            count += 1
            if index < start:
                continue  # trained before the resume
            # The mask goes too: without it a worker would train the padding as real steps.
            item = (batch.features, batch.labels, getattr(batch, "features_mask", None))
            put_bounded(inboxes[(index - start) % len(inboxes)], (job, item), stop_event, timeout)
            if stop_event.is_set():
                return  # the fit ended (early stopping asks for epochs without end): read no further
        if count != expected:
            raise DataError(
                f"{type(iterator).__name__} yielded {count} batches in {epoch_name(epoch)} but len() said {expected}"
            )
        for inbox in inboxes:
            put_bounded(inbox, (job, END_OF_EPOCH), stop_event, timeout)


def put_bounded(q, item, stop_event, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not stop_event.is_set():
        try:
            q.put(item, timeout=POLL_SECONDS)
            return
        except queue.Full:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no worker took a batch for {timeout:.0f} s") from None


def get_bounded(q, stop_event, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while stop_event is None or not stop_event.is_set():
        try:
            return q.get(timeout=POLL_SECONDS)
        except queue.Empty:
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout:.0f} s for {what}") from None
    raise InterruptedError(f"stopped while waiting for {what}")


class Prefetcher:
    """Up to ``depth`` batches ready on the worker's device ahead of the training step,
    gathered on a thread and, on CUDA, copied from pinned memory on a side stream."""

    def __init__(self, batches: Iterator[tuple[int, DataSet]], device: torch.device, depth: int,
                 pin: bool, timeout: float):
        self._source = batches
        self._device = device
        self._pin = pin and device.type == "cuda"
        self._timeout = timeout
        self._queue: queue.Queue | None = queue.Queue(maxsize=depth) if depth > 0 else None
        self._stop = threading.Event()
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        if self._queue is not None:
            self._thread = threading.Thread(target=self._fill, name="dl4py-prefetch", daemon=True)
            self._thread.start()

    def _move(self, item):
        round_index, batch = item
        return (round_index, *copy_to_device(batch, self._device, self._pin, self._stream))

    def _ready(self, moved) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(round, features, labels, features mask or None), on the device."""
        round_index, batch, event = moved
        batch = wait_for_copy(batch, event, self._device)  # on the training thread's stream
        return round_index, batch.features, batch.labels, batch.features_mask

    def _fill(self) -> None:
        try:
            for item in self._source:
                moved = self._move(item)
                put_bounded(self._queue, moved, self._stop, self._timeout)
                if self._stop.is_set():
                    return  # closed: read no further (a pool's next fit may share the source)
            put_bounded(self._queue, None, self._stop, self._timeout)
        except BaseException as exc:  # handed to the training thread, which raises it
            if not self._stop.is_set():
                try:
                    self._queue.put(exc, timeout=self._timeout)
                except queue.Full:
                    pass

    def __iter__(self):
        if self._queue is None:
            yield from (self._ready(self._move(item)) for item in self._source)
            return
        while True:
            item = get_bounded(self._queue, self._stop, self._timeout, "the next prefetched batch")
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield self._ready(item)

    def close(self) -> None:
        self._stop.set()
