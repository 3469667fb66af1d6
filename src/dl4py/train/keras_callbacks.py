"""Keras' ``EarlyStopping`` and ``ModelCheckpoint``, as listeners on dl4py's early-stopping machinery.

    from dl4py import EarlyStopping, ModelCheckpoint
    history = model.fit(X, y, epochs=30, validation_split=0.1, callbacks=[
        EarlyStopping(monitor="val_loss", patience=2, restore_best_weights=True),
        ModelCheckpoint("best.dl4py", monitor="val_loss", save_best_only=True)])

Both read the monitored key from the record of the epoch that ended (History's keys:
``loss``, ``accuracy``, ``val_loss``, ``val_accuracy``, ...), after validation scored it.
Before the first step the fit shows them the keys its History will have: a key it can
never have is one ConfigError then, naming the key and the keys there are (Keras warns at
each epoch's end and carries on).

- ``EarlyStopping`` runs an ``EarlyStoppingController``, the one DL4J's EarlyStoppingTrainer
  runs: ``ScoreImprovement`` (patience, min_delta, baseline) decides when to stop, and with
  ``restore_best_weights`` an ``InMemoryModelSaver`` keeps the best model, whose weights go
  back into the model when the fit ends.
- ``ModelCheckpoint`` keeps the best with the controller's ``BestModel`` and writes with
  ``model.save`` (atomic: a crash mid-save leaves the previous file readable).

Where dl4py differs from Keras 3, on purpose: a misspelt monitor key, an unknown ``mode``,
or a ``mode="auto"`` that cannot tell the direction is an error, not a warning;
``restore_best_weights`` restores the epoch with the best monitored value (what Keras
documents; its code keeps the last one that beat the best by ``min_delta``); an
EarlyStopping starts afresh at each fit (Keras keeps its best across fits), and
``start_from_epoch`` counts this fit's epochs; a ModelCheckpoint keeps its best across fits,
as Keras' does. Files are dl4py model files (any name; ``dl4py.load`` reads them), and
``save_weights_only`` leaves the updater state out (the config stays: the file rebuilds the
network). Messages number epochs from 1, as Keras does.
"""

from __future__ import annotations

import math
import os
import string
import sys

from dl4py.errors import ConfigError
from dl4py.train.early_stopping.calculators import ScoreCalculator
from dl4py.train.early_stopping.conditions import ScoreImprovement
from dl4py.train.early_stopping.configuration import EarlyStoppingConfiguration
from dl4py.train.early_stopping.controller import BestModel, EarlyStoppingController
from dl4py.train.early_stopping.savers import EarlyStoppingModelSaver
from dl4py.train.listeners import MonitoringListener, _passes

__all__ = ["EarlyStopping", "ModelCheckpoint"]

# mode="auto": whether a lower value is better, by the metric's name (a "val_" prefix
# dropped): the loss and the fit's metrics (the Evaluation's and RegressionEvaluation's).
_LOWER_IS_BETTER = {
    "loss": True, "mean_squared_error": True, "mean_absolute_error": True, "root_mean_squared_error": True,
    "relative_squared_error": True,
    "accuracy": False, "top_n_accuracy": False, "f1": False, "precision": False, "recall": False,
    "r_squared": False, "pearson_correlation": False,
}


