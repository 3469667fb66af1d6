"""Ranks meeting round by round: the ``Meeting`` of every parallel worker's epoch.

``rank.run_rank`` runs ``train.epoch.run_epoch`` for each epoch with a ``RoundMeeting``, in a
worker of the ParallelWrapper's pool and in a process torchrun launched alike. Each round,
every data worker trains one batch of its own (or sits the round out when the data has
fewer); in averaging mode the replicas are averaged every ``averaging_frequency`` rounds and
at the end of each epoch, in shared-gradients mode gradients are averaged every step.

Stopping early (Ctrl-C or SIGTERM, at the coordinator or at any one rank): at each
averaging boundary (every round in shared-gradients, sharded, tensor and hybrid modes) the
workers vote on ``should_stop`` (one all-reduce of one number); if any says yes, all stop
after that same round, with the replicas just averaged, and learn which ranks got a signal
(``RankReport.signalled``). Voting only where the workers synchronise anyway keeps the
averaging mode's rare synchronisation rare (a stop there waits for the next average), and
the stopped state is one an uninterrupted run passes through, so a resumed run continues
exactly. The replica's ``batch_in_epoch`` then counts the epoch's batches trained.

Accumulation (``model.accumulate_batches`` = k): each worker sums the gradients of k of
its own batches (k rounds) before an update, which in shared-gradients mode is when the
workers average their gradients. ``averaging_frequency`` counts updates: the replicas are
averaged every ``averaging_frequency * k`` rounds, always between updates, and the workers
vote on stopping there too. The epoch's last round, or a stop, applies an open window first.
Tensor mode's data groups accumulate alike; the hybrid and sharded modes refuse k > 1
(``config.parallel.check_mode_fits_model``).

Listeners and early stopping: a pool's worker 0 relays its events to the coordinator,
which runs them (``events.py``); under torchrun, rank 0 runs the fit's listeners and the
early-stopping controller's epoch decisions itself. Either way every worker asks the
iteration conditions (time, NaN) about its own losses and all follow rank 0's decision.
"""

from __future__ import annotations

import itertools
import logging
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from dl4py.backend.cuda_environment import environment
from dl4py.config.parallel import STEP_MODES
from dl4py.errors import DataError
from dl4py.parallel import collectives
from dl4py.parallel.averaging import agree_on_loss_scaling, average, mean_over_participants, replica_state
from dl4py.parallel.phase import PHASE
from dl4py.parallel.plan import OpenRoundPlan, RoundPlan
from dl4py.parallel.sources import Prefetcher, ShardedSource
from dl4py.train import accumulate
from dl4py.train.early_stopping.controller import first_firing
from dl4py.train.epoch import Turn, check_finite, epoch_rng, finish_epoch
from dl4py.train.numbering import epoch_name, round_name

log = logging.getLogger("dl4py")


