"""One epoch, whoever trains it: what the single-device loop and every parallel worker share.

- ``EpochTally``: the per-step work and counting of an epoch (first-batch checks, the step,
  the loss summed on the device, batches, examples, time) and its summary;
- ``EpochRandomness``: the random stream in-step randomness (dropout) draws from in an
  epoch, seeded from (seed, epoch, stream) so that a run resumed at an epoch boundary draws
  the same masks, and carried in checkpoints so that a run resumed mid-epoch does too;
- ``check_finite`` and ``finish_epoch``: the NaN verdict and the counters of a completed epoch.

The loops around them differ only in where batches come from and when replicas meet.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from dl4py.errors import TrainingError
from dl4py.train.history import current_learning_rate


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


class EpochRandomness:
    """The random stream of ``model``'s epoch ``epoch`` (``stream``: a parallel worker's rank,
    so each draws its own dropout masks), without touching the caller's global RNG.

    At an epoch's start the generators are seeded from (seed, epoch, stream). A model that
    stopped part-way through the epoch carries its generators' state from that moment
    (``Model.randomness_state``, saved in its checkpoint); resumed there, the epoch goes on
    from that state, so the masks are those an uninterrupted run would have drawn."""

    def __init__(self, model, epoch: int, stream: int = 0):
        self.model, self.epoch, self.stream = model, epoch, stream
        device = model.backend.device
        self.cuda = device if device.type == "cuda" else None
        self._fork = None

    def __enter__(self) -> "EpochRandomness":
        devices = [self.cuda.index or 0] if self.cuda is not None else []
        self._fork = torch.random.fork_rng(devices=devices)
        self._fork.__enter__()
        value = getattr(self.model, "seed", 0) * 1_000_003 + self.epoch * 10_007 + self.stream
        # Only the generators fork_rng restores: torch.manual_seed would reseed every GPU.
        torch.random.default_generator.manual_seed(value)
        if self.cuda is not None:
            with torch.cuda.device(self.cuda):
                torch.cuda.manual_seed(value)
        saved = self.model.randomness_state()  # None at an epoch boundary
        if saved is not None and tuple(saved["position"]) == (self.epoch, self.model.batch_in_epoch, self.stream):
            self._set(saved)  # resumed where the state was taken: go on drawing from it
        self.model.set_randomness_state(None)
        self.model.epoch_randomness = self
        return self

    def __exit__(self, *exc) -> None:
        model = self.model
        model.epoch_randomness = None
        unfinished = model.epoch_count == self.epoch and model.batch_in_epoch > 0
        model.set_randomness_state(self.snapshot() if unfinished else None)
        self._fork.__exit__(*exc)

    def snapshot(self) -> dict:
        """The generators' state now, at the model's position in the epoch."""
        state = {"position": (self.epoch, self.model.batch_in_epoch, self.stream),
                 "cpu": torch.random.default_generator.get_state()}
        if self.cuda is not None:
            state["cuda"] = torch.cuda.get_rng_state(self.cuda)
        return state

    def _set(self, saved: dict) -> None:
        torch.random.default_generator.set_state(saved["cpu"])
        if self.cuda is not None and saved.get("cuda") is not None:
            torch.cuda.set_rng_state(saved["cuda"], self.cuda)


def epoch_rng(model, epoch: int, stream: int = 0) -> EpochRandomness:
    """The context that seeds (or resumes) the epoch's in-step randomness: ``EpochRandomness``."""
    return EpochRandomness(model, epoch, stream)
