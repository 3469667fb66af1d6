"""What the server knows of its model and how it answers one request, without the web framework.

``Service`` holds the model's facts (``metadata``), the ``ParallelInference`` that runs it, a
thread pool its requests wait in, and the counters ``/health`` reports. ``answer(body)`` runs
in that pool: it reads the JSON body, asks ParallelInference and writes the JSON answer, so
neither parsing nor a forward pass ever holds up the server's event loop.
"""

from __future__ import annotations

import hashlib
import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from math import inf
from pathlib import Path

import numpy as np
import torch

from dl4py.errors import ConfigError, DataError
from dl4py.export.wrapper import example_shape
from dl4py.inference import ParallelInference
from dl4py.inference.parallel_inference import INLINE_SECONDS
from dl4py.nn import load
from dl4py.run_dir import MODEL
from dl4py.serve.body import read_features

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # about 500 MNIST images as JSON text
DEFAULT_QUEUE_TIMEOUT = 10.0
DEFAULT_BODY_TIMEOUT = 10.0  # the longest pause while a body arrives
# Bodies up to this size are read in the event loop (a few MNIST images as JSON, well under a
# millisecond to parse); larger ones in a pool thread, so that one large body never holds up
# the other connections.
LOOP_BODY_BYTES = 64 * 1024


def load_model(path, backend=None):
    """A saved model (``model.dl4py``, or a run directory holding one), as ``dl4py predict`` reads it."""
    path = Path(path)
    return load(path / MODEL if path.is_dir() else path, backend=backend)


class Service:
    """One model behind the server: its metadata, its ParallelInference, its request pool."""

    def __init__(self, model, *, model_file=None, workers: int = 1, devices=None, inference_mode: str = "batched",
                 batch_limit: int = 32, queue_limit: int = 64, queue_timeout: float = DEFAULT_QUEUE_TIMEOUT,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, body_timeout: float = DEFAULT_BODY_TIMEOUT,
                 input_shape=None, labels=None, runtime: str = "auto", inline_seconds: float = INLINE_SECONDS):
        for name, value in (("max_body_bytes", max_body_bytes), ("queue_limit", queue_limit)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, f"must be a whole number >= 1, got {value!r}")
        if isinstance(queue_timeout, bool) or not isinstance(queue_timeout, (int, float)) or queue_timeout < 0:
            raise ConfigError("queue_timeout", f"must be seconds >= 0, got {queue_timeout!r}")
        if isinstance(body_timeout, bool) or not isinstance(body_timeout, (int, float)) or not 0 < body_timeout < inf:
            raise ConfigError("body_timeout", f"must be seconds > 0, got {body_timeout!r}")
        self.model = model
        signature = model.signature()
        self.example_shape = _example_shape(model, signature, input_shape)
        outputs = _output_width(model, signature, self.example_shape)
        self.classifier = signature.classifier
        self.labels = _checked_labels(labels, outputs, self.classifier)
        self.max_body_bytes, self.queue_limit, self.queue_timeout = max_body_bytes, queue_limit, float(queue_timeout)
        self.body_timeout = float(body_timeout)
        self.model_version = _weights_digest(model)
        self.metadata = {
            "model": Path(model_file).name if model_file else type(model).__name__,
            "model_version": self.model_version,
            "epochs": model.epoch_count, "iterations": model.iteration_count,
            "input_shape": list(self.example_shape),
            "outputs": outputs,
            "kind": "classifier" if self.classifier else "regressor",
            "labels": self.labels,
            "inference": {"mode": inference_mode, "workers": workers, "batch_limit": batch_limit,
                          "queue_limit": queue_limit, "queue_timeout": self.queue_timeout},
            "max_body_bytes": max_body_bytes,
        }
        # Admitted requests never outnumber queue_limit (the server holds the rest), so
        # ParallelInference's own queue of that size never makes a pool thread wait for room.
        self.inference = ParallelInference(model, workers=workers, devices=devices, inference_mode=inference_mode,
                                           batch_limit=batch_limit, queue_limit=queue_limit, queue_timeout=None,
                                           runtime=runtime, inline_seconds=inline_seconds)
        self.metadata["inference"]["runtime"] = self.inference.runtime
        self.pool = ThreadPoolExecutor(queue_limit, thread_name_prefix="dl4py-serve")
        self.draining = False
        self._lock = threading.Lock()
        self._counts = {"received": 0, "answered": 0, "in_flight": 0, "refused": 0}

    def answer(self, body: bytes) -> bytes:
        """The JSON answer to one ``/predict`` body (in a pool thread). RequestError for a
        body the model cannot take; DataError and InferenceError as ParallelInference raises them."""
        return self.encode(self.inference.output(read_features(body, self.example_shape)))

    def submit(self, body: bytes) -> Future:
        """For a small body, in the event loop: its features read and given to ParallelInference,
        the future of their outputs (``encode`` makes the answer): done already where the pass was
        short and ran here, else the replicas' threads answer it, merging what waits. Parsing a
        few kilobytes costs less than handing the body to a pool thread and the outputs back."""
        return self.inference.submit(read_features(body, self.example_shape))

    def reads_in_loop(self, body: bytes) -> bool:
        """Whether ``submit`` may take ``body`` in the event loop: a small one, and a mode in
        which the replicas run in their own threads (inplace runs them in the caller's)."""
        return len(body) <= LOOP_BODY_BYTES and self.inference.inference_mode != "inplace"

    def encode(self, outputs: torch.Tensor) -> bytes:
        """The JSON answer for the model's ``outputs`` of one request."""
        outputs = outputs.detach()
        if outputs.device.type != "cpu" or outputs.dtype != torch.float32:
            outputs = outputs.to("cpu", torch.float32)
        values = outputs.numpy()
        if self.classifier:
            classes = _classes(values)
            record = {"predictions": classes.tolist(), "probabilities": values.tolist()}
            if self.labels is not None:
                record["labels"] = [self.labels[c] for c in classes]
        else:
            record = {"predictions": values.tolist()}
        record["model_version"] = self.model_version
        return json.dumps(record).encode("utf-8")

    def enter(self) -> bool:
        """A ``/predict`` request arrives: True when it is taken (it will get its answer),
        False while draining (it gets 503). Decided under the lock ``drain`` takes, so a
        request is either in flight when the stop begins, and answered, or refused."""
        with self._lock:
            if self.draining:
                self._counts["refused"] += 1
                return False
            self._counts["received"] += 1
            self._counts["in_flight"] += 1
            return True

    def leave(self) -> None:
        """A request taken by ``enter`` has its answer."""
        with self._lock:
            self._counts["in_flight"] -= 1
            self._counts["answered"] += 1

    def drain(self) -> int:
        """Take no more requests; the number still in flight, which will be answered."""
        with self._lock:
            self.draining = True
            return self._counts["in_flight"]

    def counts(self) -> dict:
        """``received`` (taken), ``answered``, ``in_flight`` and ``refused`` (while draining)."""
        with self._lock:
            return dict(self._counts)

    def close(self) -> None:
        """After the last request: stop ParallelInference and the pool's threads."""
        self.inference.close()
        self.pool.shutdown(wait=True, cancel_futures=True)


