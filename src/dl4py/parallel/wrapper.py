"""ParallelWrapper: data-parallel training of an existing model (DL4J's class of that name).

    wrapper = ParallelWrapper(model, workers=2, prefetch_buffer=24, averaging_frequency=3,
                              report_score_after_averaging=True)
    wrapper.fit(MnistDataSetIterator(128, train=True, seed=12345), epochs=1)

Workers are processes on ``torch.distributed``; worker ``i`` runs on device
``devices[i % len(devices)]``. Started as a plain script, ``fit`` spawns the workers and
watches them; under ``torchrun`` (any number of nodes) it runs as the launched process's
worker instead. Afterwards ``model`` holds the averaged parameters (and updater state).

With spawned workers, this process alone runs the fit's listeners (and early stopping's
scoring, saving and decisions), on events worker 0 relays (``events.py``); at each epoch
end ``model`` takes worker 0's averaged state first. Under torchrun, rank 0 runs them.

Ctrl-C or SIGTERM while spawned workers train: the workers stop together after the next
averaging round, worker 0's replica comes back, and the listeners' ``on_fit_end(model,
interrupted=True)`` runs here (a CheckpointListener keeps a checkpoint that ``fit``
continues from mid-epoch); then ``TrainingInterrupted``. A second signal stops at once.
Spawned workers die with this process, even when it is killed outright.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dl4py.backend.cuda_environment import environment
from dl4py.errors import ConfigError, TrainingError, WorkerError
from dl4py.nn.model import Model, as_iterator
from dl4py.nn.serialization import restore_state
from dl4py.parallel.events import EventReplay
from dl4py.parallel.messages import Done, Failed
from dl4py.parallel.preflight import (
    check_picklable,
    check_world,
    device_name,
    own_source,
    positive_int,
    private_copy,
)
from dl4py.parallel.processes import (
    GRACE_SECONDS,
    children_ignore_stop_signals,
    exit_description,
    is_lost_peer,
    received,
    stop_all,
)
from dl4py.parallel.sources import (
    StrideSource,
    batches_per_epoch,
    is_shardable,
    deal_batches,
)
from dl4py.parallel.worker import WorkerSpec, spawned_worker_main, train_replica
from dl4py.train.history import History
from dl4py.train.interrupt import DeferredInterrupt
from dl4py.train.loop import EpochSummary, TrainingInterrupted
from dl4py.train.validation import EpochValidation

log = logging.getLogger("dl4py")

MODES = ("averaging", "shared_gradients")
POLL_SECONDS = 0.1
SETTLE_SECONDS = 2.0
# Messages read per pass of the watch loop: it must also look at the workers in between.
MESSAGES_PER_PASS = 64


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


class ParallelWrapper:
    """Data-parallel training. Options are DL4J's; one that cannot apply is an error.

    - ``workers``: processes (default: the number of usable GPUs, or 2 on CPU).
    - ``prefetch_buffer``: batches each worker keeps ready on its device (0: none).
    - ``averaging_frequency``: rounds between parameter averages (averaging mode).
    - ``report_score_after_averaging``: log the averaged score and the averaging time.
    - ``average_updaters``: average the updater state too (averaging mode; default on).
    - ``training_mode``: ``"averaging"`` or ``"shared_gradients"`` (all-reduce every step).
    - ``devices``: e.g. ``["cuda:0", "cuda:1"]`` or ``["cpu"]`` (default: the model's backend).
    - ``timeout``: seconds any wait on another process may last before it is an error.
    """

    def __init__(
        self,
        model: Model,
        workers: int | None = None,
        prefetch_buffer: int = 16,
        averaging_frequency: int | None = None,
        report_score_after_averaging: bool = False,
        average_updaters: bool | None = None,
        training_mode: str = "averaging",
        devices: list | None = None,
        timeout: float = 300.0,
    ):
        if not isinstance(model, Model):
            raise TypeError(f"ParallelWrapper needs a dl4py model (MultiLayerNetwork or TorchModel), got {type(model).__name__}")
        if training_mode not in MODES:
            raise ConfigError("training_mode", f"must be one of {', '.join(MODES)}; got {training_mode!r}")
        if training_mode == "shared_gradients":
            for name, value in (("averaging_frequency", averaging_frequency), ("average_updaters", average_updaters)):
                if value is not None:
                    raise ConfigError(name, "applies to training_mode 'averaging' only: shared gradients keep every replica identical")
            if report_score_after_averaging:
                raise ConfigError("report_score_after_averaging", "applies to training_mode 'averaging' only")
        self.model = model
        self.training_mode = training_mode
        self.averaging_frequency = positive_int(1 if averaging_frequency is None else averaging_frequency, "averaging_frequency")
        self.average_updaters = True if average_updaters is None else bool(average_updaters)
        self.report_score_after_averaging = bool(report_score_after_averaging)
        if not isinstance(prefetch_buffer, int) or isinstance(prefetch_buffer, bool) or prefetch_buffer < 0:
            raise ConfigError("prefetch_buffer", f"must be an integer >= 0, got {prefetch_buffer!r}")
        self.prefetch_buffer = prefetch_buffer
        self.devices = None if devices is None else [device_name(d, i) for i, d in enumerate(devices)]
        self.workers = None if workers is None else positive_int(workers, "workers")
        if not timeout > 0:
            raise ConfigError("timeout", f"must be positive, got {timeout!r}")
        self.timeout = float(timeout)
        self.last_records: dict[int, list[float]] = {}

    # ---- public ---------------------------------------------------------------------------
    def fit(self, iterator, epochs: int = 1, listeners=(), *, validation=None, metrics=None,
            _record_examples: bool = False) -> History:
        """Train ``epochs`` epochs; the model then holds the averaged parameters. With
        ``validation`` (anything ``Model.fit`` accepts), the averaged model is scored after
        each epoch, as ``Model.fit`` does. Returns the History of the epochs."""
        if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1:
            raise ConfigError("epochs", f"must be a positive integer, got {epochs!r}")
        validator = None
        if validation is not None:
            held_out = as_iterator(validation, None)
            self.model.check_data(held_out)
            validator = EpochValidation(held_out, None if metrics is None else list(metrics))
            listeners = [validator, *listeners]
        summaries = self._fit(iterator, epochs, listeners, _record_examples, None)
        return History(validator.apply(summaries) if validator is not None else summaries)

    def _fit(self, iterator, epochs, listeners, record, controller):
        """Train; with an early-stopping ``controller``, until its conditions say stop.
        ``self.last_report`` then holds worker 0's report (its controller and stop reason)."""
        self.model.init()
        # Anything Model.fit accepts (a DataLoader, a DataFrame, arrays, ...), as an iterator.
        iterator = as_iterator(iterator, None, seed=getattr(self.model, "seed", 0), training=True)
        self.model.check_data(iterator)  # every label of in-memory data, before any worker starts
        self._controller = controller
        if controller is not None:
            controller.start(self.model.epoch_count)
        if launched_by_torchrun():
            return self._fit_launched(iterator, epochs, list(listeners), record)
        return self._fit_spawned(iterator, epochs, list(listeners), record)

    # ---- shared set-up -----------------------------------------------------------------
    def _resolve_devices(self) -> list[str]:
        if self.devices is not None:
            for d in self.devices:
                if d.startswith("cuda") and not torch.cuda.is_available():
                    raise ConfigError("devices", f"{d} is not usable: this machine has no CUDA device")
            return self.devices
        if self.model.backend.device.type == "cuda":
            return [f"cuda:{i}" for i in environment().usable_cuda_devices()]
        return ["cpu"]

    def _spec(self, iterator, epochs, devices, world, record) -> WorkerSpec:
        from dl4py.nn.torch_model import TorchModel

        cpu_workers = sum(1 for rank in range(world) if devices[rank % len(devices)] == "cpu")
        return WorkerSpec(
            model_path="",
            torch_model=self.model if isinstance(self.model, TorchModel) else None,
            source=own_source(iterator),
            num_batches=None if is_shardable(iterator) else batches_per_epoch(iterator),
            epochs=epochs,
            mode=self.training_mode,
            averaging_frequency=self.averaging_frequency,
            average_updaters=self.average_updaters,
            report_score=self.report_score_after_averaging,
            prefetch=self.prefetch_buffer,
            devices=devices,
            precision=self.model.precision.name,
            timeout=self.timeout,
            threads=max(1, (os.cpu_count() or 1) // cpu_workers) if cpu_workers else None,
            environment=environment().to_dict(),  # every worker applies the same settings
            record_examples=record,
            early_stopping=self._controller is not None,
            iteration_conditions=[] if self._controller is None else list(self._controller.config.iteration_conditions),
        )

    @staticmethod
    def _process_group_backend(devices: list[str], world: int) -> str:
        # NCCL needs one process per GPU; CPU workers, or several workers sharing a GPU
        # (the seed recommends workers >= GPUs), communicate through gloo.
        gpus = [devices[r % len(devices)] for r in range(world)]
        if all(d.startswith("cuda") for d in gpus) and len(set(gpus)) == world:
            return "nccl"
        return "gloo"

    # ---- spawned workers, watched by this process ----------------------------------------
    def _fit_spawned(self, iterator, epochs, listeners, record) -> list[EpochSummary]:
        devices = self._resolve_devices()
        world = self.workers or (len(devices) if devices[0].startswith("cuda") else 2)
        check_world(world, devices, iterator)  # before any process starts
        spec = self._spec(iterator, epochs, devices, world, record)
        if spec.torch_model is not None:
            spec.torch_model = private_copy(spec.torch_model)
        check_picklable(spec)
        replay = EventReplay(self.model, listeners, self._controller)  # the listeners run here
        spec.relay_epochs, spec.relay_iterations = replay.relays_epochs, replay.relays_iterations
        ctx = mp.get_context("spawn")
        with tempfile.TemporaryDirectory(prefix="dl4py-parallel-") as tmp, DeferredInterrupt() as interrupt:
            spec.model_path = str(Path(tmp) / "model.dl4py")
            self.model.save(spec.model_path)
            result_path = str(Path(tmp) / "result.dl4py")
            init_method = f"file://{Path(tmp) / 'rendezvous'}"
            backend = self._process_group_backend(devices, world)
            # stop_event tears everything down; interrupt_event asks for a stop at a round boundary.
            messages, stop_event, interrupt_event = ctx.Queue(), ctx.Event(), ctx.Event()
            replay.decisions = ctx.Queue() if self._controller is not None else None  # read by worker 0
            inboxes = [ctx.Queue(maxsize=max(self.prefetch_buffer, 1)) for _ in range(world)] if spec.source is None else [None] * world
            procs = [
                ctx.Process(
                    target=spawned_worker_main, name=f"dl4py-worker-{rank}", daemon=True,
                    args=(rank, world, spec, init_method, backend, messages, inboxes[rank], stop_event, result_path,
                          os.getpid(), interrupt_event, replay.decisions if rank == 0 else None),
                )
                for rank in range(world)
            ]
            feeder = (_Feeder(iterator, inboxes, epochs, self.model.epoch_count, stop_event, self.timeout,
                              self.model.batch_in_epoch) if spec.source is None else None)
            replay.fit_start()
            patience = 0.0  # on any error, workers still running are killed at once
            failed = True
            try:
                with children_ignore_stop_signals():
                    for proc in procs:
                        proc.start()
                if feeder is not None:
                    feeder.start()
                reports = self._watch(procs, spec, messages, feeder, interrupt, interrupt_event, replay)
                patience = GRACE_SECONDS  # they have reported and are exiting on their own
                failed = False
            except KeyboardInterrupt:  # a second Ctrl-C / SIGTERM
                raise TrainingInterrupted(f"parallel training stopped by {interrupt.cause or 'Ctrl-C'}; every worker "
                                          "was stopped at once (second signal) and the model keeps its state from "
                                          "before this fit") from None
            finally:
                stop_event.set()
                stop_all(procs, patience)
                if failed:  # the promise of every failure: the model as it was before this fit
                    replay.abandon(spec.model_path)
            restore_state(self.model, result_path)
            if reports[0].get("interrupted"):  # a signal after the workers' last vote: the fit completed
                self._end_interrupted(replay, interrupt.cause or "Ctrl-C")
            replay.fit_end(False)
        self.last_records = {rank: r["records"] for rank, r in reports.items()}
        self.last_report = reports[0]
        return [_summary(d) for d in reports[0]["summaries"]]

    def _end_interrupted(self, replay: EventReplay, cause: str) -> None:
        """The model holds worker 0's state from the round the workers stopped after; the
        listeners' interrupted end (a CheckpointListener's save) runs in this process, the
        one that owns the run directory."""
        replay.fit_end(True)
        model = self.model
        raise TrainingInterrupted(
            f"parallel training stopped by {cause}; every worker was stopped after a whole round, "
            f"at iteration {model.iteration_count} (epoch {model.epoch_count}, batch {model.batch_in_epoch}); "
            "the model is consistent"
        )

    def _watch(self, procs, spec, messages, feeder, interrupt, interrupt_event, replay) -> dict[int, dict]:
        """Wait for every worker's report, replaying worker 0's events meanwhile; the first
        failure stops them all and is raised. Once a stop is requested, the workers have
        ``timeout`` seconds to reach a round boundary."""
        reports: dict[int, dict] = {}
        failures: dict[int, tuple[str, str]] = {}  # rank -> (kind, detail)
        settle_until = stop_deadline = None
        while len(reports) < len(procs):
            if interrupt.requested and stop_deadline is None:
                interrupt_event.set()
                stop_deadline = time.monotonic() + self.timeout
                log.warning("%s: stopping the workers after the next averaging round and keeping the model; "
                            "send it again to stop at once", interrupt.cause)
            if stop_deadline is not None and time.monotonic() > stop_deadline:
                raise TrainingInterrupted(
                    f"parallel training stopped by {interrupt.cause}: the workers did not reach a round boundary "
                    f"within timeout={self.timeout:.0f} s and were killed; the model keeps its state from before this fit")
            # Looked at before reading: a worker that had exited by then has sent all it will.
            exited = [rank for rank, proc in enumerate(procs) if proc.exitcode is not None]
            for message in received(messages, POLL_SECONDS, MESSAGES_PER_PASS):
                if isinstance(message, Done):
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
            for rank in [r for r in failures if r in reports]:
                del failures[rank]  # a report that arrived after its sender exited
            if failures:
                # A dead worker makes its peers fail too ("connection reset"): wait a moment
                # so the cause, not its echo, is what gets reported.
                settle_until = settle_until or time.monotonic() + SETTLE_SECONDS
                if time.monotonic() >= settle_until or all(k == "exception" for k, _ in failures.values()):
                    raise self._root_cause(failures, procs, spec)
        return reports

    @staticmethod
    def _root_cause(failures, procs, spec) -> WorkerError:
        order = {"exception": 0, "died": 1, "silent": 2, "lost-peer": 3}
        rank = min(failures, key=lambda r: (order[failures[r][0]], r))
        kind, detail = failures[rank]
        if kind == "died":
            detail = exit_description(procs[rank].exitcode)
        elif kind == "silent":
            detail = "exited without reporting its result (its report could not be sent back; see its stderr)"
        others = sorted(r for r in failures if r != rank)
        if others:
            detail += f"\n(then worker{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} stopped as well)"
        return WorkerError(rank, spec.devices[rank % len(spec.devices)], detail)

    # ---- under torchrun: this process is one worker ----------------------------------------
    def _fit_launched(self, iterator, epochs, listeners, record) -> list[EpochSummary]:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ["LOCAL_RANK"])
        if self.workers is not None and self.workers != world:
            raise ConfigError("workers", f"is {self.workers} but torchrun launched {world} processes; leave it unset under torchrun")
        node_devices = self._resolve_devices()
        # Every rank must reach the same backend: without LOCAL_WORLD_SIZE (launchers other
        # than torchrun), all take the world as one node's, which errs towards gloo.
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        # This node's workers share its cores; other nodes have their own.
        spec = self._spec(iterator, epochs, node_devices, local_world, record)
        spec.devices = [node_devices[local_rank % len(node_devices)]] * world  # this process's device, whatever its rank
        if spec.source is None:
            spec.source = StrideSource(iterator)
        owns_group = not dist.is_initialized()
        if owns_group:
            # NCCL refuses two ranks on one GPU, which more processes per node than GPUs gives.
            backend = self._process_group_backend(node_devices, local_world)
            dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=self.timeout))
        try:
            with tempfile.TemporaryDirectory(prefix=f"dl4py-rank{rank}-") as tmp:
                spec.model_path = str(Path(tmp) / "model.dl4py")
                self.model.save(spec.model_path)
                # Rank 0 runs the listeners and early stopping's decisions: there is no coordinator.
                lead = rank == 0
                decide = _decided_here(self._controller) if lead and self._controller is not None else None
                replica, report = train_replica(rank, world, spec, spec.source, listeners=listeners if lead else [],
                                                decide=decide)
                replica.save(Path(tmp) / "result.dl4py")
                restore_state(self.model, Path(tmp) / "result.dl4py")
        finally:
            if owns_group:
                dist.destroy_process_group()
        self.last_records = {rank: report["records"]}
        self.last_report = report
        return [_summary(d) for d in report["summaries"]]


class _Feeder(threading.Thread):
    """Deals a user iterator's batches to the workers' queues (any iterator, in this process)."""

    def __init__(self, iterator, inboxes, epochs, first_epoch, stop_event, timeout, first_batch):
        super().__init__(name="dl4py-feeder", daemon=True)
        self.args = (iterator, inboxes, epochs, first_epoch, stop_event, timeout, first_batch)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            deal_batches(*self.args)
        except BaseException as exc:
            if not self.args[4].is_set():
                self.error = exc


def _decided_here(controller):
    """Early stopping's epoch decision made in this process, on its replica (torchrun's rank 0)."""
    def decide(replica):
        return controller.end_of_epoch(replica, replica.epoch_count - 1)
    return decide


def _summary(d: dict) -> EpochSummary:
    return EpochSummary(**{f.name: d[f.name] for f in dataclasses.fields(EpochSummary) if f.name in d})


