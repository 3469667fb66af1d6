"""ParallelInference: many threads asking one model for predictions (DL4J's class of that name).

Replicas of the model (``workers`` of them, over ``devices``) answer requests. Threads,
not processes: a forward pass spends its time in torch kernels, which release the GIL.

- ``"batched"`` (DL4J's ``InferenceMode.BATCHED``): requests wait in a bounded queue; a
  replica's thread takes the oldest and merges those queued behind it, up to
  ``batch_limit`` examples, into one forward pass, then hands each caller its rows.
- ``"sequential"`` (``SEQUENTIAL``): the same queue, one request per forward pass.
- ``"inplace"`` (``INPLACE``): no queue; the caller's own thread runs a free replica.

Each request is checked (``model.check_features``) before it is queued, so a malformed one
fails alone, in its caller, and never reaches a batch it would spoil.

A short request runs in its caller's thread when nothing is queued and a replica is free (in
the batched and sequential modes too): with nothing to merge it with, handing it to a replica's
thread and the answer back would cost two thread wake-ups, more than a small network's forward
pass. Short: its examples times the measured seconds per example, under ``INLINE_SECONDS``;
until a forward pass has been measured every request is queued.

``runtime`` picks what runs a replica (``runtimes.py``): ``torch`` (the model's own module),
``onnx`` (ONNX Runtime on the exported file), ``torchscript``, or ``auto`` (the default: onnx
where it gives ``model.output``'s answers, else torch).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import Counter, deque
from concurrent.futures import Future

import numpy as np
import torch

from dl4py.errors import ConfigError, DataError, InferenceError
from dl4py.inference.runtimes import make_runtime_replicas
from dl4py.inference.requests import ReplicaPool, Request, RequestQueue
from dl4py.nn.model import _as_tensor, as_iterator

MODES = ("batched", "sequential", "inplace")
# How long close() waits for a replica's thread to finish the forward pass it is in.
JOIN_SECONDS = 60.0
# A request whose forward pass should take less than this runs in its caller's thread when a
# replica is free and nothing waits: an event loop may be held up that long (a JSON body of a
# few kilobytes takes about as long to parse).
INLINE_SECONDS = 0.0005
# The estimate of seconds per example is the least of the last this-many forward passes': a
# pass the machine interrupted (another process, a page fault) only ever takes longer.
RECENT_PASSES = 16


class ParallelInference:
    """Thread-safe ``output`` over replicas of ``model``. Example::

        with ParallelInference(model, workers=2, batch_limit=64) as inference:
            probabilities = inference.output(features)   # from any number of threads

    ``output(x)`` returns what ``model.output(x)`` returns. The replicas are copies of the
    model as it is when this is made; a model trained further needs a new ParallelInference.
    ``queue_timeout``: seconds a caller waits for room in a full queue (for a free replica
    in the inplace mode) before an InferenceError; None waits until there is room, 0 never.
    ``runtime``: ``auto``, ``torch``, ``onnx`` or ``torchscript``; ``self.runtime`` says which
    answers and ``self.runtime_reason`` why. ``inline_seconds``: a request expected to take less
    runs in its caller's thread when nothing waits (0: every request goes to a replica's thread).
    """

    def __init__(self, model, workers: int = 1, devices=None, inference_mode: str = "batched",
                 batch_limit: int = 32, queue_limit: int = 64, queue_timeout: float | None = None,
                 runtime: str = "auto", inline_seconds: float = INLINE_SECONDS):
        if inference_mode not in MODES:
            raise ConfigError("inference_mode", f"must be one of {', '.join(MODES)}; got {inference_mode!r}")
        for name, value in (("batch_limit", batch_limit), ("queue_limit", queue_limit)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, f"must be a whole number >= 1, got {value!r}")
        if isinstance(inline_seconds, bool) or not isinstance(inline_seconds, (int, float)) or inline_seconds < 0:
            raise ConfigError("inline_seconds", f"must be seconds >= 0, got {inline_seconds!r}")
        if queue_timeout is not None and (isinstance(queue_timeout, bool) or not isinstance(queue_timeout, (int, float))
                                          or queue_timeout < 0):
            raise ConfigError("queue_timeout", f"must be seconds >= 0 or None, got {queue_timeout!r}")
        self.model = model
        self._signature = model.signature()  # read once: how to pack inputs and split outputs
        self.inference_mode = inference_mode
        self.batch_limit = batch_limit if inference_mode == "batched" else 1
        self.queue_limit, self.queue_timeout = queue_limit, queue_timeout
        self.replicas, choice = make_runtime_replicas(model, workers, devices, runtime)
        self.runtime, self.runtime_reason = choice.name, choice.reason
        self._stats = _Stats(inline_seconds)
        self._closed = False
        if inference_mode == "inplace":
            self._pool, self._queue, self._threads = ReplicaPool(self.replicas), None, []
        else:
            self._pool, self._queue = None, RequestQueue(queue_limit)
            # The threads hold the queue, a replica and the counters, never self: a
            # ParallelInference dropped without close() is collected, and its finalizer stops them.
            self._threads = [threading.Thread(target=_serve, args=(self._queue, replica, self.batch_limit, self._stats),
                                              name=f"dl4py-inference-{replica.index}", daemon=True)
                             for replica in self.replicas]
            for thread in self._threads:
                thread.start()
        self._finalizer = weakref.finalize(self, _shut_down, self._queue, self._pool, self._threads)

    @property
    def workers(self) -> int:
        return len(self.replicas)

    def output(self, features) -> torch.Tensor:
        """Predictions for ``features`` (``[n, ...]``, numpy or tensor, or any data ``output``
        takes); safe to call from many threads at once. DataError for features that do not
        fit the network; InferenceError when the queue stays full or this is closed."""
        x = self._checked(features)
        if self._runs_here(x):  # as submit, without a Future to make, fill and wait on
            predictions = self._run_here(x)
            if predictions is not None:
                return _as_model_returns(self._signature, predictions)
            return self._queued(x).result()
        return self._submit_checked(x).result()

    def submit(self, features) -> Future:
        """``output(features)`` without waiting for it: a ``concurrent.futures.Future`` of the
        answer (``asyncio.wrap_future`` awaits it in an event loop). The request is checked and
        queued before this returns, so DataError and a full queue's InferenceError are raised
        here; in the inplace mode the caller's thread runs the replica, and the future is done."""
        return self._submit_checked(self._checked(features))

    def _checked(self, features) -> torch.Tensor:
        if self._closed:
            raise InferenceError("ParallelInference is closed: it takes no more requests")
        x = _features(self.model, self._signature, features)
        self.model.check_features(x, "ParallelInference.output(features)")
        return x

    def _submit_checked(self, x: torch.Tensor) -> Future:
        answer: Future = Future()
        if x.shape[0] == 0:  # what Model.output gives for no examples
            answer.set_result(torch.empty(0, device=self.model.backend.device))
        elif self._pool is not None:
            answer.set_result(_as_model_returns(self._signature, self._inplace(x)))
        elif self._runs_here(x):
            try:
                predictions = self._run_here(x)
            except BaseException as error:  # noqa: BLE001 - the caller gets it, as from a replica's thread
                answer.set_exception(error)
                return answer
            if predictions is None:
                return self._queued(x)
            answer.set_result(_as_model_returns(self._signature, predictions))
        else:
            return self._queued(x)
        return answer

    def _runs_here(self, x: torch.Tensor) -> bool:
        """Whether to try ``x`` in the caller's thread: replicas in their own threads, a pass
        measured to be short, and nothing queued that it would overtake."""
        return self._pool is None and x.shape[0] > 0 and self._stats.short(x.shape[0]) and not len(self._queue)

    def _run_here(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x``'s predictions from a free replica, run in this thread; None when every replica
        is busy. A failing pass is counted and raised."""
        for replica in self.replicas:
            start = time.perf_counter()
            try:
                predictions = replica.try_predict(x)
            except BaseException:
                self._stats.failed_one()
                raise
            if predictions is not None:
                self._stats.ran([x.shape[0]], time.perf_counter() - start)
                return predictions
        return None

    def _queued(self, x: torch.Tensor) -> Future:
        """The future of ``x``'s answer from the replicas' threads, which merge what waits."""
        request = Request(x)
        self._queue.put(request, self.queue_timeout)
        if len(self._signature.outputs) == 1:
            return request.future  # its rows are the answer as they are
        answer: Future = Future()
        request.future.add_done_callback(lambda done: _pass_on(done, answer, self._signature))
        return answer

    def _inplace(self, x: torch.Tensor) -> torch.Tensor:
        replica = self._pool.borrow(self.queue_timeout)
        try:
            predictions = replica.predict(x)
        finally:
            self._pool.give_back(replica)
        self._stats.ran([x.shape[0]])
        return predictions

    def stats(self) -> dict:
        """What ran so far: ``requests``, ``examples``, ``forward_passes``, ``mean_batch_size``
        (examples per forward pass), ``max_batch_size``, ``batch_sizes`` ({examples: passes})
        and ``failed`` (requests answered with an error by a replica)."""
        return self._stats.snapshot()

    def close(self) -> None:
        """Take no more requests; those still queued get an InferenceError; wait for the
        forward passes under way to finish. Idempotent."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> "ParallelInference":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ParallelInference({type(self.model).__name__}, workers={self.workers}, "
                f"runtime={self.runtime!r}, inference_mode={self.inference_mode!r}, batch_limit={self.batch_limit}, "
                f"queue_limit={self.queue_limit}{', closed' if self._closed else ''})")