class RoundMeeting:
    """This rank's epochs of rounds: ``source``'s batches for ``rank`` of ``world`` under
    ``spec`` (a WorkerSpec), on ``device``; ``report`` (a RankReport) learns of a stop;
    ``should_stop()`` is asked at each averaging boundary (None: never)."""

    def __init__(self, rank: int, world: int, spec, source, device, report, should_stop=None):
        self.rank, self.ranks, self.spec, self.source = rank, world, spec, source
        self.device, self.report, self.should_stop = device, report, should_stop
        self.step_mode = spec.options.parallelism.mode in STEP_MODES
        self.last_loss = None  # this worker's last batch's loss in the epoch (what averaging scores)

    # -- the epoch's plan -------------------------------------------------------------
    def begin(self, replica, epoch: int) -> None:
        self.epoch, self.start = epoch, replica.batch_in_epoch  # start > 0: resumed part-way through
        self.layout = layout = replica.parallel_layout
        # Every rank counts its batches and loss; tensor parallel ranks count the same ones:
        # the ranks of a tensor group train the batches of one data worker, together.
        self.data_rank, self.world = self.rank, self.ranks
        if layout is not None:
            self.data_rank, self.world = layout.data_rank(self.rank), layout.data_workers
        world, batches = self.world, self.spec.num_batches
        self.plan = RoundPlan(batches, world, self.start) if batches is not None else OpenRoundPlan(world, self.start)
        if self.plan.rounds is None and self.start % world:
            raise DataError(f"the model stopped after batch {self.start} of {epoch_name(epoch)}, which is not a "
                            f"whole round of {world} workers over a streamed source: resume it with the number of "
                            "workers it stopped with, or from the start of an epoch")
        if batches and batches < world:
            raise DataError(f"the data has {self.plan.batches} batches per epoch but there are {world} workers; "
                            "use fewer workers or a smaller batch size")
        # Averages and stop votes fall between updates: a window is never averaged half-summed.
        self.rounds_per_average = self.spec.options.rounds_per_average * replica.accumulate_batches
        # Listeners count in the model's units: ``round_batches`` is every worker's batches of the
        # epoch so far, in this fit; ``first_round`` the epoch's rounds trained before a resume.
        self.round_batches, self.first_round = 0, self.start // world
        self.trained_since_average, self.rounds_done, self.averaged, self.ended_early = False, 0, True, False
        self.last_loss = None

    @contextmanager
    def turns(self, replica, epoch: int):
        batches_out = self.source.batches(epoch, self.data_rank, self.world, self.start)
        if not isinstance(self.source, ShardedSource):
            # Labels an in-memory source checked when it was made need no second look; others (a
            # stream, a user's iterator) are checked batch by batch on the host, before the copy
            # to the device: no sync, and no device-side assert from the loss on a GPU.
            batches_out = _labels_checked(batches_out, replica, f"worker {self.data_rank}, {epoch_name(epoch)}",
                                          self.first_round)
        prefetcher = Prefetcher(batches_out, self.device, self.spec.options.prefetch_buffer,
                                pin=environment().pinned_memory, timeout=self.spec.options.timeout)
        try:
            with epoch_rng(replica, epoch, stream=self.data_rank) as randomness:  # distinct dropout masks per worker
                rounds = self._rounds(replica, iter(prefetcher), randomness)
                try:
                    yield rounds
                finally:
                    rounds.close()
                self._after_rounds(replica)
        finally:
            prefetcher.close()
            replica.set_mask(None)  # no batch's mask outlives the epoch (a launched rank's replica is the user's model)

    def _rounds(self, replica, batches_in, randomness):
        plan, world, rank = self.plan, self.world, self.data_rank
        for round_index in range(plan.rounds) if plan.rounds is not None else itertools.count():
            randomness.at(self.first_round + round_index)  # the round's own, however the epoch was resumed
            PHASE.at_round(self.epoch, self.first_round + round_index)  # for the watchdog: attribute writes
            if plan.rounds is None:  # a streamed shard: go on while any worker has a batch
                item = next(batches_in, None)
                in_round = _batches_in_round(item is not None, self.device) * world // self.ranks  # tensor: 1
                if not in_round:
                    return
            else:
                mine = plan.batch_of(round_index, rank) is not None
                item = next(batches_in, None) if mine else None
                if mine and item is None:
                    raise DataError(f"worker {rank} ran out of batches in {round_name(self.first_round + round_index)} "
                                    f"of {epoch_name(self.epoch)}")
                in_round = plan.participants(round_index)
            self.round_batches += in_round
            if item is None:
                yield Turn(None, None, "", round_index)
                continue
            _, features, labels, mask = item
            replica.set_mask(mask)  # padded sequences: the batch's own mask, as prepare_batch sets it
            features = replica.prepare_input(features)  # dtype and memory format
            if self.layout is not None:  # a round it sits out steps with these (parallel_layout)
                self.layout.remember(features, labels)
            if self.spec.record_examples:
                self.report.records.append(features[:, 0].detach().to("cpu", torch.float64))
            # The round's examples as worker 0's batch size times its batches: the epoch's last
            # batch, maybe shorter and another worker's, counts as full.
            where = f"worker {rank}, {epoch_name(self.epoch)}, {round_name(self.first_round + round_index)}"
            yield Turn(features, labels, where, round_index,
                       replica.iteration_count + self.round_batches, features.shape[0] * in_round)

    # -- each round ---------------------------------------------------------------------
    def trained(self, replica, turn: Turn) -> None:
        self.trained_since_average = True

    def sit_out(self, replica, turn: Turn) -> None:
        if self.layout is not None:
            self.layout.sit_out()  # what the plan's collectives need of a rank without a batch
        elif self.step_mode:
            replica.train_step(None, None)  # apply the shared update without a batch of its own
        else:  # a streamed shard ran dry: its last window now, not after later averages
            accumulate.finish(replica)

    def ends_after(self, replica, turn: Turn, tally) -> bool:
        round_index, plan, spec = turn.index, self.plan, self.spec
        self.last_loss = tally.last_loss
        stop = None
        if spec.iteration_conditions:
            # Only then: asking means a collective and a read of the loss every round.
            stop = _iteration_stop(spec.iteration_conditions, tally.last_loss, turn.features is not None, self.device)
        if stop is not None or (plan.rounds is not None and round_index == plan.rounds - 1):
            # Every worker at once (shared gradients meet in the update): the window the
            # epoch's end or a stop cut short is applied.
            accumulate.finish(replica)
        last_round = plan.averages_after(round_index, self.rounds_per_average)
        wanted = self.should_stop() if self.should_stop is not None and last_round else None
        halt = self.should_stop is not None and last_round and _stop_vote(wanted, self.device)
        if spec.options.parallelism.mode == "averaging" and (last_round or stop is not None):
            self._average(replica, round_index)
        self.rounds_done = round_index + 1
        self.averaged = last_round or stop is not None
        if stop is not None:
            self.report.stop = ("IterationTerminationCondition", stop)
        elif halt:
            self.report.interrupted = True
            self.report.signalled = _signalled(wanted)
        self.ended_early = stop is not None or bool(halt)
        return self.ended_early

    def _after_rounds(self, replica) -> None:
        """After the last round, on every worker alike."""
        if self.plan.rounds is not None:
            if not self.ended_early:
                self.averaged = True  # a fixed plan's last round averages
            return
        accumulate.finish(replica)  # a streamed epoch's last window
        if self.spec.options.parallelism.mode == "averaging" and not self.averaged and self.rounds_done:
            # A streamed epoch's end is known only once no worker has a batch: average now.
            self._average(replica, self.rounds_done - 1)

    def _average(self, replica, round_index: int) -> None:
        """Average the replicas after ``round_index`` of the epoch."""
        started = time.perf_counter()
        iteration = replica.iteration_count + self.round_batches  # the model's count, as the listeners see it
        count = average(replica_state(replica, self.spec.options.averages_updater_state), self.trained_since_average)
        agree_on_loss_scaling(replica, self.device)  # one scaler state again, as one model: what a checkpoint keeps
        replica.precision_state.after_sync()
        score = mean_over_participants(self.last_loss, self.trained_since_average, self.device)
        self.trained_since_average = False
        replica.set_score(score)
        if not self.spec.early_stopping:  # with early stopping, its InvalidScore decides instead
            check_finite(replica, replica.last_score, replica.epoch_count)  # same verdict on every worker
        if self.spec.options.report_score_after_averaging and self.data_rank == 0:
            log.info("%s, %s, iteration %d: averaged score %.6f across %d workers (averaging took %.1f ms)",
                     epoch_name(replica.epoch_count), round_name(self.first_round + round_index), iteration, score,
                     int(count),
                     (time.perf_counter() - started) * 1000)

    # -- the epoch's end ----------------------------------------------------------------
    def close(self, replica, tally):
        right, judged = tally.accuracy.counts() if tally.accuracy is not None else (0, 0)
        totals = torch.tensor([tally.examples, tally.batches, float(tally.loss_sum), right, judged],
                              dtype=torch.float64, device=self.device)
        collectives.all_reduce(totals)
        if self.ranks > self.world:  # tensor parallel: each rank of a tensor group counted the same batches
            totals /= self.ranks // self.world
        all_examples, all_batches, all_loss = int(totals[0]), int(totals[1]), float(totals[2])
        accuracy = float(totals[3] / totals[4]) if totals[4] > 0 else None  # every worker's training batches
        skipped = tally.skipped_steps
        if skipped is not None:  # the replica that skipped most (in shared-gradients mode all skip alike)
            most = torch.tensor([float(skipped)], device=self.device)
            collectives.all_reduce(most, op=dist.ReduceOp.MAX)
            skipped = int(most.item())
        report = self.report
        if all_batches == 0 and self.start == 0 and report.stop is None:  # as the single-device loop says
            raise DataError(f"the data gave no batches in {epoch_name(self.epoch)} "
                            f"(worker {self.data_rank} of {self.world})")
        if self.step_mode and all_batches:  # all_batches: the same on every rank
            # The workers' last losses, as averaging mode's score and one process's last loss: not
            # the epoch's mean, which a resumed epoch would take over its second part alone.
            replica.set_score(mean_over_participants(tally.last_loss, tally.last_loss is not None, self.device))
        if self.plan.rounds is None:
            completed = report.stop is None and not report.interrupted
        else:  # an interrupt in the last round still completes the epoch
            completed = report.stop is None and self.rounds_done == self.plan.rounds
        if completed:
            finish_epoch(replica, totals[2], self.epoch)
            position = 0
        elif self.plan.rounds is None:
            position = self.start + self.rounds_done * self.world  # each worker skips that many rounds
        else:
            position = self.start + all_batches  # where a resumed run continues
        replica.training_state.advance(all_batches, position=position)
        return tally.summary(completed, all_batches, all_examples, all_loss, skipped, accuracy)  # every worker's counted


