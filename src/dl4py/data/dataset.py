"""DataSet: one batch (or a whole set) of features and labels, as DL4J's DataSet."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DataSet:
    """Features ``[n, ...]`` and labels: ``[n]`` int64 class indices, or ``[n, k]`` float targets.

    ``features_mask`` (DL4J's feature mask array), for padded sequences ``[n, time, size]``:
    ``[n, time]``, 1 for a real step and 0 for padding, real steps first in every row
    (``data/sequences.py`` makes such batches)."""

    features: torch.Tensor
    labels: torch.Tensor
    features_mask: torch.Tensor | None = None

    def __post_init__(self):
        if self.features.shape[0] != self.labels.shape[0]:
            raise ValueError(
                f"DataSet: {self.features.shape[0]} feature rows but {self.labels.shape[0]} label rows"
            )
        if self.features_mask is not None:
            _check_mask(self.features_mask, self.features)

    def num_examples(self) -> int:
        return int(self.features.shape[0])

    def to(self, device, non_blocking: bool = False) -> "DataSet":
        mask = self.features_mask
        return DataSet(
            self.features.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
            None if mask is None else mask.to(device, non_blocking=non_blocking),
        )


def _check_mask(mask: torch.Tensor, features: torch.Tensor) -> None:
    if mask.dim() != 2 or features.dim() < 2 or tuple(mask.shape) != tuple(features.shape[:2]):
        raise ValueError(
            f"DataSet: features_mask has shape {list(mask.shape)} but features {list(features.shape)} "
            f"need [{', '.join(map(str, features.shape[:2]))}] (one entry per example and step)"
        )
    if mask.device.type == "cpu" and mask.numel():  # real steps first: padding only at the end
        steps = mask != 0
        if bool((steps[:, 1:] & ~steps[:, :-1]).any()):
            raise ValueError("DataSet: features_mask must hold each sequence's real steps first, "
                             "then padding (1...1 0...0 in every row)")
