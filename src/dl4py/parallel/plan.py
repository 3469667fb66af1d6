"""Which worker trains which batch: DL4J's rounds.

One round is one minibatch per worker. In an epoch of ``B`` batches and ``W`` workers,
round ``r`` gives batch ``r * W + i`` to worker ``i``; the last round may be short, and
the workers without a batch in it sit it out. Every batch is trained exactly once.

An epoch resumed part-way (after an interrupt) deals only the batches from ``start`` on,
in the same way: round ``r`` gives batch ``start + r * W + i`` to worker ``i``. With the
same ``W`` as before the stop (an interrupt stops after a whole round, so ``start`` is a
multiple of ``W`` unless the epoch was finished), these are the rounds the stopped run
had left.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoundPlan:
    batches: int  # batches in the epoch
    workers: int
    start: int = 0  # batches of the epoch trained before a resume

    @property
    def rounds(self) -> int:
        return -(-max(self.batches - self.start, 0) // self.workers)

    def batch_of(self, round_index: int, worker: int) -> int | None:
        """Index of the batch ``worker`` trains in ``round_index``, or None if it sits out."""
        index = self.start + round_index * self.workers + worker
        return index if index < self.batches else None

    def participants(self, round_index: int) -> int:
        return min(self.workers, self.batches - self.start - round_index * self.workers)

    def averages_after(self, round_index: int, frequency: int) -> bool:
        """Average after every ``frequency`` rounds (counted from the start or resume of the
        epoch: an interrupt averaged just before it), and always after the epoch's last round."""
        return (round_index + 1) % frequency == 0 or round_index == self.rounds - 1


@dataclass(frozen=True)
class OpenRoundPlan:
    """Rounds over shards that each worker reads itself (a streamed source): how many batches
    a shard holds is not known before it is read, so the epoch lasts until no worker has a
    batch left. Each round the workers agree whether any still has one (``worker.py``); a
    worker whose shard ran dry sits the remaining rounds out, and every example is trained
    once. ``start`` (the epoch's batches trained before a resume) counts ``workers`` per
    round: an interrupt stops after a whole round, and each worker skips that many rounds
    of its own shard."""

    workers: int
    start: int = 0

    batches = None  # unknown until read
    rounds = None

    @property
    def start_rounds(self) -> int:
        return self.start // self.workers

    def averages_after(self, round_index: int, frequency: int) -> bool:
        """Every ``frequency`` rounds; the epoch's end, known only once reached, averages apart."""
        return (round_index + 1) % frequency == 0
