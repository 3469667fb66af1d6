"""Model: what the trainers need from a network, shared by MultiLayerNetwork and TorchModel.

A model owns a torch module, its optimizer, a loss, the backend it runs on, a precision
policy, and its training counters (epochs, iterations, position in the current epoch).
``fit``, ``output``, ``score``, ``evaluate`` and ``save`` are the same for every model.

``init`` builds in torchtitan's order: the module (``_build_module``), then a distributed
plan's conversion of it where one is given (``init(parallelize=...)``), then the optimizer
over the result (``make_optimizer``), so no optimizer ever steps parameters a plan replaced.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Iterable

import numpy as np
import torch
from torch import nn

from dl4py.backend import Backend, Precision, resolve_backend, resolve_precision
from dl4py.backend.cuda_environment import environment
from dl4py.data.adapters import _array_like  # the test as_iterator applies to an (x, y) pair
from dl4py.data.adapters import as_iterator as adapt
from dl4py.data.dataset import DataSet
from dl4py.data.normalizers import Normalizer
from dl4py.errors import BackendError, ConfigError, DataError
from dl4py.eval.roc import ROC
from dl4py.eval.select import new_evaluation, new_roc
from dl4py.nn.cpu_precision import slow_dtype, slow_precision_message
from dl4py.nn.memory_format import to_channels_last, use_channels_last
from dl4py.nn.predict import InferenceState, predictions, probabilities
from dl4py.nn.serialization import KERNEL_KEYS, save_model
from dl4py.nn.signature import Signature
from dl4py.nn.training_state import TrainingState
from dl4py.train import accumulate, loop
from dl4py.train.progress import batches_of, console_listeners
from dl4py.train.step import make_train_step
from dl4py.train.validation import split_validation

if TYPE_CHECKING:
    from dl4py.eval import Evaluation
    from dl4py.train.history import History


class Model:
    kind = "model"
    # The fitted Normalizer applied to raw features on the device (set_normalizer); saved in
    # the model file. A class default, so models unpickled from before it existed have one.
    normalizer = None
    # Batches whose gradients make one update (set_accumulate_batches); a class default too.
    accumulate_batches = 1
    # How a sharded or tensor-parallel worker's replica is laid out across the ranks
    # (parallel.sharding.ShardedReplica, parallel.tensor_replica.TensorParallelReplica); else None.
    parallel_layout = None
    # What inference passes keep between calls (nn.predict.InferenceState), made at the first;
    # and whether one left the module in eval mode, for train_step to switch back. Class
    # defaults too.
    _inference_state = None
    _left_in_eval = False
    # compile: auto's choice for the last fit (train/compile_choice.py); None before one.
    compile_choice = None

    def __init__(self, backend: str | Backend | None = None, precision: str | Precision | None = None):
        self._requested_backend = backend
        self._requested_precision = precision
        self.backend: Backend | None = None
        self.precision: Precision | None = None
        self.module: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.seed = 0  # seeds in-step randomness (dropout) per batch: train/randomness.py
        # The precision's mechanics (float32 masters, loss scaler, skipped steps): Precision.bind.
        self.precision_state = None
        self.training_state = TrainingState()  # counters and last score, moved by the trainers
        self._stop_reason: str | None = None
        self._train_step = None  # made at the first train_step, for this model's state
        self._gradient_hook = None  # share_gradients: runs between backward and update
        self._channels_last = False  # convolutions in NHWC (environment setting channels_last)
        # The data set copy on the device that fit keeps between calls (DeviceDataSetIterator).
        self.device_data = None

    def __getstate__(self):
        # Sent to a parallel worker as its recipe: the built module, optimizer and step
        # are rebuilt there on the worker's device (weights follow in a saved model file).
        state = dict(self.__dict__)
        for name in ("module", "optimizer", "precision_state", "_train_step", "_gradient_hook", "backend",
                     "precision", "device_data", "parallel_layout", "_inference_state", "compile_choice"):
            state[name] = None
        return state

    def place(self, backend: str | Backend | None, precision: str | Precision | None) -> None:
        """Choose, before ``init``, the backend and precision the model is built for (a
        parallel worker builds its replica on its own device)."""
        if self.module is not None:
            raise RuntimeError("place(): the model is already built; call it before init()")
        self._requested_backend, self._requested_precision = backend, precision

    # ---- hooks for subclasses ---------------------------------------------------------
    def _build_module(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        raise NotImplementedError

    def _make_optimizer(self, module: nn.Module, plain_name: Callable[[str], str]) -> torch.optim.Optimizer:
        """An optimizer over ``module``'s parameters (the stepped module: a distributed plan's
        once converted, ``plain_name`` then giving each parameter's name in the plain module)."""
        raise NotImplementedError

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def activate(self, outputs: torch.Tensor) -> torch.Tensor:
        """Module outputs -> predictions (the output layer's activation)."""
        return outputs

    def learning_rate_at(self, updates: int, epochs: int) -> float | None:
        """Scheduled learning rate, or None to leave the optimizer's own learning rate alone."""
        return None

    def signature(self) -> Signature:
        """What a caller may know without probing: input shape, inputs, outputs (width, class
        indices or regression values), the model kind (``dl4py.nn.signature``). Serve, export,
        ``predict``, ParallelInference and the monitor read it."""
        raise NotImplementedError(f"{type(self).__name__} does not say its signature()")

    def check_features(self, features: torch.Tensor, where: str) -> None:
        """Raise DataError when ``features`` cannot go into this network. It may read their
        dtype and shape past the first axis, nothing else: ``output`` checks each such kind
        of input once."""

    def check_labels(self, labels: torch.Tensor, where: str) -> None:
        """Raise DataError when ``labels`` do not fit the output layer."""

    def check_data(self, iterator) -> None:
        """Raise DataError when any label of ``iterator`` does not fit the output layer. Called
        once before training: it reads what the iterator found when it loaded its data
        (``max_label``), so it costs nothing per step."""

    # ---- life cycle -------------------------------------------------------------------
    def init(self, parallelize=None) -> "Model":
        """Create the parameters on the chosen backend, in the chosen precision, then the
        optimizer over them. Idempotent.

        ``parallelize(model)``: a distributed plan's conversion, run between the two in
        torchtitan's order: it converts the built module through ``convert`` while the model
        has no optimizer yet, and returns ``make_optimizer``'s keywords for the result (or
        None); the optimizer is then made over the converted parameters. A plan that fails
        leaves the model unbuilt."""
        if self.module is not None:
            if parallelize is not None:
                raise RuntimeError("init(parallelize=...): the model is already built; parallelize a model before init")
            return self

        env = environment()
        env.apply()  # process-wide settings first: some must precede CUDA's start
        backend = self._requested_backend
        self.backend = backend if isinstance(backend, Backend) else resolve_backend(backend)
        self.precision = resolve_precision(self._requested_precision)
        env.apply(self.backend.device)  # per-device settings (memory cap)
        self._check_precision_supported()
        precision, device = self.precision, self.backend.device
        build_dtype = torch.float32 if precision.master_weights else precision.param_dtype
        module = self._build_module(device, build_dtype)
        wanted = use_channels_last(env.channels_last, module, device,
                                   sixteen_bit=precision.uses_fp16 or precision.uses_bf16)
        # FSDP2 and DTensor take contiguous parameters only: a distributed plan trains NCHW.
        self._channels_last = wanted and parallelize is None
        if self._channels_last:  # before the master copy is made, so both are NHWC
            module = module.to(memory_format=torch.channels_last)
        self.precision_state = precision.bind(module, device)
        self.module = self.precision_state.module
        self.optimizer = self.make_optimizer(**self._parallelized(parallelize))
        return self

    def _parallelized(self, parallelize) -> dict:
        """Run a distributed plan's conversion of the built module (``init``); its keywords for
        ``make_optimizer``."""
        if parallelize is None:
            return {}
        try:
            return parallelize(self) or {}
        except BaseException:
            self.module = self.precision_state = None  # unbuilt again: no half-converted module stays
            raise

    def make_optimizer(self, *, loop: bool = False, plain_name: Callable[[str], str] | None = None
                       ) -> torch.optim.Optimizer:
        """A new optimizer, without state, over the stepped module's parameters as they are now,
        made as this model makes its optimizer (its updater config; a TorchModel's factory, or
        its optimizer made again from its class, defaults and groups). A distributed plan
        asks for one after converting the module: ``loop`` for torch's for-loop kernel, which
        steps parameter by parameter, and ``plain_name(name)`` where it renamed parameters."""
        optimizer = self._make_optimizer(self.precision_state.stepped_module, plain_name or _same_name)
        return _for_loop(optimizer) if loop else optimizer

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
        elif (slow := slow_dtype(precision, device)) is not None:
            _warn_once(f"cpu-{slow}", slow_precision_message(precision, slow))

    # ---- where training stands (read-only: trainers move ``training_state``) ----------------
    @property
    def epoch_count(self) -> int:
        """Completed epochs."""
        return self.training_state.epoch

    @property
    def iteration_count(self) -> int:
        """Minibatches trained on."""
        return self.training_state.iteration

    @property
    def update_count(self) -> int:
        """Updates applied (fewer when loss scaling skipped some, or batches were accumulated)."""
        return self.training_state.updates

    @property
    def batch_in_epoch(self) -> int:
        """Batches done in the current, unfinished epoch (where a resumed fit continues)."""
        return self.training_state.batch_in_epoch

    @property
    def stepped_module(self) -> nn.Module:
        """The module whose parameters the optimizer steps: the float32 masters where the
        precision keeps them, else the module itself."""
        self.init()
        return self.precision_state.stepped_module

    @property
    def device(self) -> torch.device:
        self.init()
        return self.backend.device

    def num_params(self) -> int:
        self.init()
        return sum(p.numel() for p in self.module.parameters())

    # ---- training ----------------------------------------------------------------------
    def fit(self, x, y=None, batch_size: int | None = None, epochs: int | None = None, *,
            listeners: Iterable = (), callbacks: Iterable | None = None, validation=None,
            validation_split: float | None = None, metrics=None, shuffle: bool | None = None, label=None,
            features=None, verbose="auto", accumulate_batches: int | None = None, normalizer=None) -> "History":
        """Train for ``epochs`` (default 1) more epochs on ``x`` and its labels ``y``, as Keras'
        ``fit(x, y, batch_size, epochs)`` (arrays, tensors, pandas: batches of ``batch_size``,
        32 by default, shuffled each epoch), or on data that carries its labels, ``y`` left out:
        a DataSetIterator, a DataSet, an ``(x, y)`` pair, a DataFrame with ``label=``, a
        DataLoader, ... (``dl4py.data.adapters``). ``fit(iterator, 5)`` is DL4J's
        ``fit(iterator, numEpochs)``.

        ``validation`` (the same kinds of data) or ``validation_split`` (a fraction of the
        training data, held out by a seeded permutation) scores the model after each epoch:
        ``val_loss`` and ``val_<metric>`` for each of ``metrics`` (default: accuracy for a
        classifier). The training batches give ``loss`` and, where the metrics include it,
        ``accuracy`` (from the step's own outputs). Returns a ``History`` (Keras' shape:
        ``history.history["val_accuracy"]``). ``listeners`` (DL4J's name) or ``callbacks``
        (Keras'): TrainingListeners, e.g. ``EarlyStopping`` and ``ModelCheckpoint``. Ctrl-C
        stops after the current step, leaves the model consistent and raises
        ``TrainingInterrupted``. ``verbose`` (Keras'): 0 silent, 1 a progress bar, 2 a line
        per epoch, "auto" a bar on a terminal or in a notebook, else lines (``train/progress.py``).
        ``accumulate_batches`` (k): sum the gradients of k batches into each update, as
        ``set_accumulate_batches`` does (it stays set for later fits; None keeps the setting).
        ``normalizer`` (an unfitted ``dl4py.data.normalizers`` one): fitted here on the training
        rows only, after ``validation_split`` has held its rows out, then set on the model (as a
        run config's ``data.normalizer``); one fitted beforehand on all of the data would have
        seen the held-out rows.
        """

        data, epochs = _data_and_epochs(x, y, epochs)
        listeners = list(listeners)
        if callbacks is not None:
            if listeners:
                raise ConfigError("callbacks", "is Keras' name for listeners=; give one of them, not both")
            listeners = list(callbacks)
        if accumulate_batches is not None:  # before the data is read: a wrong value fails first
            self.set_accumulate_batches(accumulate_batches)

        # Arrays, DataFrames and Datasets are batched by dl4py (32 by default) and shuffled each
        # epoch by the model's seed; label=/features= name columns (docs/data.md).
        iterator = as_iterator(data, batch_size, shuffle=shuffle, seed=self.seed, label=label,
                               features=features, training=True)
        if validation is not None and validation_split is not None:
            raise ConfigError("validation_split", "give validation= or validation_split=, not both")
        if validation_split is not None:
            iterator, validation = split_validation(iterator, validation_split)
        elif validation is not None:
            validation = as_iterator(validation, None, label=label, features=features)
        if normalizer is not None:
            self.set_normalizer(_fitted_on(normalizer, iterator))
        self.check_data(iterator)  # every label, before the first step rather than at a torch error
        if validation is not None:
            self.check_data(validation)  # not found wrong only after an epoch of training
        total = self.epoch_count + epochs if isinstance(epochs, int) else None  # a wrong one: fit says so
        listeners += console_listeners(verbose, total, batches_of(iterator), listeners)
        return loop.fit(self, iterator, epochs, listeners, validation=validation,
                   metrics=None if metrics is None else list(metrics))

    # ---- what trainers use (the single-device loop, parallel workers) ----------------------
    def train_step(self, features: torch.Tensor | None, labels: torch.Tensor | None,
                   observe=None) -> torch.Tensor | None:
        """One minibatch forward, backward and update (``dl4py.train.step``), on prepared
        inputs (``prepare_batch``). Returns the loss, detached and on the device: reading it
        is the caller's choice, so a step never waits for the GPU. ``(None, None)``: a
        parallel worker without a batch this round applies the shared update only.
        ``observe(outputs, labels)``, when given, sees the batch's outputs (training metrics)."""
        if self._train_step is None:

            self._train_step = make_train_step(self, gradient_hook=self._gradient_hook)
        if self._left_in_eval:  # an inference pass left it there (_inference): training resumes here
            self.module.train()
            self._left_in_eval = False
        loss = self._train_step(features, labels, observe)
        if loss is not None:
            self.training_state.set_score(loss)
        return loss

    def set_accumulate_batches(self, batches: int) -> "Model":
        """Make each update from the summed gradients of ``batches`` consecutive batches, as
        one step on their union would (``training.accumulate_batches``; docs/training.md).
        1 (the default) updates after every batch. Returns the model."""

        batches = accumulate.checked_batches(batches, "accumulate_batches")
        if batches != self.accumulate_batches:
            accumulate.finish(self)  # an open window is applied, not lost
            self.accumulate_batches = batches
            self._train_step = None  # rebuilt for the new setting
        return self

    def discard_train_step(self) -> None:
        """Make the step again at the next ``train_step`` (``compile: auto`` chose to compile)."""
        self._train_step = None

    def share_gradients(self, hook) -> None:
        """Run ``hook(took_part)`` between backward and update in every step from now on (a
        parallel trainer averages the gradients there); None removes it."""
        self._gradient_hook = hook
        self._train_step = None

    def convert(self, *, module=None, optimizer=None, precision_state=None, loss=None) -> None:
        """A parallel plan's conversion of this replica (``parallel/sharding.py``,
        ``parallel/tensor_parallel.py``): the parts it replaced (the module that runs, the
        optimizer over its parameters, the precision state, the loss); the step is made again."""
        if module is not None:
            self.module = module
        if optimizer is not None:
            self.optimizer = optimizer
        if precision_state is not None:
            self.precision_state = precision_state
        if loss is not None:
            self.loss = loss
        self._train_step = None

    def use_contiguous_layout(self) -> None:
        """Store the convolutions NCHW again (``channels_last`` undone), before a distributed
        plan converts a built replica: FSDP2 and DTensor take contiguous parameters only. The
        optimizer keeps its parameters (their storage changes in place); the plan makes it again."""
        if not self._channels_last:
            return
        for module in {id(m): m for m in (self.module, self.stepped_module)}.values():
            module.to(memory_format=torch.contiguous_format)
        self._channels_last = False
        self._train_step = None

    def lay_out(self, layout) -> None:
        """Train as ``layout`` (a ``parallel.layout.DistributedLayout``) lays this replica out
        across the ranks; None: a plain replica."""
        self.parallel_layout = layout

    @property
    def last_score(self) -> torch.Tensor | None:
        """The loss of the last training minibatch (or the workers' averaged loss), a tensor
        that may still be on the device; None before any training."""
        return self.training_state.score

    def set_score(self, score) -> None:
        """Replace the last score (a parallel trainer's average over its workers)."""
        self.training_state.set_score(score)

    def request_stop(self, reason: str) -> None:
        """Ask the running ``fit`` to stop after the current step (used by early stopping)."""
        self._stop_reason = reason

    @property
    def stop_reason(self) -> str | None:
        """Why a stop was requested during the running fit, or None."""
        return self._stop_reason

    def clear_stop_request(self) -> None:
        self._stop_reason = None

    def score(self, data=None, *, batch_size: int | None = None, label=None, features=None) -> float:
        """Loss of the last training minibatch (DL4J's ``score()``), or mean loss on ``data``."""
        if data is None:
            if self.training_state.score is None:
                raise RuntimeError("score(): the model has not been trained yet; pass data to score it")
            return float(self.training_state.score)
        total, count = 0.0, 0
        with self._inference():
            for batch in as_iterator(data, batch_size, label=label, features=features):
                x, y = self.prepare_batch(batch)
                with self.precision.forward_context(self.backend.device):
                    total += float(self.loss(self.module(x), y)) * x.shape[0]
                count += x.shape[0]
        return total / max(count, 1)

    # ---- inference ---------------------------------------------------------------------
    def output(self, features, batch_size: int = 4096, *, label=None) -> torch.Tensor:
        """Predictions for ``features`` (numpy or tensor ``[n, ...]``, or any data ``fit`` takes:
        its labels, or a DataFrame's ``label`` column, are left out), on the model's device.
        The module stays in eval mode afterwards (``fit`` and ``train_step`` switch it back)."""
        self.init()
        if not isinstance(features, (torch.Tensor, np.ndarray)):
            # Read as the data comes (an iterator has its own batches); batch_size is the forward's.
            features = torch.cat([b.features for b in as_iterator(features, None, label=label, labelled=False)])
        x = _as_tensor(features, "features")
        state = self._inference_now()
        state.check(self, x, "output(features)")
        self.set_mask(None)  # whole sequences: a training batch's mask must not apply
        with self._inference(state):
            if 0 < x.shape[0] <= batch_size:  # one pass: no slice, no copy into a concatenation
                return self._forward_for_output(x, state)
            outs = [self._forward_for_output(x[start : start + batch_size], state)
                    for start in range(0, x.shape[0], batch_size)]
        return torch.cat(outs) if outs else torch.empty(0, device=self.backend.device)  # where outputs live

    def _forward_for_output(self, x: torch.Tensor, state: InferenceState) -> torch.Tensor:
        chunk = self.prepare_input(x.to(self.backend.device))
        if not state.autocast:
            return self.activate(self.module(chunk))
        with self.precision.forward_context(self.backend.device):
            return self.activate(self.module(chunk))

    def predict(self, data, batch_size: int | None = None, *, label=None) -> np.ndarray:
        """Predictions for ``data`` (anything ``fit`` takes; labels ignored) as numpy: a
        classifier's class index per example (the highest output; a one-column output at 0.5),
        a regressor's output values (regression loss: mse, l1, ...). The model's normalizer
        applies. ``batch_size``: examples per forward pass (default 4096, or the data's own batches).

        Class indices, as scikit-learn's ``predict``: **not** Keras' ``predict``, which returns
        the output layer's probabilities. For those, ``predict_proba(data)`` (numpy) or
        ``output(features)`` (a tensor on the model's device)."""
        return predictions(self, data, batch_size, label)

    def predict_proba(self, data, batch_size: int | None = None, *, label=None) -> np.ndarray:
        """``output(data)`` as numpy: the output layer's activations (class probabilities
        for a softmax output): what Keras' ``predict`` returns."""
        return probabilities(self, data, batch_size, label)

    def evaluate(self, data, *, batch_size: int | None = None, label=None, features=None) -> "Evaluation":
        """Statistics over every batch of ``data``: a ``RegressionEvaluation`` when the output's
        loss is a regression loss (mse, l1, ...: DL4J's ``evaluateRegression``) and the labels
        are not class indices, else a classification ``Evaluation``."""
        return self.evaluate_and_score(data, batch_size=batch_size, label=label, features=features,
                                       loss=False)[0]

    def evaluate_and_score(self, data, *, batch_size: int | None = None, label=None, features=None,
                           loss: bool = True) -> tuple:
        """``(evaluate(data), score(data))`` in one pass over ``data`` (the score None when
        ``loss`` is False): what validation after each epoch needs, at the cost of one."""

        # Made at the first batch, when the labels' kind is known.
        evaluation, mean_loss = self._evaluate_into(data, lambda labels, _: new_evaluation(self, labels),
                                                    batch_size, label, features, loss)
        return evaluation if evaluation is not None else new_evaluation(self), mean_loss

    def evaluate_roc(self, data, threshold_steps: int = 0, *, batch_size: int | None = None, label=None,
                     features=None):
        """DL4J's ``evaluateROC``: a ``ROC`` (AUROC, AUPRC) of a one-column sigmoid or two-column
        softmax output (positive class 1), a one-vs-all ``ROCMultiClass`` for more columns.
        ``threshold_steps`` 0 is exact; N counts at DL4J's N + 1 fixed thresholds instead."""

        # Made at the first batch, when the output's width is known.
        roc, _ = self._evaluate_into(data, lambda _, predictions: new_roc(predictions, threshold_steps),
                                     batch_size, label, features)
        return roc if roc is not None else ROC(threshold_steps)

    def _evaluate_into(self, data, make, batch_size, label, features, loss: bool = False):
        """One pass over ``data``: ``(evaluation, mean loss)``. The evaluation is ``make(labels,
        predictions)`` of the first batch (None for no batch), fed every batch's predictions
        after the output activation; the mean loss is None unless ``loss``."""
        evaluation, count = None, 0
        total = torch.zeros((), dtype=torch.float64, device=self.device)  # read once, at the end
        with self._inference():
            for batch in as_iterator(data, batch_size, label=label, features=features):
                x, y = self.prepare_batch(batch)
                with self.precision.forward_context(self.backend.device):
                    outputs = self.module(x)
                    predictions = self.activate(outputs)
                    if loss:
                        total += self.loss(outputs, y).double() * x.shape[0]
                count += x.shape[0]
                y, predictions = _steps_as_examples(y, predictions, batch)
                if evaluation is None:
                    evaluation = make(y, predictions)
                evaluation.eval(y, predictions)
        return evaluation, (float(total) / max(count, 1) if loss else None)

    def set_normalizer(self, normalizer) -> "Model":
        """Normalize every input from now on (DL4J's ``setPreProcessor`` + ``addNormalizerToModel``):
        ``fit``, ``evaluate``, ``score`` and ``output`` take raw features and the model applies
        ``normalizer`` (fitted, from ``dl4py.data.normalizers``) on its device; ``save`` keeps it.
        None removes it. Returns the model, so ``model.set_normalizer(n).fit(train)`` reads on."""

        if normalizer is not None:
            if not isinstance(normalizer, Normalizer):
                raise TypeError(f"set_normalizer needs a dl4py Normalizer, got {type(normalizer).__name__}")
            if not normalizer.is_fitted:
                raise DataError(f"{type(normalizer).__name__} is not fitted: call .fit(training_data) first")
        self.normalizer = normalizer
        return self

    def prepare_batch(self, batch: DataSet) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch's features and labels on the model's device, features as ``prepare_input``."""
        device = self.backend.device
        # Asynchronous only towards a GPU, where the stream orders the copy before its use;
        # a GPU-to-CPU copy would be read by the CPU before it lands.
        non_blocking = device.type == "cuda"
        x = self.prepare_input(batch.features.to(device, non_blocking=non_blocking))
        mask = getattr(batch, "features_mask", None)
        self.set_mask(None if mask is None else mask.to(device, non_blocking=non_blocking))
        return x, batch.labels.to(device, non_blocking=non_blocking)

    def set_mask(self, mask: torch.Tensor | None) -> None:
        """Use ``mask`` ``[n, time]`` (1 real step, 0 padding) for the next forward passes and
        losses, as DL4J's ``setLayerMaskArrays``; ``prepare_batch`` sets each batch's."""
        if mask is not None:
            raise DataError(f"{type(self).__name__} takes no sequence masks; its batches must have none")

    def prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        """Raw features on the device -> normalized, in the precision's dtype and the module's
        memory format. Every input path (training steps, parallel workers, output) comes here."""
        if self.normalizer is not None:  # before the dtype cast: normalized in float32, not fp16
            x = self.normalizer.transform(x)
        x = self.precision.convert_input(x)
        return to_channels_last(x) if self._channels_last else x

    def _inference(self, state: InferenceState | None = None):
        """A pass over the module for inference: eval mode, left on between passes (``train_step``
        and ``fit`` switch back), under ``torch.no_grad``. Not ``torch.inference_mode``: its
        tensors refuse to be saved for backward, and ``output``'s may feed a network that trains
        (features for a new head), or an evaluation may update them in place later; and once
        the eval/train walk per call was gone it measured within 1% of no_grad on a one-image
        LeNet forward (benchmarks/inference.py), so predict's numpy results gain nothing by it."""
        if (state or self._inference_now()).enter_eval():
            self._left_in_eval = True
        return torch.no_grad()

    def _inference_now(self) -> InferenceState:
        """The inference state of the module and precision policy the model has now."""
        self.init()
        state = self._inference_state
        if state is None or not state.fits(self.module, self.precision):
            state = self._inference_state = InferenceState(self.module, self.precision)
        return state

    # ---- persistence ---------------------------------------------------------------------
    def save(self, path, save_updater: bool = True) -> None:
        """Write the model (config, weights, updater state, counters) atomically to ``path``."""

        save_model(self, path, save_updater=save_updater)


