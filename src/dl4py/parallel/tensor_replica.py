"""A tensor-parallel or hybrid replica as the rank program sees it (``parallel_layout``).

``tensor_parallel.apply_tensor_parallel`` converts the model; this adds what ``run_rank`` and
``train_epoch`` ask of every distributed layout, as ``sharding.ShardedReplica`` does for the
sharded mode: how many workers the batches are dealt to (and, where fewer than the ranks,
which of them a rank is: ``data_rank``), what a rank without a batch in a round steps with,
and ``gather``, which fills rank 0's plain twin with the whole state (what is saved, scored
and shown to listeners).
"""

from __future__ import annotations


class TensorParallelReplica:
    def __init__(self, replica, plan, twin=None):
        self.replica, self.plan, self.twin = replica, plan, twin
        # Tensor mode: one stream of batches per data group (1 on a 1-D mesh); hybrid: every rank.
        self.data_workers = plan.data_workers
        self.data_rank = plan.data_rank  # data_rank(rank): the stream that rank reads
        # The hybrid gathers every rank's rows at its first dense layer: a rank whose data ran
        # out in a round steps with no rows rather than not at all.
        self.steps_on_empty_batches = plan.mode == "hybrid"
        self._last = None
        self._gathered_at = None

    def remember(self, features, labels) -> None:
        self._last = (features, labels)

    def empty_batch(self):
        """A batch of no rows, shaped as this rank's last one."""
        features, labels = self._last
        return features[:0], labels[:0]

    def gather(self):
        """The whole parameters and updater state into the twin (collective: every rank calls
        it; the ranks without a twin only take part). Returns the twin."""
        from dl4py.parallel.distributed_state import full_state, load_full_state
        from dl4py.parallel.sharding import copy_counters

        moment = (self.replica.iteration_count, self.replica.update_count, self.replica.epoch_count)
        if moment != self._gathered_at:  # the same on every rank: all skip, or none
            self._gathered_at = moment
            model_state, optimizer_state = full_state(self.replica)
            if self.twin is not None:
                load_full_state(self.twin, model_state, optimizer_state)
        if self.twin is not None:
            copy_counters(self.replica, self.twin)
        return self.twin
