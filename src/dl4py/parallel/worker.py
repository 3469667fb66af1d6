"""One parallel worker's epoch: a model replica on its device, trained round by round.

``rank.run_rank`` calls ``train_epoch`` for each epoch, in a worker of the ParallelWrapper's
pool and in a process torchrun launched alike. Each worker runs the single-device
trainer's step function on its own batches; in averaging mode the replicas are averaged
every ``averaging_frequency`` rounds and at the end of each epoch, in shared-gradients
mode gradients are averaged every step.

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
(``options.check_mode_fits_model``).

Listeners and early stopping: a pool's worker 0 relays its events to the coordinator,
which runs them (``events.py``); under torchrun, rank 0 runs the fit's listeners and the
early-stopping controller's epoch decisions itself. Either way every worker asks the
iteration conditions (time, NaN) about its own losses and all follow rank 0's decision.
"""

from __future__ import annotations

import io
import itertools
import logging
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dl4py.backend import Backend
from dl4py.backend.cuda_environment import environment
from dl4py.errors import DataError
from dl4py.parallel.averaging import agree_on_loss_scaling, average, mean_over_participants, replica_state
from dl4py.parallel.options import STEP_MODES, ParallelOptions
from dl4py.parallel.phase import PHASE
from dl4py.parallel.plan import OpenRoundPlan, RoundPlan
from dl4py.parallel.sources import Prefetcher, ShardedSource
from dl4py.train import accumulate
from dl4py.train.early_stopping.controller import first_firing
from dl4py.train.epoch import EpochSummary, EpochTally, check_finite, epoch_rng, finish_epoch

log = logging.getLogger("dl4py")


@dataclass
class WorkerSpec:
    """Everything a worker needs for one fit, as plain picklable data."""

    model_file: str | bytes  # the model to replicate as of this fit: a path or the bytes of Model.save's file
    torch_model: object | None  # a TorchModel (bytes in a pool) to load model_file into; None: MultiLayerNetwork
    source: object | None  # ShardedSource / StrideSource; None: batches come through a queue
    num_batches: int | None  # None: a streamed source read in shards, its length unknown (OpenRoundPlan)
    epochs: int
    options: ParallelOptions  # validated
    devices: list[str]  # worker i trains on devices[i % len(devices)]
    precision: str
    threads: int | None = None
    environment: dict | None = None
    record_examples: bool = False  # return the first feature of every trained example (for tests)
    early_stopping: bool = False  # rank 0 decides after each epoch whether all stop
    iteration_conditions: list = field(default_factory=list)  # early stopping's: every worker asks them
    relay_epochs: bool = False  # spawned worker 0 sends each epoch's end (and state) to the coordinator
    relay_iterations: bool = False  # ... and its steps and epoch starts (the coordinator has listeners)
    # Listeners' parts spawned worker 0 runs on its replica, for listeners that must read the
    # live model (a StatsListener's collector); what they make is relayed (events.py).
    listener_parts: list = field(default_factory=list)
    # The coordinator's "dl4py" level where the spec is made (at fit start): spawned workers
    # send it their records from this level up, and make none below it.
    log_level: int = field(default_factory=lambda: logging.getLogger("dl4py").getEffectiveLevel())
    accumulate_batches: int = 1  # the model's: batches (rounds) whose gradients make one update


def worker_device(spec: WorkerSpec, rank: int) -> torch.device:
    return torch.device(spec.devices[rank % len(spec.devices)])


def build_replica(spec: WorkerSpec, device: torch.device):
    from dl4py.nn.loading import load
    from dl4py.nn.serialization import restore_state

    backend = Backend("gpu" if device.type == "cuda" else "cpu", device, "parallel worker")
    if spec.torch_model is None:
        return load(spec.model_file, backend=backend, precision=spec.precision)
    model = spec.torch_model
    if isinstance(model, bytes):  # a spawned worker's private copy (preflight.private_copy)
        model = torch.load(io.BytesIO(model), map_location="cpu", weights_only=False)
    if model.module is None:  # a copy: built here, on this worker's device
        model.place(backend, spec.precision)
    # else the launched process's own model (torchrun, Spark), built where its program built it
    restore_state(model, spec.model_file)
    return model


