"""The distributed layout: what every sharded, tensor-parallel or hybrid plan tells the rank
program about a replica it has laid out across the ranks (``Model.parallel_layout``).

``sharding.ShardedReplica`` and ``tensor_replica.TensorParallelReplica`` implement all of it;
the rank program (``rank.py``, ``round_meeting.py``) asks nothing else and tests no mode.
"""

from __future__ import annotations

from typing import Protocol

import torch


class DistributedLayout(Protocol):
    replica: object  # the distributed model that trains (a Model)
    twin: object | None  # rank 0's plain copy on the host, filled by gather; None on the other ranks
    data_workers: int  # how many streams of batches the ranks read (fewer than the ranks: tensor groups)

    def data_rank(self, rank: int) -> int:
        """Which of the ``data_workers`` streams ``rank`` reads."""

    def remember(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        """The batch this rank trained last (a round it sits out may need its shape)."""

    def sit_out(self) -> None:
        """A round without a batch of this rank: the step the plan's collectives still need."""

    def gather(self):
        """Collect the whole state into the twin (a collective: every rank calls it); the twin."""
