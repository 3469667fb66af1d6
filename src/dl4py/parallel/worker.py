"""One parallel worker: a model replica on its device, trained round by round.

The same code runs in a process the ParallelWrapper spawned and in a process torchrun
launched. Each worker runs the single-device trainer's step function on its own batches;
in averaging mode the replicas are averaged every ``averaging_frequency`` rounds and at
the end of each epoch, in shared-gradients mode gradients are averaged every step.

Stopping early (Ctrl-C or SIGTERM at the coordinator): at each averaging boundary (every
round in shared-gradients mode) the workers vote on ``should_stop``; if any says yes, all
stop after that same round, with the replicas just averaged. Voting only where the
workers synchronise anyway keeps the averaging mode's rare synchronisation rare, and the
stopped state is one an uninterrupted run passes through, so a resumed run continues
exactly. The replica's ``batch_in_epoch`` then counts the epoch's batches trained.

Listeners and early stopping: a spawned worker 0 relays its events to the coordinator,
which runs them (``events.py``); under torchrun, rank 0 runs the fit's listeners and the
early-stopping controller's epoch decisions itself. Either way every worker asks the
iteration conditions (time, NaN) about its own losses and all follow rank 0's decision.
"""

from __future__ import annotations

import io
import itertools
import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from dl4py.backend import Backend
from dl4py.backend.cuda_environment import Environment, environment
from dl4py.errors import DataError, DL4PyError
from dl4py.parallel.averaging import (
    average,
    broadcast,
    mean_over_participants,
    replica_state,
    share_gradients,
    stepped_parameters,
)
from dl4py.parallel.events import EventRelay
from dl4py.parallel.messages import Done, Failed
from dl4py.parallel.plan import OpenRoundPlan, RoundPlan
from dl4py.parallel.sources import Prefetcher, QueueSource, ShardedSource
from dl4py.process_guard import die_with_parent
from dl4py.train.early_stopping.controller import first_firing
from dl4py.train.history import current_learning_rate
from dl4py.train.loop import EpochSummary, check_finite, epoch_rng
from dl4py.train.step import make_train_step

log = logging.getLogger("dl4py")


@dataclass
class WorkerSpec:
    """Everything a worker needs, as plain picklable data."""

    model_path: str  # the model to replicate, as saved by Model.save
    torch_model: object | None  # a TorchModel (bytes when spawned) to load model_path into; None: MultiLayerNetwork
    source: object | None  # ShardedSource / StrideSource; None: batches come through a queue
    num_batches: int | None  # None: a streamed source read in shards, its length unknown (OpenRoundPlan)
    epochs: int
    mode: str
    averaging_frequency: int
    average_updaters: bool
    report_score: bool
    prefetch: int
    devices: list[str]
    precision: str
    timeout: float
    threads: int | None = None
    environment: dict | None = None
    record_examples: bool = False  # return the first feature of every trained example (for tests)
    early_stopping: bool = False  # rank 0 decides after each epoch whether all stop
    iteration_conditions: list = field(default_factory=list)  # early stopping's: every worker asks them
    relay_epochs: bool = False  # spawned worker 0 sends each epoch's end (and state) to the coordinator
    relay_iterations: bool = False  # ... and its steps and epoch starts (the coordinator has listeners)


def worker_device(spec: WorkerSpec, rank: int) -> torch.device:
    return torch.device(spec.devices[rank % len(spec.devices)])


def spawned_worker_main(rank, world, spec, init_method, backend, messages, inbox, stop_event, result_path,
                        parent_pid, interrupt_event, decisions):
    """Entry point of a process the ParallelWrapper started; reports to ``messages`` and,
    as worker 0, reads early-stopping decisions from ``decisions``."""
    die_with_parent(parent_pid)  # a killed coordinator leaves no worker training on
    # Stopping is the coordinator's to decide: a terminal's Ctrl-C, or a SIGTERM sent to the
    # whole process group (`kill -- -PGID`, `timeout`, systemd), reaches the workers too.
    # The coordinator then asks them to stop at a round boundary (``interrupt_event``).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    device = worker_device(spec, rank)
    try:
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world,
            timeout=timedelta(seconds=spec.timeout),
        )
        source = spec.source or QueueSource(inbox, stop_event, spec.timeout)
        relay = None
        if rank == 0 and spec.relay_epochs:
            relay = EventRelay(messages, decisions, spec.relay_iterations, spec.timeout)
        replica, report = train_replica(rank, world, spec, source, interrupt_event.is_set,
                                        listeners=[relay] if relay else [], decide=relay.decision if relay else None)
        if rank == 0:
            replica.save(result_path)
        messages.put(Done(rank, report))
    except BaseException as exc:
        # A problem with the user's data or settings is its sentence; anything else, a bug
        # or a lost peer, keeps its traceback (DL4PY_DEBUG=1: every traceback).
        user_error = isinstance(exc, DL4PyError) and os.environ.get("DL4PY_DEBUG", "") in ("", "0")
        messages.put(Failed(rank, str(device), str(exc) if user_error else traceback.format_exc(), user_error))
        messages.close()
        messages.join_thread()
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def build_replica(spec: WorkerSpec, device: torch.device):
    from dl4py.nn.serialization import load, restore_state

    backend = Backend("gpu" if device.type == "cuda" else "cpu", device, "parallel worker")
    if spec.torch_model is None:
        return load(spec.model_path, backend=backend, precision=spec.precision)
    model = spec.torch_model
    if isinstance(model, bytes):  # a spawned worker's private copy (preflight.private_copy)
        model = torch.load(io.BytesIO(model), map_location="cpu", weights_only=False)
    model._requested_backend, model._requested_precision = backend, spec.precision
    restore_state(model, spec.model_path)
    return model