def _serve(queue: RequestQueue, replica, batch_limit: int, stats: "_Stats") -> None:
    """A replica's thread: take requests (merged up to ``batch_limit`` examples), answer them."""
    while True:
        requests = queue.take(batch_limit)
        if requests is None:
            return
        requests = [r for r in requests if r.future.set_running_or_notify_cancel()]
        if requests:
            _answer(replica, requests, stats)


def _answer(replica, requests: list[Request], stats: "_Stats") -> None:
    features = requests[0].features if len(requests) == 1 else torch.cat([r.features for r in requests])
    start = time.perf_counter()
    try:
        predictions = replica.predict(features)
    except BaseException as error:  # noqa: BLE001 - the callers get it; the thread serves on
        if len(requests) > 1:
            # Checked requests should not fail; if one does, run each alone, so only it fails.
            for request in requests:
                _answer(replica, [request], stats)
            return
        stats.failed_one()
        requests[0].future.set_exception(error)
        return
    stats.ran([r.size for r in requests], time.perf_counter() - start)
    row = 0
    for request in requests:
        request.future.set_result(predictions[row:row + request.size])
        row += request.size


def _shut_down(queue, pool, threads) -> None:
    if pool is not None:
        pool.close()
    if queue is not None:
        queue.close()
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join(JOIN_SECONDS)


