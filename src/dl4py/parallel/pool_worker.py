"""A worker process of the ParallelWrapper's pool: joins the process group once, then runs
one job (fit) after another until the pool closes.

A worker never ends on Ctrl-C or SIGTERM: it takes either as a request to stop the fit it
runs, voted on by all workers at the next round boundary (``worker.py``), as is the
coordinator's own (``interrupt``). So a SIGTERM to one worker stops every worker after the
same round, and the coordinator keeps the checkpoint; a terminal's Ctrl-C, or a SIGTERM to
the whole process group (`kill -- -PGID`, `timeout`, systemd), reaches the coordinator
and the workers alike and stops them the same way. A signal between fits is forgotten: the
coordinator is in charge then. Stopping at once is the coordinator's too (it kills them).

Each worker's watchdog thread publishes where it is on the pool's shared board, which the
coordinator reads to name a worker that keeps the others waiting (``watchdog.py``). A job
that fails ends the process: the coordinator tears the pool down, and the next fit starts
a fresh one. An idle worker waits for its next job as long as its coordinator lives
(``die_with_parent``).
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dl4py.errors import DL4PyError
from dl4py.parallel.events import EventRelay, LogRelay, relay_logs
from dl4py.parallel.messages import Done, Failed, Job, Ready
from dl4py.parallel.phase import PHASE
from dl4py.parallel.rank import RankReport, run_rank
from dl4py.parallel.sources import QueueSource
from dl4py.parallel.watchdog import SharedBoard, Watchdog, backstop
from dl4py.process_guard import die_with_parent
from dl4py.train.interrupt import DeferredInterrupt

POLL_SECONDS = 0.2


@dataclass
class WorkerChannels:
    """One worker's ends of the pool's queues and events (they travel to it at its start)."""

    messages: object  # to the coordinator: Ready, events, log records, Done / Failed
    jobs: object  # from the coordinator: a Job per fit, None to exit
    inbox: object  # batches the coordinator deals (iterators the workers cannot read themselves)
    decisions: object | None  # worker 0: the coordinator's early-stopping decisions
    interrupt: object  # set: stop after the next averaging round (Ctrl-C, SIGTERM at the coordinator)
    stop: object  # set: the pool is closing
    board: SharedBoard  # where each worker's watchdog says where it is (the coordinator reads it)


def spawned_worker_main(rank: int, world: int, device: str, init_method: str, backend: str, timeout: float,
                        channels: WorkerChannels, coordinator_pid: int, forker_pid: int, log_level: int,
                        environment: dict) -> None:
    """Entry point of a process of the ParallelWrapper's pool. ``forker_pid`` is its parent
    (the coordinator, or the forkserver that ends with it: ``processes.worker_context``);
    ``environment`` the coordinator's variables now, which a forked worker did not inherit."""
    # A killed coordinator leaves no worker training on: its forkserver's death signals us,
    # and the coordinator is watched too, in case the forkserver outlives it.
    die_with_parent(forker_pid, watch_also=coordinator_pid)
    if os.environ != environment:  # before anything reads them (CUDA_VISIBLE_DEVICES at CUDA's start)
        os.environ.clear()
        os.environ.update(environment)
    relay_logs(channels.messages, rank, log_level)  # shown by the coordinator's handlers, not on a shared terminal
    Watchdog(rank, channels.board, timeout, judge=False).start()  # the coordinator judges; it ends with the process
    messages = channels.messages
    # Ctrl-C and SIGTERM ask this worker's fit to stop, for the process's whole life: never an end.
    with DeferredInterrupt(escalate=False) as signals:
        messages.put(Ready(rank))
        try:
            # torch's own timeout only backs the watchdog up: it would not say which worker is missing.
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                                    timeout=backstop(timeout))
            while (job := _next_job(channels)) is not None:
                signals.clear()  # one sent between fits was the coordinator's to act on
                messages.put(Done(rank, _run_job(rank, world, job, channels, signals), job.number))
                PHASE.enter("between fits")
        except BaseException as exc:
            # A problem with the user's data or settings is its sentence; anything else, a bug
            # or a lost peer, keeps its traceback (DL4PY_DEBUG=1: every traceback).
            user_error = isinstance(exc, DL4PyError) and os.environ.get("DL4PY_DEBUG", "") in ("", "0")
            messages.put(Failed(rank, device, str(exc) if user_error else traceback.format_exc(), user_error))
            messages.close()
            messages.join_thread()
            sys.exit(1)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def _next_job(channels: WorkerChannels) -> Job | None:
    """The next fit's job; None when the pool closes."""
    while not channels.stop.is_set():
        try:
            return channels.jobs.get(timeout=POLL_SECONDS)
        except queue.Empty:
            continue
    return None


def _run_job(rank: int, world: int, job: Job, channels: WorkerChannels, signals: DeferredInterrupt) -> RankReport:
    spec = job.spec
    _follow_log_level(spec.log_level)
    timeout = spec.options.timeout
    dealt = None if spec.source is not None else QueueSource(channels.inbox, channels.stop, timeout, job.number)
    relay = None
    if rank == 0 and spec.relay_epochs:
        relay = EventRelay(channels.messages, channels.decisions, spec.relay_iterations, timeout,
                           parts=spec.listener_parts)

    def should_stop():  # a signal to this worker, named; or the coordinator's request
        return signals.cause if signals.requested else channels.interrupt.is_set()

    try:
        return run_rank(rank, world, spec, spec.source or dealt, should_stop=should_stop,
                        listeners=[*relay.parts, relay] if relay else [], decide=relay.decision if relay else None,
                        keep_state=rank == 0)  # the coordinator's model takes worker 0's state
    finally:
        if dealt is not None:
            dealt.close()  # before Done: no thread of this fit may read the next fit's batches
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()  # between fits the GPU is the coordinator's too (evaluation, checkpoints)


def _follow_log_level(level: int) -> None:
    """Each fit relays records from the level the coordinator's "dl4py" logger has then."""
    logger = logging.getLogger("dl4py")
    logger.setLevel(level)
    for handler in logger.handlers:
        if isinstance(handler, LogRelay):
            handler.setLevel(level)