_warned: set[str] = set()


def _same_name(name: str) -> str:
    return name


def _for_loop(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The same optimizer (class, defaults, groups; no state yet) with torch's for-loop kernel.
    A distributed plan's parameters need it: the fused and foreach kernels take DTensors or
    plain tensors, not both in one call, DTensor has no sharding rule for the fused ones, and
    the foreach ones make temporaries of every shard at once (L2's gradient copies: +1/N of
    the weights at a sharded update's peak). Equal within rounding (nn/optimizers.py)."""
    off = {key: False for key in KERNEL_KEYS if key in optimizer.defaults}
    return type(optimizer)([{**group, **off} for group in optimizer.param_groups], **{**optimizer.defaults, **off})


def _steps_as_examples(labels: torch.Tensor, predictions: torch.Tensor, batch):
    """Per-step outputs ``[n, time, k]`` (an rnn_output layer's) as ``[steps, k]`` with their labels,
    the padded steps of a masked batch left out: DL4J's ``evalTimeSeries``; per-pixel outputs
    ``[n, c, h, w]`` (a cnn_loss layer's) as ``[pixels, c]``. Other outputs as they are."""
    if predictions.dim() == 4:
        return (labels.movedim(1, -1).reshape(-1, labels.shape[1]),
                predictions.movedim(1, -1).reshape(-1, predictions.shape[1]))
    if predictions.dim() != 3:
        return labels, predictions
    mask = getattr(batch, "features_mask", None)
    if mask is None:
        return labels.reshape(-1, *labels.shape[2:]), predictions.reshape(-1, predictions.shape[2])
    real = mask.to(predictions.device).bool()
    return labels[real], predictions[real]


def _data_and_epochs(x, y, epochs):
    """``fit``'s data and epochs from its first arguments: ``(x, y)`` for features and labels
    given apart (Keras), ``x`` alone for data that carries its labels, and an int ``y`` as
    the epochs (DL4J's ``fit(iterator, numEpochs)``)."""
    if isinstance(y, int) and not isinstance(y, bool):
        if epochs is not None:
            raise TypeError(f"fit() got the epochs twice: {y} as its second argument and epochs={epochs!r}")
        return x, y
    epochs = 1 if epochs is None else epochs
    if y is None:
        return x, epochs
    if not _arrays(x):
        raise DataError(f"fit(x, y): y goes with features given as arrays, tensors or pandas objects (a list "
                        f"of them for a graph's inputs); x is {type(x).__name__}, which carries its own labels: "
                        "leave y out")
    if not _arrays(y):
        raise DataError(f"fit(x, y): y must be an array, a tensor or a pandas object (a list of them for a "
                        f"graph's outputs), got {type(y).__name__}")
    return (x, y), epochs


def _arrays(value) -> bool:
    """An array-like, or a list of them (a graph's several inputs or outputs, Keras' ``fit([x1, x2], y)``)."""
    if isinstance(value, (list, tuple)):
        return bool(value) and all(_array_like(item) for item in value)
    return _array_like(value)


def _fitted_on(normalizer, training):
    """``fit(normalizer=...)``: the normalizer fitted on the training batches (one pass)."""

    if not isinstance(normalizer, Normalizer):
        raise TypeError(f"fit(normalizer=...) needs a dl4py Normalizer, got {type(normalizer).__name__}")
    return normalizer.fit(training)


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logging.getLogger("dl4py").warning("dl4py: %s", message)


def _as_tensor(value, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        tensor = torch.from_numpy(value)
        return tensor.float() if tensor.is_floating_point() else tensor
    raise DataError(f"{name} must be a torch tensor or numpy array, got {type(value).__name__}")


def as_iterator(data, batch_size: int | None = None, **options):
    """Any data ``fit`` accepts as a DataSetIterator: see ``dl4py.data.adapters.as_iterator``."""

    return adapt(data, batch_size, **options)