class _Monitor:
    """The History key a callback watches, and which way is better."""

    def __init__(self, owner: str, key, mode):
        if not isinstance(key, str) or not key:
            raise ConfigError(f"{owner}.monitor", f"must name a History key such as 'val_loss', got {key!r}")
        if mode not in ("auto", "min", "max"):
            raise ConfigError(f"{owner}.mode", f"must be 'auto', 'min' or 'max', got {mode!r}")
        self.owner, self.key, self.mode = owner, key, mode

    def lower_is_better(self) -> bool:
        """``mode``'s word, or for "auto" what the key's name says."""
        if self.mode != "auto":
            return self.mode == "min"
        name = self.key.removeprefix("val_")
        if name not in _LOWER_IS_BETTER:
            raise ConfigError(f"{self.owner}.mode", f"'auto' cannot tell whether a higher or a lower {self.key!r} "
                                                    "is better; pass mode='min' or mode='max'")
        return _LOWER_IS_BETTER[name]

    def check(self, keys: list[str]) -> None:
        """The key is one of ``keys``, and its direction is known (the fit's start)."""
        if self.key not in keys:
            raise ConfigError(f"{self.owner}.monitor", self._missing(keys, "this fit's History will have no"))
        self.lower_is_better()

    def value(self, record: dict) -> float:
        """The monitored value in an epoch's record."""
        value = record.get(self.key)
        if value is None:
            keys = [key for key, v in record.items() if v is not None and key != "epoch"]
            raise ConfigError(f"{self.owner}.monitor", self._missing(keys, f"epoch {record['epoch'] + 1} recorded no"))
        return float(value)

    def _missing(self, keys: list[str], what: str) -> str:
        hint = ""
        if self.key.startswith("val_") and "val_loss" not in keys:
            hint = "; val_ keys need held-out data: fit(..., validation_split=0.1) or validation=(x_val, y_val)"
        return f"{what} {self.key!r}; its keys are {', '.join(keys)}{hint}"


class _RecordedScore(ScoreCalculator):
    """The monitored value of the epoch that ended, read from its record: validation has
    scored the epoch already, so nothing is scored again."""

    def __init__(self, monitor: _Monitor):
        self.monitor = monitor
        self.record: dict = {}

    @property
    def minimize_score(self) -> bool:
        return self.monitor.lower_is_better()

    def calculate_score(self, model) -> float:
        return self.monitor.value(self.record)

    def __str__(self):
        return f"History[{self.monitor.key!r}]"


class _KeepsNothing(EarlyStoppingModelSaver):
    """EarlyStopping without restore_best_weights: no copy of the best model is made."""

    def save_best(self, model, score):
        pass

    def save_latest(self, model, score):
        pass

    def get_best_model(self, into=None, backend=None):
        return None


