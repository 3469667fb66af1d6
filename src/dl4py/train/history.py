"""What ``fit`` returns: a History in Keras' shape, one entry per epoch.

    history = model.fit(train, epochs=5, validation=val)
    history.history["loss"]          # mean training loss of each epoch
    history.history["accuracy"]      # a classifier's accuracy on the epoch's training batches
    history.history["val_accuracy"]  # validation accuracy after each epoch
    history.epoch                    # [0, 1, 2, 3, 4]: the model's epoch numbers

Besides the losses and the validation metrics asked for, each epoch records its wall
time (``seconds``), ``samples_per_second`` and ``learning_rate``. The same keys make up
the epoch records of ``metrics.jsonl``. A History is also the sequence of the epochs'
``EpochSummary`` objects (``history[0].mean_loss``), as ``fit`` returned before.
"""

from __future__ import annotations

from typing import Iterator

# Per-epoch keys every History has, in this order; validation keys follow when there are any.
EPOCH_KEYS = ("loss", "seconds", "samples_per_second", "learning_rate")


class History:
    def __init__(self, summaries=()):
        self.history: dict[str, list] = {}
        self.epoch: list[int] = []
        self.summaries: list = []
        for summary in summaries:
            self.append(summary)

    def append(self, summary) -> None:
        """Add one finished epoch (an EpochSummary); a key missing from earlier epochs
        gets None there, so every list has one entry per epoch."""
        record = summary.record()
        for key in self.history.keys() - record.keys():
            self.history[key].append(None)
        for key, value in record.items():
            if key == "epoch":
                continue
            self.history.setdefault(key, [None] * len(self.epoch)).append(value)
        self.epoch.append(summary.epoch)
        self.summaries.append(summary)

    def extend(self, other: "History") -> None:
        for summary in other.summaries:
            self.append(summary)

    def last(self, key: str):
        """The latest epoch's value of ``key`` (None when it has none)."""
        values = self.history.get(key)
        return values[-1] if values else None

    def to_dict(self) -> dict:
        return {"epoch": list(self.epoch), **{k: list(v) for k, v in self.history.items()}}

    # The list of summaries ``fit`` returned before History: code written for it still works.
    def __len__(self) -> int:
        return len(self.summaries)

    def __getitem__(self, index):
        return self.summaries[index]

    def __iter__(self) -> Iterator:
        return iter(self.summaries)

    def __repr__(self) -> str:
        keys = ", ".join(self.history)
        return f"History({len(self.epoch)} epochs: {keys})"


def current_learning_rate(model) -> float | None:
    """The learning rate of the model's last update (a schedule's current value)."""
    optimizer = getattr(model, "optimizer", None)
    groups = getattr(optimizer, "param_groups", None)
    if not groups or "lr" not in groups[0]:
        return None
    return float(groups[0]["lr"])