def _iteration_stop(conditions, last_loss, mine: bool, device) -> str | None:
    """Every worker asks the iteration conditions about its own last loss; if any fires,
    all stop in this round. The reason reported is the first firing worker's."""
    local = first_firing(conditions, float(last_loss)) if mine and last_loss is not None else None
    flag = torch.tensor([1.0 if local is not None else 0.0], device=device)
    collectives.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() == 0:
        return None
    reasons = collectives.all_gather_object(local)
    return next((f"{r} (worker {i})" for i, r in enumerate(reasons) if r is not None), "iteration condition")


def _stop_vote(wanted, device) -> bool:
    """True on every worker if any of them wants to stop."""
    flag = torch.tensor([1.0 if wanted else 0.0], device=device)
    collectives.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() > 0


def _signalled(wanted) -> tuple[str, list[int]] | None:
    """After a vote to stop, on every rank: the signal and the ranks that got one themselves
    (``wanted`` names it: "SIGTERM"), or None when only the launcher asked. Once per fit."""
    answers = collectives.all_gather_object(wanted if isinstance(wanted, str) else None)
    ranks = [rank for rank, answer in enumerate(answers) if answer is not None]
    return (answers[ranks[0]], ranks) if ranks else None


def _labels_checked(batches, replica, where: str, first_round: int):
    """``(round, DataSet)`` pairs as they come, each batch's labels checked on the host; the
    rounds count from this fit's first (``first_round`` of the epoch, after a resume)."""
    for round_index, batch in batches:
        if batch.labels.device.type == "cpu":
            replica.check_labels(batch.labels, f"{where}, {round_name(first_round + round_index)}")
        yield round_index, batch


def _batches_in_round(mine: bool, device) -> int:
    """How many workers have a batch this round, 0 when none has (one small all-reduce a
    round, streamed shards only)."""
    count = torch.tensor([1.0 if mine else 0.0], device=device)
    collectives.all_reduce(count)
    return int(count.item())
