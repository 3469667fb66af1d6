"""Which worker trains which batch: DL4J's rounds.

One round is one minibatch per worker. In an epoch of ``B`` batches and ``W`` workers,
round ``r`` gives batch ``r * W + i`` to worker ``i``; the last round may be short, and
the workers without a batch in it sit it out. Every batch is trained exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoundPlan:
    batches: int  # batches in the epoch
    workers: int

    @property
    def rounds(self) -> int:
        return -(-self.batches // self.workers)

    def batch_of(self, round_index: int, worker: int) -> int | None:
        """Index of the batch ``worker`` trains in ``round_index``, or None if it sits out."""
        index = round_index * self.workers + worker
        return index if index < self.batches else None

    def participants(self, round_index: int) -> int:
        return min(self.workers, self.batches - round_index * self.workers)

    def averages_after(self, round_index: int, frequency: int) -> bool:
        """Average after every ``frequency`` rounds, and always after the epoch's last round."""
        return (round_index + 1) % frequency == 0 or round_index == self.rounds - 1
