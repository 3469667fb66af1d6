"""The single-device training loop: epochs of steps, listeners, resume, clean Ctrl-C / SIGTERM.

Batches come from ``data_source``: on a GPU, the whole data set held on the device when it
fits, else batches copied ahead of use from pinned memory.

Hot-path rule: nothing here forces a device synchronisation per step. Losses stay on the
device; listeners read them only when they report, and the NaN check looks at a running
sum every ``NAN_CHECK_EVERY`` steps and at the end of each epoch.
"""

from __future__ import annotations

from dl4py.data.iterators import WrappedIterator
from dl4py.errors import DataError, DL4PyError
from dl4py.train import accumulate
from dl4py.train.epoch import EpochSummary, EpochTally, check_finite, epoch_rng, finish_epoch
from dl4py.train.history import History
from dl4py.train.interrupt import DeferredInterrupt
from dl4py.train.progress import batches_of
from dl4py.train.validation import validation_record

# Where they were first defined; the epoch's parts now live in train/epoch.py.
__all__ = ["EpochSummary", "TrainingInterrupted", "check_finite", "data_source", "epoch_rng", "fit"]

NAN_CHECK_EVERY = 100


class TrainingInterrupted(DL4PyError):
    """Training was stopped by Ctrl-C or SIGTERM; the model holds the state after the last full step."""

    run_dir = None  # set by ``dl4py train``'s runner: the run directory that ``--resume`` continues


def fit(model, iterator, epochs: int, listeners: list, validation=None, metrics=None) -> History:
    """Train ``epochs`` epochs; after each, score ``validation`` (an iterator) when given."""
    if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 0:
        raise ValueError(f"fit: epochs must be a non-negative integer, got {epochs!r}")
    model.init()
    model.module.train()
    model.clear_stop_request()
    iterator = data_source(model, iterator)
    history = History()
    interrupted = False
    iterations_before = model.iteration_count
    with DeferredInterrupt() as interrupt:
        for listener in listeners:
            listener.on_fit_start(model)
        try:
            for _ in range(epochs):
                summary = _run_epoch(model, iterator, listeners, interrupt)
                if summary is None:
                    interrupted = True
                    break
                if summary.completed:
                    if validation is not None:
                        summary.validation = validation_record(model, validation, metrics)
                        model.module.train()
                    for listener in listeners:  # may add to the summary (EpochValidation)
                        listener.on_epoch_end(model, summary)
                history.append(summary)
                if not summary.completed:
                    break  # a listener asked to stop (early stopping)
        except Exception:
            # A pass that trained and then failed: the next fit starts this epoch over, on
            # whatever data it is given. A fit that failed before its first step (wrong data
            # for a resumed position, say) keeps the position to resume from.
            if model.iteration_count != iterations_before:
                model.batch_in_epoch = 0
            raise
        finally:
            accumulate.discard(model)  # a window a failure left open: its batches were never applied
            for listener in listeners:
                listener.on_fit_end(model, interrupted)
    if interrupted:
        raise TrainingInterrupted(
            f"training stopped by {interrupt.cause or 'Ctrl-C'} after iteration {model.iteration_count} "
            f"(epoch {model.epoch_count}, batch {model.batch_in_epoch}); the model is consistent"
        )
    return history



def _run_epoch(model, iterator, listeners, interrupt) -> EpochSummary | None:
    """One epoch (or the rest of one, after a resume). None when interrupted."""
    epoch = model.epoch_count
    if hasattr(iterator, "set_epoch"):
        iterator.set_epoch(epoch)
    skip = model.batch_in_epoch
    for listener in listeners:
        listener.on_epoch_start(model, epoch)
    if skip:
        _check_resumable(iterator, epoch, skip)
    tally = EpochTally(model, epoch)
    with epoch_rng(model, epoch, data=iterator) as randomness:
        for index, batch in randomness.batches(iterator):
            if index < skip:
                continue  # resumed mid-epoch: read again (as they were), trained before the stop
            features, labels = model.prepare_batch(batch)
            loss = tally.train(features, labels, f"epoch {epoch}, batch {index}")
            model.iteration_count += 1
            model.batch_in_epoch = index + 1
            for listener in listeners:
                listener.iteration_done(model, model.iteration_count, epoch, loss, features.shape[0])
            if model.stop_reason is not None:  # before the NaN check: a stop on NaN is asked for
                accumulate.finish(model)  # what was accumulated is applied, as at an epoch's end
                return tally.summary(completed=False)
            if tally.batches % NAN_CHECK_EVERY == 0:
                check_finite(model, tally.loss_sum, epoch)
            if interrupt.requested and not accumulate.pending(model):
                # Between updates only: the model and its checkpoint never hold half a window,
                # and a resumed run accumulates the same windows an uninterrupted one would.
                return None
    if tally.batches == 0 and not skip:  # an exhausted generator, an empty source: no epoch to count as done
        raise DataError(f"the data gave no batches in epoch {epoch}; a one-pass iterable (a generator) is "
                        "spent after its first epoch: pass a DataSetIterator, a DataLoader or a callable "
                        "returning a fresh iterable")
    if accumulate.finish(model) and interrupt.requested:  # the epoch's last window, maybe short
        return None  # asked for during that window; a resumed run finds no batches left and ends the epoch
    finish_epoch(model, tally.loss_sum, epoch)
    return tally.summary()  # no batches: stopped after its last one, its mean loss NaN


def _check_resumable(iterator, epoch: int, skip: int) -> None:
    """A DataError, before any batch is read, when the rest of a stopped epoch cannot be the
    batches the uninterrupted epoch would have trained."""
    length = batches_of(iterator)
    if length is not None and skip > length:
        raise DataError(f"the model stopped after batch {skip} of epoch {epoch}, but this data has only {length} "
                        "batches per epoch: resume with the data (and batch size) it was trained on")
    refusal = iterator.replay_refusal()
    if refusal is not None:
        raise DataError(f"cannot continue epoch {epoch} after batch {skip}: {refusal}")


def data_source(model, iterator):
    """What the loop reads: the data set held on the device (environment setting
    ``device_data``), batches copied to a GPU ahead of use, or the iterator as it is (CPU)."""
    from dl4py.backend.cuda_environment import environment
    from dl4py.data.device import DeviceDataSetIterator, use_device_data
    from dl4py.data.iterators import ArrayDataSetIterator
    from dl4py.data.prefetch import PrefetchIterator

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
                self.model.check_labels(batch.labels, f"epoch {epoch}, batch {index}")
            yield batch


def _step_bytes(model, iterator) -> int | None:
    """The memory estimator's answer for a step of this model and batch size, less the
    parameters already on the device; None where it cannot say (a TorchModel)."""
    config, batch = getattr(model, "config", None), getattr(iterator, "batch_size", None)
    if model.backend.device.type != "cuda" or config is None or not isinstance(batch, int):
        return None
    from dl4py.memory import estimate

    report = estimate(config, batch, model.precision.name, device="cuda")
    return report.peak_bytes - report.parameter_bytes
