"""The ParallelWrapper's worker processes, kept from one fit to the next.

The first fit spawns the workers, which join one process group; each fit then sends
every worker a ``Job`` (the model as of that fit, the epochs, where the batches come
from, the options) and watches them until all report. Between fits the workers wait.
DL4J's usual loop calls ``fit`` once per epoch, so starting processes (seconds) per fit
would cost more than the epoch on a small model.

While a fit runs, the coordinator reads the workers' shared board (``watchdog.py``): a
worker that keeps the others waiting at a collective for longer than ``timeout`` is named
(``WorkerError``) and every worker is killed. A worker that dies is named with the phase
it was in.

A fit that needs other processes (worker count, devices, plan, timeout, CUDA
environment: ``PoolLayout``) restarts the pool; a failed fit tears it down, and the next
fit starts a fresh one. The pool ends with ``close()``, when its owner is collected, or at
interpreter exit, before multiprocessing's own clean-up (which would wait forever on
workers that ignore its SIGTERM).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing.util
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from dl4py.errors import TrainingError, WorkerError
from dl4py.parallel.messages import Done, Failed, Job, Ready
from dl4py.parallel.phase import describe
from dl4py.parallel.pool_worker import WorkerChannels, spawned_worker_main
from dl4py.parallel.processes import (
    GRACE_SECONDS,
    also_stopped,
    children_ignore_stop_signals,
    exit_description,
    is_lost_peer,
    received,
    stop_all,
    worker_context,
)
from dl4py.parallel.rank import RankReport
from dl4py.parallel.sources import deal_batches
from dl4py.parallel.watchdog import SharedBoard, missing
from dl4py.train.loop import TrainingInterrupted

log = logging.getLogger("dl4py")

POLL_SECONDS = 0.1
SETTLE_SECONDS = 2.0
# Messages read per pass of the watch loop: it must also look at the workers in between.
MESSAGES_PER_PASS = 64
# Run inside multiprocessing's exit function, before it terminates and joins the children.
EXIT_PRIORITY = 100


@dataclass(frozen=True)
class PoolLayout:
    """What the processes are started with: a fit that needs another layout restarts the pool."""

    world: int
    devices: tuple[str, ...]  # worker i on devices[i % len(devices)]
    backend: str  # of the process group: nccl or gloo
    mode: str  # the plan's (ParallelPlan.mode)
    inbox_size: int  # batches a worker's inbox holds (iterators the coordinator deals)
    timeout: float  # of every wait on another process: the watchdog's bound on a collective
    environment: str  # the CUDA environment settings as JSON: some apply only when a process starts


@dataclass
class _Channels:
    messages: object
    jobs: list
    inboxes: list
    decisions: object
    interrupt: object
    stop: object
    board: SharedBoard

    def queues(self) -> list:
        return [self.messages, self.decisions, *self.jobs, *self.inboxes]

    def of(self, rank: int) -> WorkerChannels:
        return WorkerChannels(self.messages, self.jobs[rank], self.inboxes[rank],
                              self.decisions if rank == 0 else None, self.interrupt, self.stop, self.board)


class WorkerPool:
    """Worker processes for one ParallelWrapper; ``starts`` counts how often they were started."""

    def __init__(self):
        self.starts = 0
        self.layout: PoolLayout | None = None
        self._procs: list = []
        self._channels: _Channels | None = None
        self._ready: set[int] = set()  # workers that got through importing the main script
        self._jobs = itertools.count(1)
        self._folder = None  # a temporary folder for the process group's rendezvous file
        self._at_exit = None  # the finalizer that closes the pool when it is collected or at exit

    def is_running(self) -> bool:
        return bool(self._procs) and all(proc.is_alive() for proc in self._procs)

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self._procs]

    @property
    def decisions(self):
        """The queue worker 0 reads early-stopping decisions from."""
        return self._channels.decisions

    def ensure(self, layout: PoolLayout, log_level: int) -> None:
        """Workers of ``layout``, started now unless they run already (a worker that died
        between fits restarts them all)."""
        if self.layout == layout and self.is_running():
            return
        self.close()
        self._start(layout, log_level)

    def _start(self, layout: PoolLayout, log_level: int) -> None:
        ctx, forker = worker_context()
        folder = tempfile.TemporaryDirectory(prefix="dl4py-pool-")
        channels = _Channels(
            messages=ctx.Queue(), jobs=[ctx.Queue() for _ in range(layout.world)],
            inboxes=[ctx.Queue(maxsize=layout.inbox_size) for _ in range(layout.world)],
            decisions=ctx.Queue(), interrupt=ctx.Event(), stop=ctx.Event(), board=SharedBoard(ctx, layout.world))
        init_method = f"file://{Path(folder.name) / 'rendezvous'}"
        procs = [
            ctx.Process(target=spawned_worker_main, name=f"dl4py-worker-{rank}", daemon=True,
                        args=(rank, layout.world, layout.devices[rank % len(layout.devices)], init_method,
                              layout.backend, layout.timeout, channels.of(rank), os.getpid(), forker, log_level,
                              dict(os.environ)))
            for rank in range(layout.world)
        ]
        self.layout, self._procs, self._channels, self._ready, self._folder = layout, procs, channels, set(), folder
        self._at_exit = multiprocessing.util.Finalize(self, _shut_down, args=(procs, channels, folder, GRACE_SECONDS),
                                                      exitpriority=EXIT_PRIORITY)
        try:
            # Forked workers are born ignoring stop signals, as their forkserver does; spawned
            # ones inherit this process's handlers. Not held over a forkserver's first start
            # (seconds of imports): a Ctrl-C then must reach this process, not be ignored.
            spawned = ctx.get_start_method() == "spawn"
            with children_ignore_stop_signals() if spawned else contextlib.nullcontext():
                for proc in procs:
                    proc.start()
        except BaseException:
            self.close(patience=0.0)
            raise
        self.starts += 1
        log.info("started %d workers (%s)", layout.world, ", ".join(layout.devices))

    def run(self, spec, iterator, first_epoch: int, first_batch: int, replay, interrupt) -> dict[int, RankReport]:
        """One fit: every worker gets the job, batches are dealt from ``iterator`` when the
        workers cannot read it themselves, worker 0's events go to ``replay`` and a stop asked
        for by ``interrupt`` (Ctrl-C, SIGTERM) is passed on. Returns each worker's report; on
        any failure the workers are killed at once and the pool is closed."""
        number = next(self._jobs)
        channels = self._channels
        channels.interrupt.clear()  # a stop asked for in an earlier fit is done with
        for jobs in channels.jobs:
            jobs.put(Job(number, spec))
        feeder = None
        if spec.source is None:
            feeder = _Feeder(iterator, channels.inboxes, spec.epochs, first_epoch, first_batch,
                             spec.options.timeout, number)
            feeder.start()
        finished = False
        try:
            reports = self._watch(number, replay, interrupt, feeder)
            finished = True
        finally:
            if feeder is not None:
                feeder.stop()
            if not finished:
                self.close(patience=0.0)
        return reports

    def close(self, patience: float = GRACE_SECONDS) -> None:
        """End the workers: idle ones exit at once; after ``patience`` seconds the rest are killed."""
        if self._at_exit is None:
            return
        self._at_exit.cancel()
        _shut_down(self._procs, self._channels, self._folder, patience)
        self._at_exit, self._procs, self._channels, self._folder, self.layout = None, [], None, None, None

    def _watch(self, number, replay, interrupt, feeder) -> dict[int, RankReport]:
        """Wait for every worker's report on job ``number``, replaying worker 0's events
        meanwhile; the first failure is raised. Once a stop is requested, the workers have
        ``timeout`` seconds to reach a round boundary."""
        procs, channels, timeout = self._procs, self._channels, self.layout.timeout
        reports: dict[int, RankReport] = {}
        failures: dict[int, tuple[str, str | None]] = {}  # rank -> (kind, detail)
        settle_until = stop_deadline = None
        while len(reports) < len(procs):
            if interrupt.requested and stop_deadline is None:
                channels.interrupt.set()
                stop_deadline = time.monotonic() + timeout
                log.warning("%s: stopping the workers after the next averaging round and keeping the model; "
                            "send it again to stop at once", interrupt.cause)
            if stop_deadline is not None and time.monotonic() > stop_deadline:
                raise TrainingInterrupted(
                    f"parallel training stopped by {interrupt.cause}: the workers did not reach a round boundary "
                    f"within timeout={timeout:.0f} s and were killed; the model keeps its state from before this fit")
            # Looked at before reading: a worker that had exited by then has sent all it will.
            exited = [rank for rank, proc in enumerate(procs) if proc.exitcode is not None]
            for message in received(channels.messages, POLL_SECONDS, MESSAGES_PER_PASS):
                if isinstance(message, Ready):
                    self._ready.add(message.rank)
                elif isinstance(message, Done):
                    if message.job == number:
                        reports[message.rank] = message.report
                elif isinstance(message, Failed):
                    trace = message.traceback
                    kind = "lost-peer" if is_lost_peer(trace) else "exception"
                    failures[message.rank] = (kind, trace if message.user_error else f"raised an exception:\n{trace}")
                else:
                    replay.handle(message)
            for rank in exited:
                if rank not in reports and rank not in failures:
                    # Its own report may still be in flight: see the settling below. A clean
                    # exit without one means its report was lost (e.g. could not be sent).
                    failures[rank] = ("died", None) if procs[rank].exitcode != 0 else ("silent", None)
            if feeder is not None and feeder.error is not None:
                raise TrainingError(f"reading batches for the workers failed: {feeder.error!r}") from feeder.error
            late = missing(channels.board.records(), time.time(), timeout, "worker")
            if late is not None and not failures:  # a death is its own cause: its peers wait for it too
                raise WorkerError(late.rank, self._device(late.rank), late.reason)
            for rank in [r for r in failures if r in reports]:
                del failures[rank]  # a report that arrived after its sender exited
            if failures:
                # A dead worker makes its peers fail too ("connection reset"): wait a moment
                # so the cause, not its echo, is what gets reported.
                settle_until = settle_until or time.monotonic() + SETTLE_SECONDS
                if time.monotonic() >= settle_until or all(k == "exception" for k, _ in failures.values()):
                    raise self._root_cause(failures)
        return reports

    def _root_cause(self, failures) -> WorkerError:
        order = {"exception": 0, "died": 1, "silent": 2, "lost-peer": 3}
        rank = min(failures, key=lambda r: (order[failures[r][0]], r))
        kind, detail = failures[rank]
        if kind == "died":
            detail = exit_description(self._procs[rank].exitcode, starting=rank not in self._ready)
        elif kind == "silent":
            detail = "exited without reporting its result (its report could not be sent back; see its stderr)"
        record = self._channels.board.read(rank)
        if kind in ("died", "silent") and record is not None:
            detail += f", in {describe(record.phase, record.epoch, record.round)}"
        return WorkerError(rank, self._device(rank), detail + also_stopped(rank, failures))

    def _device(self, rank: int) -> str:
        devices = self.layout.devices
        return devices[rank % len(devices)]


def _shut_down(procs, channels: _Channels, folder, patience: float) -> None:
    """Tell the workers to exit, give them ``patience`` seconds, kill the rest. A module
    function: the pool's finalizer must not keep the pool alive."""
    for jobs in channels.jobs:
        try:
            jobs.put_nowait(None)
        except Exception:  # a queue torn down with its reader
            pass
    channels.stop.set()
    stop_all([proc for proc in procs if proc.pid is not None], patience)  # those that were started
    for q in channels.queues():
        # Batches or jobs nobody will read must not hold up this process's exit.
        q.cancel_join_thread()
        q.close()
    folder.cleanup()


class _Feeder(threading.Thread):
    """Deals a user iterator's batches to the workers' inboxes (any iterator, in this process)."""

    def __init__(self, iterator, inboxes, epochs, first_epoch, first_batch, timeout, job):
        super().__init__(name="dl4py-feeder", daemon=True)
        self.halt = threading.Event()
        self.args = (iterator, inboxes, epochs, first_epoch, self.halt, timeout, first_batch, job)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            deal_batches(*self.args)
        except BaseException as exc:
            if not self.halt.is_set():
                self.error = exc

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=GRACE_SECONDS)  # it looks at ``halt`` at least every put's poll