def train_replica(rank: int, world: int, spec: WorkerSpec, source, should_stop=None, listeners=(), decide=None):
    """Train this worker's replica for ``spec.epochs`` epochs, or until ``should_stop()`` says
    so on any worker (it must be given on all or none); returns the replica and a report.

    ``listeners`` see this replica's events (rank 0's: the fit's listeners under torchrun, the
    relay to the coordinator when spawned); with ``spec.early_stopping``, rank 0's
    ``decide(replica)`` says after each epoch why all should stop, or None."""
    device = worker_device(spec, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif spec.threads:
        torch.set_num_threads(spec.threads)  # workers sharing the cores must not oversubscribe them
    if spec.environment is not None:  # installed as this process's environment
        Environment.from_dict(spec.environment).apply(device)
    replica = build_replica(spec, device)
    replica.module.train()
    # All replicas start from worker 0's state, whatever each process built.
    broadcast(replica_state(replica, include_updater=True), src=0)
    if replica.master is not None:
        replica.master.master_to_module()
    hook = None
    if spec.mode == "shared_gradients":
        params = stepped_parameters(replica)

        def hook(took_part):
            share_gradients(params, took_part)

    step = make_train_step(replica, gradient_hook=hook)
    for listener in listeners:
        listener.on_fit_start(replica)
    report = {"summaries": [], "records": [], "stop": None, "interrupted": False}
    for condition in spec.iteration_conditions:
        condition.initialize()  # MaxTime counts from here, in this process
    try:
        for _ in range(spec.epochs):
            summary = _train_epoch(replica, step, rank, world, spec, source, device, report, listeners, should_stop)
            report["summaries"].append(summary.to_dict())
            if report["stop"] is not None or not summary.completed:
                break  # an iteration condition fired, or a stop was asked for: all stopped in the same round
            for listener in listeners:
                listener.on_epoch_end(replica, summary)
            if report["interrupted"]:
                break  # asked in the epoch's last round: the epoch is complete
            if spec.early_stopping and _epoch_decision(replica, decide, rank, device, report):
                break
    finally:
        # A spawned worker 0's listener is the relay: an interrupted fit ends in the
        # coordinator, which restores this replica's state and runs on_fit_end(model, True).
        for listener in listeners:
            listener.on_fit_end(replica, report["interrupted"])
    if spec.record_examples:
        report["records"] = torch.cat(report["records"]).tolist() if report["records"] else []
    return replica, report


def _epoch_decision(replica, decide, rank, device, report) -> bool:
    """Rank 0 has the (averaged) replica scored and the epoch conditions asked; all follow it."""
    reason = decide(replica) if rank == 0 else None
    flag = torch.tensor([1.0 if reason is not None else 0.0], device=device)
    dist.broadcast(flag, src=0)
    if flag.item() > 0:
        report["stop"] = ("EpochTerminationCondition", reason)
        return True
    return False


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


def _stop_vote(wanted: bool, device) -> bool:
    """True on every worker if any of them wants to stop."""
    flag = torch.tensor([1.0 if wanted else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() > 0


def _train_epoch(replica, step, rank, world, spec, source, device, report, listeners, should_stop) -> EpochSummary:
    epoch = replica.epoch_count
    start = replica.batch_in_epoch  # > 0: resumed after an interrupt part-way through this epoch
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
    started = time.perf_counter()
    examples = batches = 0
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    last_loss, trained_since_average = None, False
    rounds_done, averaged = 0, True
    batches_out = source.batches(epoch, rank, world, start)
    if not isinstance(source, ShardedSource):
        # Labels an in-memory source checked when it was made need no second look; others (a
        # stream, a user's iterator) are checked batch by batch on the host, before the copy
        # to the device: no sync, and no device-side assert from the loss on a GPU.
        batches_out = _labels_checked(batches_out, replica, f"worker {rank}, epoch {epoch}")
    prefetcher = Prefetcher(batches_out, device, spec.prefetch,
                            pin=environment().pinned_memory, timeout=spec.timeout)
    batches_in = iter(prefetcher)
    try:
        with epoch_rng(replica, epoch, stream=rank):  # distinct dropout masks per worker
            for round_index in range(plan.rounds) if plan.rounds is not None else itertools.count():
                if plan.rounds is None:  # a streamed shard: go on while any worker has a batch
                    item = next(batches_in, None)
                    if not _any_left(item is not None, device):
                        break
                    mine = item is not None
                else:
                    mine = plan.batch_of(round_index, rank) is not None
                    item = next(batches_in, None) if mine else None
                    if mine and item is None:
                        raise DataError(f"worker {rank} ran out of batches in round {round_index} of epoch {epoch}")
                if mine:
                    _, features, labels = item
                    features = replica._convert_input(features)  # dtype and memory format
                    if batches == 0:
                        replica.check_features(features, f"worker {rank}, epoch {epoch}")
                        replica.check_labels(labels, f"worker {rank}, epoch {epoch}")
                    last_loss = step(features, labels)
                    loss_sum += last_loss
                    batches += 1
                    examples += features.shape[0]
                    trained_since_average = True
                    if spec.record_examples:
                        report["records"].append(features[:, 0].detach().to("cpu", torch.float64))
                    for listener in listeners:
                        listener.iteration_done(replica, replica.iteration_count + round_index + 1, epoch,
                                                last_loss, features.shape[0])
                elif spec.mode == "shared_gradients":
                    step(None, None)  # apply the shared update without a batch of its own
                stop = None
                if spec.iteration_conditions:
                    # Only then: asking means a collective and a read of the loss every round.
                    stop = _iteration_stop(spec.iteration_conditions, last_loss, mine, device)
                last_round = plan.averages_after(round_index, spec.averaging_frequency)
                halt = should_stop is not None and last_round and _stop_vote(should_stop(), device)
                if spec.mode == "averaging" and (last_round or stop is not None):
                    _average(replica, spec, rank, round_index, last_loss, trained_since_average, device)
                    trained_since_average = False
                rounds_done = round_index + 1
                averaged = last_round or stop is not None
                if stop is not None:
                    report["stop"] = ("IterationTerminationCondition", stop)
                    break
                if halt:
                    report["interrupted"] = True
                    break
            else:
                averaged = True  # a fixed plan's last round averages
            if spec.mode == "averaging" and plan.rounds is None and not averaged and rounds_done:
                # A streamed epoch's end is known only once no worker has a batch: average now.
                _average(replica, spec, rank, rounds_done - 1, last_loss, trained_since_average, device)
    finally:
        prefetcher.close()
    totals = torch.tensor([examples, batches, float(loss_sum)], dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    all_examples, all_batches, all_loss = int(totals[0]), int(totals[1]), float(totals[2])
    if all_batches == 0 and start == 0 and report["stop"] is None:  # as the single-device loop says
        raise DataError(f"the data gave no batches in epoch {epoch} (worker {rank} of {world})")
    if spec.mode == "shared_gradients":
        replica._last_score = torch.tensor(all_loss / max(all_batches, 1))
    if plan.rounds is None:
        completed = report["stop"] is None and not report.get("interrupted")
    else:  # an interrupt in the last round still completes the epoch
        completed = report["stop"] is None and rounds_done == plan.rounds
    if completed:
        check_finite(replica, totals[2], epoch)
        replica.epoch_count += 1
        replica.batch_in_epoch = 0
    elif plan.rounds is None:
        replica.batch_in_epoch = start + rounds_done * world  # each worker skips that many rounds
    else:
        replica.batch_in_epoch = start + all_batches  # where a resumed run continues
    replica.iteration_count += all_batches
    return EpochSummary(epoch, all_batches, all_examples, all_loss / all_batches if all_batches else float("nan"),
                        time.perf_counter() - started, completed=completed,
                        learning_rate=current_learning_rate(replica))


def _labels_checked(batches, replica, where: str):
    """``(round, DataSet)`` pairs as they come, each batch's labels checked on the host."""
    for round_index, batch in batches:
        if batch.labels.device.type == "cpu":
            replica.check_labels(batch.labels, f"{where}, round {round_index}")
        yield round_index, batch


def _any_left(mine: bool, device) -> bool:
    """Whether any worker still has a batch (one small all-reduce a round, streamed shards only)."""
    flag = torch.tensor([1.0 if mine else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


def _average(replica, spec, rank, round_index, last_loss, took_part, device) -> None:
    started = time.perf_counter()
    count = average(replica_state(replica, spec.average_updaters), took_part)
    if replica.master is not None:
        replica.master.master_to_module()
    score = mean_over_participants(last_loss, took_part, device)
    replica._last_score = torch.tensor(score)
    if not spec.early_stopping:  # with early stopping, its InvalidScore decides instead
        check_finite(replica, replica._last_score, replica.epoch_count)  # same verdict on every worker
    if spec.report_score and rank == 0:
        log.info(
            "round %d: averaged score %.6f across %d workers (averaging took %.1f ms)",
            round_index + 1, score, int(count), (time.perf_counter() - started) * 1000,
        )
