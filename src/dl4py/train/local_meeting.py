"""One process alone: the ``Meeting`` of the single-device fit (``train/epoch.py``).

Batches come from one iterator, in order. A resumed epoch reads again the batches trained
before the stop and skips them (a seeded source yields them as it did). The epoch ends at
the data's end, after a step where a listener asked to stop (early stopping), or between
updates once Ctrl-C or SIGTERM was asked for: the model and its checkpoint never hold half
an accumulation window, and a resumed run accumulates the windows an uninterrupted one would.

Hot-path rule: nothing here forces a device synchronisation per step. The NaN check looks at
the epoch's running loss sum every ``NAN_CHECK_EVERY`` steps and at the end of the epoch.
"""

from __future__ import annotations

from contextlib import contextmanager

from dl4py.errors import DataError
from dl4py.train import accumulate
from dl4py.train.epoch import Turn, check_finite, epoch_rng, finish_epoch
from dl4py.train.numbering import batch_location, epoch_name
from dl4py.train.progress import batches_of

NAN_CHECK_EVERY = 100


class LocalMeeting:
    """The batches of ``iterator`` for one model; ``interrupt`` (a DeferredInterrupt) says
    when Ctrl-C or SIGTERM asked to stop."""

    def __init__(self, iterator, interrupt):
        self.iterator, self.interrupt = iterator, interrupt
        self.skip = 0  # batches of this epoch trained before a stop: read again, not trained
        self.outcome = None  # "stopped" (a listener asked) or "interrupted", once the epoch ends early

    def begin(self, model, epoch: int) -> None:
        self.outcome = None
        if hasattr(self.iterator, "set_epoch"):
            self.iterator.set_epoch(epoch)
        self.skip = model.batch_in_epoch
        if self.skip:
            _check_resumable(self.iterator, epoch, self.skip)

    @contextmanager
    def turns(self, model, epoch: int):
        with epoch_rng(model, epoch, data=self.iterator) as randomness:
            turns = self._turns(model, epoch, randomness)
            try:
                yield turns
            finally:
                turns.close()  # the data's own iterator (a DataLoader's workers) ends with the epoch

    def _turns(self, model, epoch, randomness):
        for index, batch in randomness.batches(self.iterator):
            if index < self.skip:
                continue  # resumed mid-epoch: read again (as they were), trained before the stop
            features, labels = model.prepare_batch(batch)
            yield Turn(features, labels, batch_location(epoch, index), index, model.iteration_count + 1,
                       features.shape[0])

    def trained(self, model, turn: Turn) -> None:
        model.training_state.advance(1, position=turn.index + 1)

    def sit_out(self, model, turn: Turn) -> None:
        raise AssertionError("one process has a batch at every step")

    def ends_after(self, model, turn: Turn, tally) -> bool:
        if model.stop_reason is not None:  # before the NaN check: a stop on NaN is asked for
            accumulate.finish(model)  # what was accumulated is applied, as at an epoch's end
            self.outcome = "stopped"
            return True
        if tally.batches % NAN_CHECK_EVERY == 0:
            check_finite(model, tally.loss_sum, tally.epoch)
        if self.interrupt.requested and not accumulate.pending(model):
            self.outcome = "interrupted"  # between updates only (see the module's docstring)
            return True
        return False

    def close(self, model, tally):
        if self.outcome == "interrupted":
            return None
        if self.outcome == "stopped":
            return tally.summary(completed=False)
        if tally.batches == 0 and not self.skip:  # an exhausted generator, an empty source: no epoch to count
            raise DataError(f"the data gave no batches in {epoch_name(tally.epoch)}; a one-pass iterable (a generator) "
                            "is spent after its first epoch: pass a DataSetIterator, a DataLoader or a callable "
                            "returning a fresh iterable")
        if accumulate.finish(model) and self.interrupt.requested:  # the epoch's last window, maybe short
            return None  # asked for during that window; a resumed run finds no batches left and ends the epoch
        finish_epoch(model, tally.loss_sum, tally.epoch)
        return tally.summary()  # no batches: stopped after its last one, its mean loss NaN


def _check_resumable(iterator, epoch: int, skip: int) -> None:
    """A DataError, before any batch is read, when the rest of a stopped epoch cannot be the
    batches the uninterrupted epoch would have trained."""
    length = batches_of(iterator)
    if length is not None and skip > length:
        raise DataError(f"the model stopped after batch {skip} of {epoch_name(epoch)}, but this data has only {length} "
                        "batches per epoch: resume with the data (and batch size) it was trained on")
    refusal = iterator.replay_refusal()
    if refusal is not None:
        raise DataError(f"cannot continue {epoch_name(epoch)} after batch {skip}: {refusal}")