def _example_shape(model, signature, input_shape) -> tuple[int, ...]:
    if input_shape is not None:
        shape = tuple(input_shape) if isinstance(input_shape, (list, tuple)) else (input_shape,)
        if not shape or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape):
            raise ConfigError("input_shape", f"must be one example's shape, whole numbers >= 1, got {input_shape!r}")
        return shape
    if signature.input_shape is None:
        raise ConfigError("input_shape", f"a {type(model).__name__} has no config to read its input shape from; "
                                         "give input_shape=(...), one example's shape")
    try:
        return example_shape(model)
    except DataError as exc:
        raise DataError(f"dl4py serve: {exc}") from None


def _output_width(model, signature, shape) -> int:
    """The number of output columns; a graph with several outputs cannot be served (yet)."""
    outputs = signature.outputs
    if len(outputs) > 1:
        raise DataError(f"dl4py serve takes a model with one output; this graph has {len(outputs)} "
                        "(serve each through its own ParallelInference in Python)")
    if outputs[0].size is not None:
        return outputs[0].size
    model.init()
    with torch.no_grad():  # a TorchModel: one example of zeros tells
        return int(model.output(np.zeros((1, *shape), dtype=np.float32)).shape[-1])


def _classes(values: np.ndarray) -> np.ndarray:
    """As ``Model.predict``: the highest output's index; a one-column output (a sigmoid's
    probability of class 1) is 1 where it reaches 0.5."""
    if values.ndim == 1 or values.shape[-1] == 1:
        return (values.reshape(values.shape[0]) >= 0.5).astype(np.int64)
    return values.argmax(axis=-1)


def _checked_labels(labels, outputs: int, classifier: bool):
    if labels is None:
        return None
    labels = [str(label) for label in labels]
    classes = 2 if outputs == 1 else outputs
    if not classifier or len(labels) != classes:
        kind = f"{classes} classes" if classifier else "no classes (a regressor)"
        raise ConfigError("labels", f"{len(labels)} class labels given, but the model has {kind}")
    return labels


def _weights_digest(model) -> str:
    """The first 12 hex digits of the sha256 of the model's weights (names, shapes, bytes):
    the same for a model and its saved file, different once it trains further."""
    model.init()
    digest = hashlib.sha256()
    for name, tensor in model.module.state_dict().items():
        tensor = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:12]
