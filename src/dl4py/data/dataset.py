"""DataSet: one batch (or a whole set) of features and labels, as DL4J's DataSet."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DataSet:
    """Features ``[n, ...]`` and labels: ``[n]`` int64 class indices, or ``[n, k]`` float targets."""

    features: torch.Tensor
    labels: torch.Tensor

    def __post_init__(self):
        if self.features.shape[0] != self.labels.shape[0]:
            raise ValueError(
                f"DataSet: {self.features.shape[0]} feature rows but {self.labels.shape[0]} label rows"
            )

    def num_examples(self) -> int:
        return int(self.features.shape[0])

    def to(self, device, non_blocking: bool = False) -> "DataSet":
        return DataSet(
            self.features.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
        )