def _iteration_stop(conditions, last_loss, mine: bool, device) -> str | None:
    """Every worker asks the iteration conditions about its own last loss; if any fires,
    all stop in this round. The reason reported is the first firing worker's."""
    local = first_firing(conditions, float(last_loss)) if mine and last_loss is not None else None
    flag = torch.tensor([1.0 if local is not None else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() == 0:
        return None
    reasons = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, local)
    return next((f"{r} (worker {i})" for i, r in enumerate(reasons) if r is not None), "iteration condition")


def _stop_vote(wanted, device) -> bool:
    """True on every worker if any of them wants to stop."""
    flag = torch.tensor([1.0 if wanted else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() > 0


def _signalled(wanted) -> tuple[str, list[int]] | None:
    """After a vote to stop, on every rank: the signal and the ranks that got one themselves
    (``wanted`` names it: "SIGTERM"), or None when only the launcher asked. Once per fit."""
    answers = [None] * dist.get_world_size()
    dist.all_gather_object(answers, wanted if isinstance(wanted, str) else None)
    ranks = [rank for rank, answer in enumerate(answers) if answer is not None]
    return (answers[ranks[0]], ranks) if ranks else None


def train_epoch(replica, rank, world, spec, source, device, report, listeners, should_stop) -> EpochSummary:
    """One epoch of this worker's rounds; ``report`` (a RankReport) learns of a stop."""
    epoch = replica.epoch_count
    start = replica.batch_in_epoch  # > 0: resumed after an interrupt part-way through this epoch
    layout = replica.parallel_layout
    ranks = world  # every rank counts its batches and loss; tensor parallel ranks count the same ones
    if layout is not None and layout.data_workers < world:
        # Tensor parallel: the ranks of a tensor group train the batches of one data worker, together.
        rank, world = layout.data_rank(rank), layout.data_workers
    plan = RoundPlan(spec.num_batches, world, start) if spec.num_batches is not None else OpenRoundPlan(world, start)
    if plan.rounds is None and start % world:
        raise DataError(f"the model stopped after batch {start} of epoch {epoch}, which is not a whole round of "
                        f"{world} workers over a streamed source: resume it with the number of workers it "
                        "stopped with, or from the start of an epoch")
    if spec.num_batches and spec.num_batches < world:
        raise DataError(
            f"the data has {plan.batches} batches per epoch but there are {world} workers; "
            "use fewer workers or a smaller batch size"
        )
    for listener in listeners:
        listener.on_epoch_start(replica, epoch)
    tally = EpochTally(replica, epoch)  # the steps and their counts, as on a single device
    last_loss, trained_since_average = None, False
    rounds_done, averaged = 0, True
    # Averages and stop votes fall between updates: a window is never averaged half-summed.
    rounds_per_average = spec.options.rounds_per_average * replica.accumulate_batches
    # Listeners count in the model's units: ``trained`` is every worker's batches of the
    # epoch so far, in this fit; ``first_round`` the epoch's rounds trained before a resume.
    trained, first_round = 0, start // world
    batches_out = source.batches(epoch, rank, world, start)
    if not isinstance(source, ShardedSource):
        # Labels an in-memory source checked when it was made need no second look; others (a
        # stream, a user's iterator) are checked batch by batch on the host, before the copy
        # to the device: no sync, and no device-side assert from the loss on a GPU.
        batches_out = _labels_checked(batches_out, replica, f"worker {rank}, epoch {epoch}")
    prefetcher = Prefetcher(batches_out, device, spec.options.prefetch_buffer,
                            pin=environment().pinned_memory, timeout=spec.options.timeout)
    batches_in = iter(prefetcher)
    try:
        with epoch_rng(replica, epoch, stream=rank) as randomness:  # distinct dropout masks per worker
            for round_index in range(plan.rounds) if plan.rounds is not None else itertools.count():
                randomness.at(first_round + round_index)  # the round's own, however the epoch was resumed
                PHASE.at_round(epoch, first_round + round_index)  # for the watchdog: attribute writes
                if plan.rounds is None:  # a streamed shard: go on while any worker has a batch
                    item = next(batches_in, None)
                    in_round = _batches_in_round(item is not None, device) * world // ranks  # tensor parallel: 1
                    if not in_round:
                        break
                    mine = item is not None
                else:
                    mine = plan.batch_of(round_index, rank) is not None
                    item = next(batches_in, None) if mine else None
                    if mine and item is None:
                        raise DataError(f"worker {rank} ran out of batches in round {round_index} of epoch {epoch}")
                    in_round = plan.participants(round_index)
                trained += in_round
                if mine:
                    _, features, labels, mask = item
                    replica.set_mask(mask)  # padded sequences: the batch's own mask, as prepare_batch sets it
                    features = replica.prepare_input(features)  # dtype and memory format
                    if layout is not None:  # a round it sits out steps with these (parallel_layout)
                        layout.remember(features, labels)
                    last_loss = tally.train(features, labels, f"worker {rank}, epoch {epoch}")
                    trained_since_average = True
                    if spec.record_examples:
                        report.records.append(features[:, 0].detach().to("cpu", torch.float64))
                    for listener in listeners:
                        # The round's examples as worker 0's batch size times its batches: the
                        # epoch's last batch, maybe shorter and another worker's, counts as full.
                        listener.iteration_done(replica, replica.iteration_count + trained, epoch, last_loss,
                                                features.shape[0] * in_round)
                elif layout is not None and layout.steps_on_empty_batches:
                    replica.train_step(*layout.empty_batch())  # the hybrid's gather needs every rank's rows, even none
                elif spec.options.training_mode in STEP_MODES:
                    replica.train_step(None, None)  # apply the shared update without a batch of its own
                else:  # a streamed shard ran dry: its last window now, not after later averages
                    accumulate.finish(replica)
                stop = None
                if spec.iteration_conditions:
                    # Only then: asking means a collective and a read of the loss every round.
                    stop = _iteration_stop(spec.iteration_conditions, last_loss, mine, device)
                if stop is not None or (plan.rounds is not None and round_index == plan.rounds - 1):
                    # Every worker at once (shared gradients meet in the update): the window
                    # the epoch's end or a stop cut short is applied.
                    accumulate.finish(replica)
                last_round = plan.averages_after(round_index, rounds_per_average)
                wanted = should_stop() if should_stop is not None and last_round else None
                halt = should_stop is not None and last_round and _stop_vote(wanted, device)
                if spec.options.training_mode == "averaging" and (last_round or stop is not None):
                    _average(replica, spec, rank, first_round + round_index, replica.iteration_count + trained,
                             last_loss, trained_since_average, device)
                    trained_since_average = False
                rounds_done = round_index + 1
                averaged = last_round or stop is not None
                if stop is not None:
                    report.stop = ("IterationTerminationCondition", stop)
                    break
                if halt:
                    report.interrupted = True
                    report.signalled = _signalled(wanted)
                    break
            else:
                averaged = True  # a fixed plan's last round averages
            if plan.rounds is None:
                accumulate.finish(replica)  # a streamed epoch's last window, on every worker alike
            if spec.options.training_mode == "averaging" and plan.rounds is None and not averaged and rounds_done:
                # A streamed epoch's end is known only once no worker has a batch: average now.
                _average(replica, spec, rank, first_round + rounds_done - 1, replica.iteration_count + trained,
                         last_loss, trained_since_average, device)
    finally:
        prefetcher.close()
        replica.set_mask(None)  # no batch's mask outlives the epoch (a launched rank's replica is the user's model)
    totals = torch.tensor([tally.examples, tally.batches, float(tally.loss_sum)], dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    if ranks > world:  # tensor parallel: each rank of a tensor group counted the same batches
        totals /= ranks // world
    all_examples, all_batches, all_loss = int(totals[0]), int(totals[1]), float(totals[2])
    if all_batches == 0 and start == 0 and report.stop is None:  # as the single-device loop says
        raise DataError(f"the data gave no batches in epoch {epoch} (worker {rank} of {world})")
    if spec.options.training_mode in STEP_MODES and all_batches:  # all_batches: the same on every rank
        # The workers' last losses, as averaging mode's score and one process's last loss: not
        # the epoch's mean, which a resumed epoch would take over its second part alone.
        replica.set_score(mean_over_participants(last_loss, last_loss is not None, device))
    if plan.rounds is None:
        completed = report.stop is None and not report.interrupted
    else:  # an interrupt in the last round still completes the epoch
        completed = report.stop is None and rounds_done == plan.rounds
    if completed:
        finish_epoch(replica, totals[2], epoch)
    elif plan.rounds is None:
        replica.batch_in_epoch = start + rounds_done * world  # each worker skips that many rounds
    else:
        replica.batch_in_epoch = start + all_batches  # where a resumed run continues
    replica.iteration_count += all_batches
    return tally.summary(completed, all_batches, all_examples, all_loss)  # every worker's counted


def _labels_checked(batches, replica, where: str):
    """``(round, DataSet)`` pairs as they come, each batch's labels checked on the host."""
    for round_index, batch in batches:
        if batch.labels.device.type == "cpu":
            replica.check_labels(batch.labels, f"{where}, round {round_index}")
        yield round_index, batch


def _batches_in_round(mine: bool, device) -> int:
    """How many workers have a batch this round, 0 when none has (one small all-reduce a
    round, streamed shards only)."""
    count = torch.tensor([1.0 if mine else 0.0], device=device)
    dist.all_reduce(count)
    return int(count.item())


def _average(replica, spec, rank, round_index, iteration, last_loss, took_part, device) -> None:
    """Average the replicas after ``round_index`` of the epoch; ``iteration``: the model's
    count of batches after it, as the listeners see it."""
    started = time.perf_counter()
    count = average(replica_state(replica, spec.options.averages_updater_state), took_part)
    agree_on_loss_scaling(replica, device)  # one scaler state again, as one model: what a checkpoint keeps
    if replica.master is not None:
        replica.master.master_to_module()
    score = mean_over_participants(last_loss, took_part, device)
    replica.set_score(score)
    if not spec.early_stopping:  # with early stopping, its InvalidScore decides instead
        check_finite(replica, replica.last_score, replica.epoch_count)  # same verdict on every worker
    if spec.options.report_score_after_averaging and rank == 0:
        log.info(
            "epoch %d, round %d, iteration %d: averaged score %.6f across %d workers (averaging took %.1f ms)",
            replica.epoch_count, round_index + 1, iteration, score, int(count), (time.perf_counter() - started) * 1000,
        )
