"""Requests waiting for a replica: a bounded queue that a ``close`` empties and wakes.

A ``Request`` is one caller's features and the future its answer arrives in. The
``RequestQueue`` holds at most ``limit`` of them (DL4J's ``queueLimit``); a caller that
finds it full waits up to its timeout, and ``close`` fails every request still queued
and wakes every waiter, so no thread is left waiting on a queue nobody reads.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future

import torch

from dl4py.errors import InferenceError


class Request:
    """One ``output`` call: its features ``[n, ...]`` and the future of its predictions."""

    __slots__ = ("features", "future")

    def __init__(self, features: torch.Tensor):
        self.features = features
        self.future: Future = Future()

    @property
    def size(self) -> int:
        return int(self.features.shape[0])

    def mergeable_with(self, other: "Request") -> bool:
        # Only examples of one shape stack into a batch (sequences of different lengths do not).
        return self.features.shape[1:] == other.features.shape[1:] and self.features.dtype == other.features.dtype


class RequestQueue:
    """First in, first out, at most ``limit`` requests; closable."""

    def __init__(self, limit: int):
        self.limit = limit
        self._items: deque[Request] = deque()
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        self.closed = False

    def put(self, request: Request, timeout: float | None) -> None:
        """Queue ``request``; wait up to ``timeout`` seconds for room (None: until there is
        room or the queue closes; 0: not at all). InferenceError when full or closed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while not self.closed and len(self._items) >= self.limit:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise InferenceError(
                        f"ParallelInference: the request queue is full ({self.limit} requests waiting, "
                        f"queue_limit={self.limit}) and stayed full for queue_timeout={timeout} s; "
                        "raise queue_limit or workers, or send fewer requests at once")
                self._not_full.wait(left)
            if self.closed:
                raise InferenceError("ParallelInference is closed: it takes no more requests")
            self._items.append(request)
            self._not_empty.notify()

    def take(self, batch_limit: int) -> list[Request] | None:
        """The oldest request and, behind it, further ones of the same shape while their
        examples together stay within ``batch_limit``; waits for one. None once closed."""
        with self._lock:
            while not self._items and not self.closed:
                self._not_empty.wait()
            if not self._items:
                return None
            taken = [self._items.popleft()]
            examples = taken[0].size
            while self._items and examples + self._items[0].size <= batch_limit \
                    and self._items[0].mergeable_with(taken[0]):
                examples += self._items[0].size
                taken.append(self._items.popleft())
            self._not_full.notify(len(taken))
            return taken

    def close(self) -> None:
        """Take no more requests; fail those still waiting; wake every waiting thread."""
        with self._lock:
            self.closed = True
            pending = list(self._items)
            self._items.clear()
            self._not_empty.notify_all()
            self._not_full.notify_all()
        for request in pending:
            if request.future.set_running_or_notify_cancel():
                request.future.set_exception(
                    InferenceError("ParallelInference was closed before this request was answered"))

    def __len__(self) -> int:
        return len(self._items)


class ReplicaPool:
    """Free replicas for the inplace mode: a caller borrows one for its own forward pass."""

    def __init__(self, replicas):
        self._free = deque(replicas)
        self._count = len(self._free)
        self._lock = threading.Lock()
        self._returned = threading.Condition(self._lock)
        self.closed = False

    def borrow(self, timeout: float | None):
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while not self.closed and not self._free:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise InferenceError(
                        f"ParallelInference: all {self._count} replicas stayed busy for queue_timeout={timeout} s; "
                        "raise workers, or send fewer requests at once")
                self._returned.wait(left)
            if self.closed:
                raise InferenceError("ParallelInference is closed: it takes no more requests")
            return self._free.popleft()

    def give_back(self, replica) -> None:
        with self._lock:
            self._free.append(replica)
            self._returned.notify()

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._returned.notify_all()