def _features(model, signature, features) -> torch.Tensor:
    """``features`` as one tensor, as ``Model.output`` reads them."""
    if isinstance(features, (list, tuple)) and signature.several_inputs:
        features = model.pack_inputs(*features)  # a graph's several inputs
    if not isinstance(features, (torch.Tensor, np.ndarray)):
        batches = [b.features for b in as_iterator(features, None, labelled=False)]
        if not batches:
            raise DataError("ParallelInference.output(features): the data holds no examples")
        features = torch.cat(batches)
    return _as_tensor(features, "ParallelInference.output(features)")


def _pass_on(done: Future, answer: Future, signature) -> None:
    """``answer`` gets ``done``'s predictions split as the model returns them, or its error."""
    error = done.exception()
    if error is not None:
        answer.set_exception(error)
    else:
        answer.set_result(_as_model_returns(signature, done.result()))


def _as_model_returns(signature, predictions: torch.Tensor):
    """A graph with several outputs returns one tensor per output, as its ``output`` does."""
    if len(signature.outputs) == 1:
        return predictions
    return list(torch.split(predictions, [output.size for output in signature.outputs], dim=1))


class _Stats:
    """Forward passes and their sizes, counted under a lock (replica threads add to them)."""

    def __init__(self, inline_seconds: float):
        self._lock = threading.Lock()
        self._inline_seconds = inline_seconds
        self._sizes: Counter[int] = Counter()
        self._requests = 0
        self._failed = 0
        self._recent_seconds_per_example: deque[float] = deque(maxlen=RECENT_PASSES)

    def ran(self, request_sizes: list[int], seconds: float | None = None) -> None:
        examples = sum(request_sizes)
        with self._lock:
            self._sizes[examples] += 1
            self._requests += len(request_sizes)
            if seconds is not None:
                self._recent_seconds_per_example.append(seconds / examples)

    def short(self, examples: int) -> bool:
        """Whether a forward pass of ``examples`` should take under ``inline_seconds`` (False until one
        was measured)."""
        with self._lock:  # replica threads append to the passes meanwhile
            least = min(self._recent_seconds_per_example, default=None)
        return least is not None and least * examples < self._inline_seconds

    def failed_one(self) -> None:
        with self._lock:
            self._failed += 1

    def snapshot(self) -> dict:
        with self._lock:
            passes = sum(self._sizes.values())
            examples = sum(size * count for size, count in self._sizes.items())
            return {
                "requests": self._requests,
                "examples": examples,
                "forward_passes": passes,
                "mean_batch_size": examples / passes if passes else 0.0,
                "max_batch_size": max(self._sizes, default=0),
                "batch_sizes": dict(sorted(self._sizes.items())),
                "failed": self._failed,
            }
