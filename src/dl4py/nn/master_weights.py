"""Float32 master weights for 16-bit parameters (precision ``half`` and ``bfloat16``).

The module that runs forward and backward holds 16-bit parameters; the updater steps a
float32 copy of each. After the update the copies are rounded back into the module.
An update smaller than half the 16-bit spacing of a weight therefore accumulates in the
master copy instead of vanishing. Memory: 4 extra bytes per parameter.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


class MasterWeights:
    def __init__(self, master_module: nn.Module, dtype: torch.dtype):
        self.master_module = master_module  # float32; the optimizer holds its parameters
        self.module = copy.deepcopy(master_module).to(dtype)
        self._low = list(self.module.parameters())
        self._high = list(master_module.parameters())

    def grads_to_master(self) -> None:
        """Move the 16-bit gradients of a backward into the float32 masters, adding them to
        what the masters hold: an accumulation window (``train/accumulate.py``) sums its
        batches in float32, not in 16 bits. The step clears the masters' gradients when an
        update's window begins, so one backward per update copies them."""
        for low, high in zip(self._low, self._high):
            if low.grad is None:
                continue
            if high.grad is None:
                high.grad = low.grad.to(torch.float32)
            else:
                high.grad.add_(low.grad)  # promoted to float32 as it is added
            low.grad = None

    @torch.no_grad()
    def master_to_module(self) -> None:
        torch._foreach_copy_(self._low, self._high)

    def named_master_parameters(self) -> dict[str, torch.Tensor]:
        return dict(self.master_module.named_parameters())
