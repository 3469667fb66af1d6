"""One epoch, whoever trains it: what the single-device loop and every parallel worker share.

- ``EpochTally``: the per-step work and counting of an epoch (first-batch checks, the step,
  the loss summed on the device, batches, examples, time, and where asked the training
  accuracy from the step's own outputs) and its summary;
- ``epoch_rng``: the epoch's randomness, seeded for each batch from (seed, epoch, batch,
  stream), so that a run resumed anywhere draws what the uninterrupted one did (``randomness.py``);
- ``check_finite`` and ``finish_epoch``: the NaN verdict and the counters of a completed epoch;
- ``run_epoch``: the epoch loop itself, for one process and for every rank alike; a
  ``Meeting`` says where batches come from and when replicas meet.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import ContextManager, Iterable, Protocol

import torch

from dl4py.errors import TrainingError
from dl4py.train.history import current_learning_rate
from dl4py.train.numbering import epoch_name
from dl4py.train.randomness import epoch_rng
from dl4py.train.training_accuracy import RunningAccuracy

__all__ = ["EpochSummary", "EpochTally", "Meeting", "Turn", "check_finite", "epoch_rng", "finish_epoch", "run_epoch"]


@dataclass
class EpochSummary:
    epoch: int  # 0-based index of the epoch that ended
    batches: int
    examples: int
    mean_loss: float
    seconds: float
    completed: bool = True  # False when a stop was requested part-way through the epoch
    learning_rate: float | None = None  # of the epoch's last update
    validation: dict | None = None  # val_loss, val_<metric>: the held-out score after the epoch
    skipped_steps: int | None = None  # updates the loss scaler skipped (overflow); None without one
    accuracy: float | None = None  # on the training batches as they were met (training_accuracy.py)

    @property
    def samples_per_second(self) -> float:
        return self.examples / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "samples_per_second": self.samples_per_second}

    @classmethod
    def planned_keys(cls, accuracy: bool, validation_metrics=None, skipped_steps: bool = False) -> list[str]:
        """The keys ``record`` will have (History's), known before the first batch: with the
        training ``accuracy``, ``val_loss`` and ``val_<name>`` of each of ``validation_metrics``
        (None: no validation), ``skipped_steps`` where a loss scaler skips updates."""
        validation = None if validation_metrics is None else dict.fromkeys(
            ["val_loss", *(f"val_{name}" for name in validation_metrics)])
        planned = cls(0, 0, 0, 0.0, 0.0, accuracy=0.0 if accuracy else None, validation=validation,
                      skipped_steps=0 if skipped_steps else None)
        return [key for key in planned.record() if key != "epoch"]

    def record(self) -> dict:
        """The epoch as History and ``metrics.jsonl`` show it (Keras' key names)."""
        return {"epoch": self.epoch, "loss": self.mean_loss,
                **({} if self.accuracy is None else {"accuracy": self.accuracy}), "seconds": self.seconds,
                "samples_per_second": self.samples_per_second, "learning_rate": self.learning_rate,
                "batches": self.batches, "examples": self.examples,
                **({} if self.skipped_steps is None else {"skipped_steps": self.skipped_steps}),
                **(self.validation or {})}


class EpochTally:
    """The steps of one epoch on one model: ``train`` each prepared batch, then ``summary``.
    Nothing here reads the device: the loss sum stays there until the caller asks.
    ``accuracy``: count the training accuracy too (a fit whose metrics include it)."""

    def __init__(self, model, epoch: int, accuracy: bool = False):
        self.model, self.epoch = model, epoch
        self.accuracy = RunningAccuracy(model) if accuracy else None
        self._observe = None if self.accuracy is None else self.accuracy.observe  # what the step shows its outputs
        self.batches = self.examples = 0
        self.last_loss: torch.Tensor | None = None  # of the last batch trained here
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=model.backend.device)
        self.started = time.perf_counter()
        self._skipped_before = model.precision_state.skipped_steps

    def train(self, features: torch.Tensor, labels: torch.Tensor, where: str) -> torch.Tensor:
        """One step on a batch already on the device (``prepare_batch``); the first batch's
        features and labels are checked against the network, naming ``where``."""
        if self.batches == 0:
            self.model.check_features(features, where)
            self.model.check_labels(labels, where)
        loss = self.last_loss = self.model.train_step(features, labels, self._observe)
        self.loss_sum += loss
        self.batches += 1
        self.examples += features.shape[0]
        return loss

    @property
    def skipped_steps(self) -> int | None:
        """Updates the loss scaler skipped in this epoch here; None where nothing scales the loss."""
        precision = self.model.precision_state
        return precision.skipped_steps - self._skipped_before if precision.scales_loss else None

    def summary(self, completed: bool = True, batches: int | None = None, examples: int | None = None,
                loss_sum: float | None = None, skipped_steps: int | None = None,
                accuracy: float | None = None) -> EpochSummary:
        """The epoch as it ended here, or with the totals over all workers when given (then
        the training accuracy is the one given, over all workers; this replica's alone would
        misstate it)."""
        skipped_steps = self.skipped_steps if skipped_steps is None else skipped_steps
        batches = self.batches if batches is None else batches
        examples = self.examples if examples is None else examples
        loss_sum = float(self.loss_sum) if loss_sum is None else loss_sum
        mean = loss_sum / batches if batches else float("nan")
        own = examples == self.examples
        if own and accuracy is None and self.accuracy is not None:
            accuracy = self.accuracy.value()
        return EpochSummary(self.epoch, batches, examples, mean, time.perf_counter() - self.started,
                            completed=completed, learning_rate=current_learning_rate(self.model),
                            skipped_steps=skipped_steps, accuracy=accuracy)


@dataclass
class Turn:
    """One step of an epoch as a meeting hands it to ``run_epoch``: this replica's batch
    (None where it has none this round), and how the listeners count it."""

    features: torch.Tensor | None
    labels: torch.Tensor | None
    where: str  # names the batch in a data error, from 1: "epoch 2, batch 7" (``numbering.py``)
    index: int = 0  # the batch's index in the epoch (one process) or the round's (ranks)
    iteration: int = 0  # the model's minibatch count after this step, as the listeners see it
    examples: int = 0  # the examples the step stands for (a parallel round: every worker's)


class Meeting(Protocol):
    """Where replicas meet in an epoch: one process alone (``train.loop.LocalMeeting``) or
    ranks round by round (``parallel.round_meeting.RoundMeeting``). The meeting reads the
    batches, decides when the epoch ends, and moves the model's position at its end."""

    def begin(self, model, epoch: int) -> None:
        """Before the epoch starts: where it resumes, and whether it can."""

    def turns(self, model, epoch: int) -> ContextManager[Iterable[Turn]]:
        """The epoch's steps, read with the epoch's randomness around them."""

    def trained(self, model, turn: Turn) -> None:
        """This replica trained ``turn``'s batch."""

    def sit_out(self, model, turn: Turn) -> None:
        """A step without a batch of this replica (the others trained one)."""

    def ends_after(self, model, turn: Turn, tally: "EpochTally") -> bool:
        """True when the epoch stops after ``turn`` (a stop asked for, a vote, a condition)."""

    def close(self, model, tally: "EpochTally") -> "EpochSummary | None":
        """The epoch's summary after its last step; None when it was interrupted."""


def run_epoch(model, meeting: Meeting, listeners, accuracy: bool = False) -> "EpochSummary | None":
    """One epoch (or the rest of one, after a resume) of ``model``, whoever trains it: the
    single-device fit and every rank of a parallel fit run this loop; ``meeting`` is what
    differs. ``listeners``: a ``Listeners``. ``accuracy``: count the training accuracy
    (``EpochTally``). None when interrupted."""
    epoch = model.epoch_count
    meeting.begin(model, epoch)
    listeners.on_epoch_start(model, epoch)
    tally = EpochTally(model, epoch, accuracy)
    with meeting.turns(model, epoch) as turns:
        for turn in turns:
            if turn.features is None:
                meeting.sit_out(model, turn)
            else:
                loss = tally.train(turn.features, turn.labels, turn.where)
                meeting.trained(model, turn)
                listeners.iteration_done(model, turn.iteration, epoch, loss, turn.examples)
            if meeting.ends_after(model, turn, tally):
                break
    return meeting.close(model, tally)


def finish_epoch(model, loss_sum: torch.Tensor, epoch: int) -> None:
    """A completed epoch: the loss must be finite, and the counters move to the next epoch."""
    check_finite(model, loss_sum, epoch)
    model.training_state.end_epoch()


def check_finite(model, loss_sum: torch.Tensor, epoch: int) -> None:
    """Raise TrainingError, naming the precision and a remedy, when the loss is NaN or infinite."""
    if not bool(torch.isfinite(torch.as_tensor(loss_sum))):
        remedy = {
            "half": "use 'mixed-fp16' (loss scaling) or 'bfloat16', or lower the learning rate",
            "mixed-fp16": "lower the learning rate, or use 'mixed-bf16'",
        }.get(model.precision.name, "lower the learning rate or check the data for NaN/inf values")
        raise TrainingError(
            f"the loss became NaN or infinite in {epoch_name(epoch)} (by iteration {model.iteration_count}) "
            f"with precision '{model.precision}'; {remedy}"
        )
