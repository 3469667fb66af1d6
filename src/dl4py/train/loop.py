"""The single-device fit: epochs of ``train.epoch.run_epoch`` meeting no one
(``local_meeting.py``), listeners, validation, resume, clean Ctrl-C / SIGTERM.

Batches come from ``data_source``: on a GPU, the whole data set held on the device when it
fits, else batches copied ahead of use from pinned memory.

Hot-path rule: nothing here forces a device synchronisation per step. Losses stay on the
device; listeners read them only when they report.
"""

from __future__ import annotations

from dl4py.backend.cuda_environment import environment
from dl4py.data.device import DeviceDataSetIterator, use_device_data
from dl4py.data.iterators import ArrayDataSetIterator, WrappedIterator
from dl4py.data.prefetch import PrefetchIterator
from dl4py.errors import ConfigError, DL4PyError
from dl4py.train import accumulate
from dl4py.train.compile_choice import choose_for_fit
from dl4py.train.epoch import EpochSummary, check_finite, epoch_rng, run_epoch
from dl4py.train.history import History
from dl4py.train.interrupt import DeferredInterrupt
from dl4py.train.listeners import Listeners
from dl4py.train.local_meeting import LocalMeeting
from dl4py.train.numbering import batch_location, stop_point
from dl4py.train.validation import fit_metrics, validation_record

# Where they were first defined; the epoch's parts now live in train/epoch.py.
__all__ = ["EpochSummary", "TrainingInterrupted", "check_finite", "data_source", "epoch_rng", "fit"]

class TrainingInterrupted(DL4PyError):
    """Training was stopped by Ctrl-C or SIGTERM; the model holds the state after the last full step."""

    run_dir = None  # set by ``dl4py train``'s runner: the run directory that ``--resume`` continues


def fit(model, iterator, epochs: int, listeners: list, validation=None, metrics=None) -> History:
    """Train ``epochs`` epochs; after each, score ``validation`` (an iterator) when given.
    The training accuracy is counted when the fit's metrics include it (a classifier's
    default). A listener may stop the fit after an epoch (``model.request_stop`` in its
    ``on_epoch_end``: Keras' EarlyStopping)."""
    if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 0:
        raise ValueError(f"fit: epochs must be a non-negative integer, got {epochs!r}")
    model.init()
    listeners = Listeners(listeners)
    names = fit_metrics(model, metrics)
    accuracy = "accuracy" in names
    listeners.check_keys(EpochSummary.planned_keys(accuracy, None if validation is None else names,
                                                   model.precision_state.scales_loss))
    model.module.train()
    model.clear_stop_request()
    choose_for_fit(model, iterator, epochs)  # compile: auto, before the step is made and listeners look
    iterator = data_source(model, iterator)
    history = History()
    interrupted = False
    iterations_before = model.iteration_count
    with DeferredInterrupt() as interrupt:
        meeting = LocalMeeting(iterator, interrupt)
        listeners.on_fit_start(model)
        try:
            for _ in range(epochs):
                summary = run_epoch(model, meeting, listeners, accuracy)
                if summary is None:
                    interrupted = True
                    break
                if summary.completed:
                    if validation is not None:
                        summary.validation = validation_record(model, validation, metrics)
                        model.module.train()
                    listeners.on_epoch_end(model, summary)  # one may add to the summary (EpochValidation)
                history.append(summary)
                if not summary.completed or model.stop_reason is not None:
                    break  # a listener asked to stop, during the epoch or at its end (early stopping)
        except Exception:
            # A pass that trained and then failed: the next fit starts this epoch over, on
            # whatever data it is given. A fit that failed before its first step (wrong data
            # for a resumed position, say) keeps the position to resume from.
            if model.iteration_count != iterations_before:
                model.training_state.restart_epoch()
            raise
        finally:
            accumulate.discard(model)  # a window a failure left open: its batches were never applied
            listeners.on_fit_end(model, interrupted)
    if interrupted:
        raise TrainingInterrupted(
            f"training stopped by {interrupt.cause or 'Ctrl-C'} after iteration {model.iteration_count} "
            f"({stop_point(model.epoch_count, model.batch_in_epoch)}); the model is consistent"
        )
    return history



def data_source(model, iterator):
    """What the loop reads: the data set held on the device (environment setting
    ``device_data``), batches copied to a GPU ahead of use, or the iterator as it is (CPU)."""
    env, device = environment(), model.backend.device
    if isinstance(iterator, DeviceDataSetIterator):
        return iterator
    cached = model.device_data
    if cached is not None and cached.copies(iterator) and cached.device == device and env.device_data != "off":
        return cached  # kept from an earlier fit (early stopping fits one epoch at a time)
    model.device_data = None  # the old copy goes before a new one is made
    if use_device_data(env.device_data, iterator, device, _step_bytes(model, iterator)):
        model.device_data = DeviceDataSetIterator(iterator, device)
        return model.device_data
    if not isinstance(iterator, ArrayDataSetIterator):  # its labels were all checked when it was made
        iterator = CheckedLabels(iterator, model)
    if device.type == "cuda":
        return PrefetchIterator(iterator, device, pin=env.pinned_memory)
    return iterator


class CheckedLabels(WrappedIterator):
    """Checks every batch's labels against the output layer on the host, before they reach
    the device: sources that cannot tell their largest label up front (a DataLoader, a
    stream) would otherwise meet torch's raw IndexError, or a device-side assert on a GPU,
    at the first bad one. Cheap: a min and max over one batch of labels in host memory."""

    def __init__(self, iterator, model):
        super().__init__(iterator)
        self.model = model

    def __iter__(self):
        epoch = self.model.epoch_count
        for index, batch in enumerate(self.iterator):
            if batch.labels.device.type == "cpu":
                self.model.check_labels(batch.labels, batch_location(epoch, index))
            yield batch


def _step_bytes(model, iterator) -> int | None:
    """The memory estimator's answer for a step of this model and batch size, less the
    parameters already on the device; None where it cannot say (a TorchModel)."""
    config, batch = getattr(model, "config", None), getattr(iterator, "batch_size", None)
    if model.backend.device.type != "cuda" or config is None or not isinstance(batch, int):
        return None
    from dl4py.memory import estimate  # cycle: dl4py.memory imports this module (through nn and parallel)

    try:
        report = estimate(config, batch, model.precision.name, device="cuda")
    except ConfigError:  # a sequence network whose input type gives no length: nothing to size
        return None
    return report.peak_bytes - report.parameter_bytes
