"""One epoch, whoever trains it: what the single-device loop and every parallel worker share.

- ``EpochTally``: the per-step work and counting of an epoch (first-batch checks, the step,
  the loss summed on the device, batches, examples, time) and its summary;
- ``epoch_rng``: the epoch's randomness, seeded for each batch from (seed, epoch, batch,
  stream), so that a run resumed anywhere draws what the uninterrupted one did (``randomness.py``);
- ``check_finite`` and ``finish_epoch``: the NaN verdict and the counters of a completed epoch.

The loops around them differ only in where batches come from and when replicas meet.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from dl4py.errors import TrainingError
from dl4py.train.history import current_learning_rate
from dl4py.train.randomness import epoch_rng

__all__ = ["EpochSummary", "EpochTally", "check_finite", "epoch_rng", "finish_epoch"]  # the loops' epoch parts


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

    @property
    def samples_per_second(self) -> float:
        return self.examples / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "samples_per_second": self.samples_per_second}

    def record(self) -> dict:
        """The epoch as History and ``metrics.jsonl`` show it (Keras' key names)."""
        return {"epoch": self.epoch, "loss": self.mean_loss, "seconds": self.seconds,
                "samples_per_second": self.samples_per_second, "learning_rate": self.learning_rate,
                "batches": self.batches, "examples": self.examples, **(self.validation or {})}


class EpochTally:
    """The steps of one epoch on one model: ``train`` each prepared batch, then ``summary``.
    Nothing here reads the device: the loss sum stays there until the caller asks."""

    def __init__(self, model, epoch: int):
        self.model, self.epoch = model, epoch
        self.batches = self.examples = 0
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=model.backend.device)
        self.started = time.perf_counter()

    def train(self, features: torch.Tensor, labels: torch.Tensor, where: str) -> torch.Tensor:
        """One step on a batch already on the device (``prepare_batch``); the first batch's
        features and labels are checked against the network, naming ``where``."""
        if self.batches == 0:
            self.model.check_features(features, where)
            self.model.check_labels(labels, where)
        loss = self.model.train_step(features, labels)
        self.loss_sum += loss
        self.batches += 1
        self.examples += features.shape[0]
        return loss

    def summary(self, completed: bool = True, batches: int | None = None, examples: int | None = None,
                loss_sum: float | None = None) -> EpochSummary:
        """The epoch as it ended here, or with the totals over all workers when given."""
        batches = self.batches if batches is None else batches
        examples = self.examples if examples is None else examples
        loss_sum = float(self.loss_sum) if loss_sum is None else loss_sum
        mean = loss_sum / batches if batches else float("nan")
        return EpochSummary(self.epoch, batches, examples, mean, time.perf_counter() - self.started,
                            completed=completed, learning_rate=current_learning_rate(self.model))


def finish_epoch(model, loss_sum: torch.Tensor, epoch: int) -> None:
    """A completed epoch: the loss must be finite, and the counters move to the next epoch."""
    check_finite(model, loss_sum, epoch)
    model.epoch_count += 1
    model.batch_in_epoch = 0


def check_finite(model, loss_sum: torch.Tensor, epoch: int) -> None:
    """Raise TrainingError, naming the precision and a remedy, when the loss is NaN or infinite."""
    if not bool(torch.isfinite(torch.as_tensor(loss_sum))):
        remedy = {
            "half": "use 'mixed-fp16' (loss scaling) or 'bfloat16', or lower the learning rate",
            "mixed-fp16": "lower the learning rate, or use 'mixed-bf16'",
        }.get(model.precision.name, "lower the learning rate or check the data for NaN/inf values")
        raise TrainingError(
            f"the loss became NaN or infinite in epoch {epoch} (by iteration {model.iteration_count}) "
            f"with precision '{model.precision}'; {remedy}"
        )
