"""A tensor-parallel or hybrid replica as the rank program sees it (``parallel_layout``).

``tensor_parallel.apply_tensor_parallel`` converts the model (its dense pairs split before
its optimizer is made over them, then the whole state loaded by name); this is its
``layout.DistributedLayout``, as ``sharding.ShardedReplica`` is the sharded mode's: how many
workers the batches are dealt to (and, where fewer than the ranks, which of them a rank is:
``data_rank``), what a rank without a batch in a round steps with, and ``gather``, which
fills rank 0's plain twin with the whole state (what is saved, scored and shown to listeners).
"""

from __future__ import annotations

from dl4py.parallel.distributed_state import full_state, load_full_state


class TensorParallelReplica:
    def __init__(self, replica, plan, twin=None):
        self.replica, self.plan, self.twin = replica, plan, twin
        # Tensor mode: one stream of batches per data group (1 on a 1-D mesh); hybrid: every rank.
        self.data_workers = plan.data_workers
        self.data_rank = plan.data_rank  # data_rank(rank): the stream that rank reads
        self._last = None
        self._gathered_at = None

    def remember(self, features, labels) -> None:
        self._last = (features, labels)

    def sit_out(self) -> None:
        """A round without a batch: the hybrid gathers every rank's rows at its first dense
        layer, so this rank steps with no rows (shaped as its last batch) rather than not at
        all; tensor mode applies the shared update without a batch of its own."""
        if self.plan.mode == "hybrid":
            features, labels = self._last
            self.replica.train_step(features[:0], labels[:0])
        else:
            self.replica.train_step(None, None)

    def gather(self):
        """The whole parameters and updater state into the twin (collective: every rank calls
        it; the ranks without a twin only take part). Returns the twin."""

        moment = self.replica.training_state.moment
        if moment != self._gathered_at:  # the same on every rank: all skip, or none
            self._gathered_at = moment
            model_state, optimizer_state = full_state(self.replica)
            if self.twin is not None:
                load_full_state(self.twin, model_state, optimizer_state)
        if self.twin is not None:
            self.twin.training_state.copy_from(self.replica.training_state)
        return self.twin
