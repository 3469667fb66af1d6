"""Model: what the trainers need from a network, shared by MultiLayerNetwork and TorchModel.

A model owns a torch module, its optimizer, a loss, the backend it runs on, a precision
policy, and its training counters (epochs, iterations, position in the current epoch).
``fit``, ``output``, ``score``, ``evaluate`` and ``save`` are the same for every model.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Iterable

import numpy as np
import torch
from torch import nn

from dl4py.backend import Backend, Precision, resolve_backend, resolve_precision
from dl4py.data.dataset import DataSet
from dl4py.errors import BackendError, DataError
from dl4py.nn.master_weights import MasterWeights
from dl4py.nn.memory_format import to_channels_last, use_channels_last

if TYPE_CHECKING:
    from dl4py.eval import Evaluation


class Model:
    kind = "model"

    def __init__(self, backend: str | Backend | None = None, precision: str | Precision | None = None):
        self._requested_backend = backend
        self._requested_precision = precision
        self.backend: Backend | None = None
        self.precision: Precision | None = None
        self.module: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.seed = 0  # seeds in-step randomness (dropout) per epoch
        self.master = None  # MasterWeights when the precision keeps float32 masters
        self.scaler = None  # GradScaler when the precision scales the loss
        self.epoch_count = 0  # completed epochs
        self.iteration_count = 0  # minibatches trained on
        self.update_count = 0  # updates applied (fewer when loss scaling skipped some)
        self.batch_in_epoch = 0  # batches done in the current, unfinished epoch
        self._last_score: torch.Tensor | None = None
        self._stop_reason: str | None = None
        self._train_step = None
        self._compiled = None  # (settings, torch.compile'd module) when the environment asks
        self._channels_last = False  # convolutions in NHWC (environment setting channels_last)
        self._device_data = None  # DeviceDataSetIterator: fit keeps the device copy between calls

    @property
    def update_count(self) -> int:
        """Updates applied. Under loss scaling without a schedule the step counts them on the
        device, so it need not wait for the GPU; they are added up here, when asked for."""
        pending = self.__dict__.get("_pending_updates")
        if pending is not None:
            self._update_count += int(pending)
            self._pending_updates = None
        return self._update_count

    @update_count.setter
    def update_count(self, value: int) -> None:
        self._update_count, self._pending_updates = int(value), None

    def count_updates_later(self, applied: torch.Tensor) -> None:
        """Add 1 (``applied`` true) or 0 to ``update_count`` without reading the device now."""
        applied = applied.to(torch.int64)
        pending = self.__dict__.get("_pending_updates")
        self._pending_updates = applied if pending is None else pending + applied

    def __getstate__(self):
        # Sent to a parallel worker as its recipe: the built module, optimizer and step
        # are rebuilt there on the worker's device (weights follow in a saved model file).
        self.update_count  # pending device counts become a number that pickles anywhere
        state = dict(self.__dict__)
        for name in ("module", "optimizer", "master", "scaler", "_train_step", "_compiled", "backend",
                     "precision", "_device_data"):
            state[name] = None
        return state

    # ---- hooks for subclasses ---------------------------------------------------------
    def _build(self, device: torch.device, dtype: torch.dtype) -> tuple[nn.Module, torch.optim.Optimizer]:
        raise NotImplementedError

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def activate(self, outputs: torch.Tensor) -> torch.Tensor:
        """Module outputs -> predictions (the output layer's activation)."""
        return outputs

    def learning_rate_at(self, updates: int, epochs: int) -> float | None:
        """Scheduled learning rate, or None to leave the optimizer's own learning rate alone."""
        return None

    def check_features(self, features: torch.Tensor, where: str) -> None:
        """Raise DataError when ``features`` cannot go into this network."""

    def check_labels(self, labels: torch.Tensor, where: str) -> None:
        """Raise DataError when ``labels`` do not fit the output layer."""

    def check_data(self, iterator) -> None:
        """Raise DataError when any label of ``iterator`` does not fit the output layer. Called
        once before training: it reads what the iterator found when it loaded its data
        (``max_label``), so it costs nothing per step."""

    # ---- life cycle -------------------------------------------------------------------
    def init(self) -> "Model":
        """Create the parameters on the chosen backend, in the chosen precision. Idempotent."""
        if self.module is not None:
            return self
        from dl4py.backend.cuda_environment import environment

        env = environment()
        env.apply()  # process-wide settings first: some must precede CUDA's start
        backend = self._requested_backend
        self.backend = backend if isinstance(backend, Backend) else resolve_backend(backend)
        self.precision = resolve_precision(self._requested_precision)
        env.apply(self.backend.device)  # per-device settings (memory cap)
        self._check_precision_supported()
        precision, device = self.precision, self.backend.device
        build_dtype = torch.float32 if precision.master_weights else precision.param_dtype
        module, self.optimizer = self._build(device, build_dtype)
        self._channels_last = use_channels_last(env.channels_last, module, device)
        if self._channels_last:  # before the master copy is made, so both are NHWC
            module = module.to(memory_format=torch.channels_last)
        if precision.master_weights:
            self.master = MasterWeights(module, precision.param_dtype)
            module = self.master.module
        self.module = module
        self.scaler = precision.make_scaler(device)
        return self

    def _check_precision_supported(self) -> None:
        device, precision = self.backend.device, self.precision
        if device.type == "cuda":
            name = torch.cuda.get_device_name(device)
            major, minor = torch.cuda.get_device_capability(device)
            # Not torch.cuda.is_bf16_supported(): it counts emulation, so says yes for every
            # GPU, and asks about the current device, not this one. bf16 arithmetic is Ampere's.
            if precision.uses_bf16 and (major, minor) < (8, 0):
                raise BackendError(
                    f"precision '{precision}' needs bfloat16, which {name} (compute capability "
                    f"{major}.{minor}) does not support; use 'half' or 'mixed-fp16'"
                )
            if precision.uses_fp16 and (major, minor) < (5, 3):
                raise BackendError(
                    f"precision '{precision}' needs float16 arithmetic, which {name} (compute "
                    f"capability {major}.{minor}) lacks; use 'float'"
                )
        elif precision.uses_fp16:
            _warn_once(
                "cpu-fp16",
                f"precision '{precision}' on the CPU: PyTorch has no fast float16 kernels for CPUs, "
                "so this runs many times slower than float; 'bfloat16' or 'mixed-bf16' is the fast "
                "16-bit choice on a CPU",
            )

    @property
    def device(self) -> torch.device:
        self.init()
        return self.backend.device

    def num_params(self) -> int:
        self.init()
        return sum(p.numel() for p in self.module.parameters())

    # ---- training ----------------------------------------------------------------------
    def fit(self, data, epochs: int = 1, listeners: Iterable = (), batch_size: int | None = None):
        """Train for ``epochs`` more epochs on a DataSetIterator (or a DataSet / (x, y) pair).

        Returns the list of per-epoch summaries. Ctrl-C stops after the current step,
        leaves the model consistent and raises ``TrainingInterrupted``.
        """
        from dl4py.train.loop import fit

        iterator = as_iterator(data, batch_size)
        self.check_data(iterator)  # every label, before the first step rather than at a torch error
        return fit(self, iterator, epochs, list(listeners))

    def request_stop(self, reason: str) -> None:
        """Ask the running ``fit`` to stop after the current step (used by early stopping)."""
        self._stop_reason = reason

    def score(self, data=None) -> float:
        """Loss of the last training minibatch (DL4J's ``score()``), or mean loss on ``data``."""
        if data is None:
            if self._last_score is None:
                raise RuntimeError("score(): the model has not been trained yet; pass data to score it")
            return float(self._last_score)
        total, count = 0.0, 0
        with self._inference():
            for batch in as_iterator(data, None):
                x, y = self._prepare(batch)
                with self.precision.forward_context(self.backend.device):
                    total += float(self.loss(self.module(x), y)) * x.shape[0]
                count += x.shape[0]
        return total / max(count, 1)

    # ---- inference ---------------------------------------------------------------------
    def output(self, features, batch_size: int = 4096) -> torch.Tensor:
        """Predictions for ``features`` (numpy or tensor, ``[n, ...]``), on the model's device."""
        self.init()
        x = _as_tensor(features, "features")
        self.check_features(x, "output(features)")
        outs = []
        with self._inference():
            for start in range(0, x.shape[0], batch_size):
                chunk = self._convert_input(x[start : start + batch_size].to(self.backend.device))
                with self.precision.forward_context(self.backend.device):
                    outs.append(self.activate(self.module(chunk)))
        return torch.cat(outs) if outs else torch.empty(0, device=self.backend.device)  # where outputs live

    def evaluate(self, data) -> "Evaluation":
        """Classification statistics over every batch of ``data``."""
        from dl4py.eval import Evaluation

        evaluation = Evaluation()
        with self._inference():
            for batch in as_iterator(data, None):
                x, y = self._prepare(batch)
                with self.precision.forward_context(self.backend.device):
                    scores = self.module(x)
                evaluation.eval(y, scores)
        return evaluation

    def _prepare(self, batch: DataSet) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.backend.device
        # Asynchronous only towards a GPU, where the stream orders the copy before its use;
        # a GPU-to-CPU copy would be read by the CPU before it lands.
        non_blocking = device.type == "cuda"
        x = self._convert_input(batch.features.to(device, non_blocking=non_blocking))
        return x, batch.labels.to(device, non_blocking=non_blocking)

    def _convert_input(self, x: torch.Tensor) -> torch.Tensor:
        """Features on the device -> the precision's dtype and the module's memory format."""
        x = self.precision.convert_input(x)
        return to_channels_last(x) if self._channels_last else x

    def _inference(self):
        self.init()
        return _InferenceMode(self.module)

    # ---- persistence ---------------------------------------------------------------------
    def save(self, path, save_updater: bool = True) -> None:
        """Write the model (config, weights, updater state, counters) atomically to ``path``."""
        from dl4py.nn.serialization import save_model

        save_model(self, path, save_updater=save_updater)


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logging.getLogger("dl4py").warning("dl4py: %s", message)


class _InferenceMode:
    """Eval mode and no grad for the duration; restores the module's previous mode."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __enter__(self):
        self.was_training = self.module.training
        self.module.eval()
        self.no_grad = torch.no_grad()
        self.no_grad.__enter__()

    def __exit__(self, *exc):
        self.no_grad.__exit__(*exc)
        self.module.train(self.was_training)


def _as_tensor(value, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        tensor = torch.from_numpy(value)
        return tensor.float() if tensor.is_floating_point() else tensor
    raise DataError(f"{name} must be a torch tensor or numpy array, got {type(value).__name__}")


def as_iterator(data, batch_size: int | None):
    """Accept a DataSetIterator, a DataSet, or a (features, labels) pair."""
    from dl4py.data import ArrayDataSetIterator, DataSetIterator

    if isinstance(data, DataSetIterator):
        if batch_size is not None:
            raise ValueError("batch_size applies to arrays; a DataSetIterator has its own batch size")
        return data
    if isinstance(data, DataSet):
        features, labels = data.features, data.labels
    elif isinstance(data, (tuple, list)) and len(data) == 2:
        features, labels = _as_tensor(data[0], "features"), _as_tensor(data[1], "labels")
    else:
        raise DataError(
            f"expected a DataSetIterator, a DataSet or a (features, labels) pair, got {type(data).__name__}"
        )
    return ArrayDataSetIterator(
        features, labels, batch_size=batch_size or max(len(features), 1), shuffle=False
    )