class EarlyStopping(MonitoringListener):
    """Stop the fit when ``monitor`` has stopped improving (Keras 3's arguments and meaning).

    An epoch improves when the monitored value beats the best so far by more than
    ``min_delta`` (``mode``: "min", "max", or "auto" from the key's name); the fit stops after
    ``patience`` epochs in a row without one (Keras counts the epoch checked, so 0 and 1
    are the same). With ``baseline``, only an improvement that also beats the baseline
    restarts the count. The first ``start_from_epoch`` epochs of each fit are not watched.
    ``restore_best_weights``: when the fit ends, the weights of its epoch with the best
    monitored value go back into the model (its updater state and counters stay). After the
    fit, ``stopped_epoch`` is the (0-based) epoch it stopped after, 0 when it did not stop;
    ``best_epoch`` and ``best`` name the best epoch and value.
    """

    def __init__(self, monitor="val_loss", min_delta=0, patience=0, verbose=0, mode="auto", baseline=None,
                 restore_best_weights=False, start_from_epoch=0):
        self.monitor = _Monitor("EarlyStopping", monitor, mode)
        for name, value in (("patience", patience), ("start_from_epoch", start_from_epoch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"EarlyStopping.{name}", f"must be an integer >= 0, got {value!r}")
        for name, value in (("min_delta", min_delta), ("baseline", 0 if baseline is None else baseline)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"EarlyStopping.{name}", f"must be a number, got {value!r}")
        self.patience, self.min_delta, self.baseline = patience, abs(min_delta), baseline
        self.verbose, self.restore_best_weights, self.start_from_epoch = verbose, restore_best_weights, start_from_epoch
        self.stopped_epoch = 0
        self._score = _RecordedScore(self.monitor)
        self._controller: EarlyStoppingController | None = None

    @property
    def best_epoch(self) -> int:
        """The (0-based) epoch with the best monitored value in the last fit; -1 before one."""
        return -1 if self._controller is None else self._controller.best_epoch

    @property
    def best(self) -> float:
        """The best monitored value in the last fit (NaN before one)."""
        return math.nan if self._controller is None else self._controller.best_score

    def check_keys(self, keys):
        self.monitor.check(keys)

    def on_fit_start(self, model):
        # Keras' patience 0 stops where 1 does (its count includes the epoch checked);
        # ScoreImprovement counts the epochs after the best, so it is given 1.
        condition = ScoreImprovement(max(self.patience, 1), self.min_delta, self.baseline)
        # Without a saver given, the configuration keeps the best in an InMemoryModelSaver.
        saver = {} if self.restore_best_weights else {"model_saver": _KeepsNothing()}
        self._controller = EarlyStoppingController(
            EarlyStoppingConfiguration(score_calculator=self._score, epoch_conditions=[condition], **saver))
        self._controller.start(model.epoch_count + self.start_from_epoch)
        self.stopped_epoch = 0

    def on_epoch_end(self, model, summary):
        if not summary.completed or summary.epoch < self._controller.first_epoch:
            return  # a stopped epoch's record is partial; start_from_epoch: not watched yet
        self._score.record = summary.record()
        reason = self._controller.end_of_epoch(model, summary.epoch)
        if reason is not None:
            self.stopped_epoch = summary.epoch
            model.request_stop(f"EarlyStopping: {self.monitor.key} did not improve ({reason})")
            _say(self.verbose, f"Epoch {summary.epoch + 1}: early stopping")

    def on_fit_end(self, model, interrupted):
        if self.restore_best_weights and not interrupted and self._controller is not None:
            if self._controller.config.model_saver.restore_best_weights(model):
                _say(self.verbose, f"Restoring model weights from the end of the best epoch: {self.best_epoch + 1}.")


class _CheckpointFile(EarlyStoppingModelSaver):
    """Where ModelCheckpoint writes: ``model.save`` (atomic) to the path of the epoch at hand."""

    def __init__(self, save_updater: bool):
        self.save_updater = save_updater
        self.path: str | None = None

    def save_best(self, model, score):
        model.save(self.path, save_updater=self.save_updater)

    def save_latest(self, model, score):
        model.save(self.path, save_updater=self.save_updater)

    def get_best_model(self, into=None, backend=None):
        raise NotImplementedError("ModelCheckpoint's files: read them with dl4py.load(path)")


class ModelCheckpoint(MonitoringListener):
    """Save the model at each epoch's end, or every ``save_freq`` batches (Keras 3's arguments).

    ``filepath`` may hold Keras' fields: ``{epoch}`` (from 1) and History's keys of the
    epoch (``"ckpt-{epoch:02d}-{val_loss:.3f}.dl4py"``); ``{batch}`` (the iteration) with an
    integer ``save_freq``. ``save_best_only``: write only when ``monitor`` is better than at
    every earlier save (than ``initial_value_threshold``, when given); the best carries over
    to later fits, so a worse model never replaces a better file. ``save_weights_only``: the
    file leaves the updater state out. Each file is a dl4py model file: ``dl4py.load(path)``.
    """

    def __init__(self, filepath, monitor="val_loss", verbose=0, save_best_only=False, save_weights_only=False,
                 mode="auto", save_freq="epoch", initial_value_threshold=None):
        self.filepath = os.fspath(filepath)
        self.monitor = _Monitor("ModelCheckpoint", monitor, mode)
        if save_freq != "epoch" and (isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1):
            raise ConfigError("ModelCheckpoint.save_freq", f"must be 'epoch' or a number of batches >= 1, got {save_freq!r}")
        if save_best_only and save_freq != "epoch":
            raise ConfigError("ModelCheckpoint.save_freq", "save_best_only compares the epochs' records: use "
                                                           "save_freq='epoch' with it")
        self.fields = _fields(self.filepath)
        self.verbose, self.save_best_only, self.save_freq = verbose, bool(save_best_only), save_freq
        self._file = _CheckpointFile(save_updater=not save_weights_only)
        if initial_value_threshold is not None and (isinstance(initial_value_threshold, bool)
                                                    or not isinstance(initial_value_threshold, (int, float))):
            raise ConfigError("ModelCheckpoint.initial_value_threshold", f"must be a number, got {initial_value_threshold!r}")
        self.initial_value_threshold = initial_value_threshold
        self.best: BestModel | None = None  # made at the first fit (save_best_only), kept across fits
        self._last_iteration = 0

    def check_keys(self, keys):
        if self.save_best_only:
            self.monitor.check(keys)
        known = ["epoch", "batch"] if self.save_freq != "epoch" else ["epoch", *keys]
        for name in self.fields:
            if name not in known:
                raise ConfigError("ModelCheckpoint.filepath", f"{{{name}}} is not a field it can fill; "
                                                              f"the fields are {', '.join(known)}")

    def on_fit_start(self, model):
        self._last_iteration = model.iteration_count
        if self.save_best_only and self.best is None:
            threshold = self.initial_value_threshold
            self.best = BestModel(self._file, self.monitor.lower_is_better(), math.nan if threshold is None else threshold)

    def iteration_done(self, model, iteration, epoch, loss, batch_size):
        if self.save_freq == "epoch":
            return
        last, self._last_iteration = self._last_iteration, iteration
        if _passes(last, iteration, self.save_freq):
            self._file.path = self._path(epoch=epoch + 1, batch=iteration)
            self._file.save_latest(model, None)
            # "iteration", not "batch": a message's "batch N" is the epoch's N-th (train/numbering.py)
            _say(self.verbose, f"Epoch {epoch + 1}, iteration {iteration}: saving model to {self._file.path}")

    def on_epoch_end(self, model, summary):
        if self.save_freq != "epoch" or not summary.completed:
            return
        record = summary.record()
        self._file.path = self._path(**{**record, "epoch": summary.epoch + 1})
        if not self.save_best_only:
            self._file.save_latest(model, None)
            _say(self.verbose, f"Epoch {summary.epoch + 1}: saving model to {self._file.path}")
            return
        before = "none yet" if math.isnan(self.best.score) else f"{self.best.score:.5f}"
        current = self.monitor.value(record)
        if self.best.offer(model, summary.epoch, current):
            _say(self.verbose, f"Epoch {summary.epoch + 1}: {self.monitor.key} improved from {before} to "
                               f"{current:.5f}, saving model to {self._file.path}")
        else:
            _say(self.verbose, f"Epoch {summary.epoch + 1}: {self.monitor.key} did not improve from {before}")

    def _path(self, **values) -> str:
        try:
            return self.filepath.format(**values)
        except (KeyError, ValueError, TypeError) as exc:
            raise ConfigError("ModelCheckpoint.filepath", f"cannot fill {self.filepath!r} from {values}: {exc}") from None


def _say(verbose, message: str) -> None:
    """Keras' ``verbose=1`` messages, on the console's stream (stderr)."""
    if verbose:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()


def _fields(filepath: str) -> list[str]:
    """The names of the ``{...}`` fields of ``filepath`` (``{epoch:02d}``: "epoch")."""
    try:
        parsed = list(string.Formatter().parse(filepath))
    except ValueError as exc:
        raise ConfigError("ModelCheckpoint.filepath", f"{filepath!r} is not a valid format string: {exc}") from None
    names = []
    for _, name, _, _ in parsed:
        if name is not None:
            if name == "" or name.isdigit():
                raise ConfigError("ModelCheckpoint.filepath", f"{filepath!r}: name each field ({{epoch}}, "
                                                              "{val_loss}, ...), not {} or {0}")
            names.append(name.split(".")[0].split("[")[0])
    return names
