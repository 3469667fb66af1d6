"""Replay a training step's allocations and frees, without allocating anything.

The estimator walks the step in the order PyTorch runs it (forward operator by operator,
backward in reverse, then the update) and ``Timeline`` keeps the live bytes of each kind.
The step's peak, and what was alive at that moment, is the answer.
"""

from __future__ import annotations

KINDS = ("parameters", "updater_state", "input", "gradients", "activations", "workspace")


class Timeline:
    def __init__(self, round_to: int = 1):
        self.round_to = round_to  # the CUDA allocator hands out multiples of 512 bytes
        self.live = dict.fromkeys(KINDS, 0)
        self.peak = 0
        self.peak_live = dict(self.live)
        self.peak_phase = "start"

    def size(self, nbytes: float) -> int:
        n = int(nbytes)
        if n <= 0:
            return 0
        return -(-n // self.round_to) * self.round_to

    def alloc(self, kind: str, nbytes: float, phase: str) -> int:
        n = self.size(nbytes)
        self.live[kind] += n
        total = sum(self.live.values())
        if total > self.peak:
            self.peak, self.peak_live, self.peak_phase = total, dict(self.live), phase
        return n

    def free(self, kind: str, nbytes: float) -> None:
        self.live[kind] -= self.size(nbytes)
