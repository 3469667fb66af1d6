"""Where a model is in its training: the counters and the last score, as one object.

A model owns one ``TrainingState`` (``Model.training_state``); trainers move it only through
the methods below, and checkpoints, resumes and shard gathering copy it whole, so that a
saved, gathered or resumed model is always at one consistent point:

- ``epoch``: completed epochs; ``batch_in_epoch``: batches done in the unfinished one (where
  a resumed run continues);
- ``iteration``: minibatches trained on; ``updates``: updates applied (fewer when loss
  scaling skipped some, or when ``accumulate_batches`` sums several batches into one);
- ``score``: the loss of the last training minibatch (or the workers' average), a tensor
  that may still be on the device: reading it is the caller's choice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

COUNTERS = ("epoch", "iteration", "updates", "batch_in_epoch")


@dataclass
class TrainingState:
    epoch: int = 0
    iteration: int = 0
    updates: int = 0
    batch_in_epoch: int = 0
    score: torch.Tensor | None = None

    def advance(self, batches: int = 1, position: int | None = None) -> None:
        """``batches`` more minibatches trained; ``position``: the epoch's batches done now
        (a parallel fit's rounds skip some), else ``batches`` more than before."""
        self.iteration += batches
        self.batch_in_epoch = self.batch_in_epoch + batches if position is None else position

    def count_update(self) -> None:
        self.updates += 1

    def agree_on_updates(self, updates: int) -> None:
        """Replicas averaged into one model take one count (the largest: parallel/averaging.py)."""
        self.updates = int(updates)

    def stop_at(self, batch_in_epoch: int) -> None:
        """The epoch stopped part-way, after ``batch_in_epoch`` of its batches."""
        self.batch_in_epoch = int(batch_in_epoch)

    def restart_epoch(self) -> None:
        """The unfinished epoch starts over (a fit that failed after training part of it)."""
        self.batch_in_epoch = 0

    def end_epoch(self) -> None:
        self.epoch += 1
        self.batch_in_epoch = 0

    def set_score(self, score) -> None:
        self.score = None if score is None else torch.as_tensor(score)

    def copy_from(self, other: "TrainingState") -> None:
        """All of ``other``'s position and score (a gathered twin takes its replica's)."""
        for name in COUNTERS:
            setattr(self, name, getattr(other, name))
        self.score = other.score

    @property
    def moment(self) -> tuple[int, int, int]:
        """(iteration, updates, epoch): equal moments hold the same trained state."""
        return self.iteration, self.updates, self.epoch

    def counters(self) -> dict[str, int]:
        """The counters under the names a model file keeps (``nn/model_file.py``)."""
        return {"epoch_count": self.epoch, "iteration_count": self.iteration,
                "batch_in_epoch": self.batch_in_epoch, "update_count": self.updates}

    def load_counters(self, saved: dict) -> None:
        """The counters of a model file's ``counters()``."""
        self.epoch, self.iteration = int(saved["epoch_count"]), int(saved["iteration_count"])
        self.batch_in_epoch, self.updates = int(saved["batch_in_epoch"]), int(saved["update_count"])
