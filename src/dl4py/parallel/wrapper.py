"""ParallelWrapper: data-parallel training of an existing model (DL4J's class of that name).

    with ParallelWrapper(model, workers=2, prefetch_buffer=24, averaging_frequency=3,
                         report_score_after_averaging=True) as wrapper:
        for epoch in range(3):  # DL4J's loop: one fit per epoch
            wrapper.fit(MnistDataSetIterator(128, train=True, seed=12345))

Workers are processes on ``torch.distributed``; worker ``i`` runs on device
``devices[i % len(devices)]``. Started as a plain script, the first ``fit`` spawns the
workers and later fits reuse them (``pool.py``) until ``close()``, the end of a ``with``
block, or the end of the program; the script must train under
``if __name__ == "__main__":`` (``main_guard.py``). Under ``torchrun`` (any number of
nodes), ``fit`` runs as the launched process's rank instead (``launched.py``). Either way
each rank runs ``rank.run_rank``. Afterwards ``model`` holds the averaged parameters (and
updater state).

With spawned workers, this process alone runs the fit's listeners (and early stopping's
scoring, saving and decisions), on events worker 0 relays (``events.py``); at each epoch
end ``model`` takes worker 0's averaged state first. A listener that must read the live
replica mid-epoch (``StatsListener``) gives worker 0 a part to run there, whose records
are relayed. Under torchrun, rank 0 runs them.

Ctrl-C or SIGTERM while spawned workers train, at this process or at any one worker: the
workers stop together after the next averaging round, worker 0's replica comes back, and
the listeners' ``on_fit_end(model, interrupted=True)`` runs here (a CheckpointListener
keeps a checkpoint that ``fit`` continues from mid-epoch); then ``TrainingInterrupted``,
naming the worker when the signal went to one. A second signal here stops at once.
Under torchrun the same, with rank 0's listeners. Spawned workers die with this process,
even when it is killed outright.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from functools import partial
from pathlib import Path

import torch

from dl4py.backend.cuda_environment import environment
from dl4py.config.parallel import (
    ParallelOptions,
    ParallelPlan,
    check_mode_fits_model,
    fold_training_mode,
    given_options,
)
from dl4py.errors import ConfigError, DataError
from dl4py.nn.model import Model, as_iterator
from dl4py.nn.torch_model import TorchModel
from dl4py.parallel.coordinator import Coordinator, RanksEnded
from dl4py.parallel.dl4j_options import note_dl4j_options
from dl4py.parallel.events import EventReplay
from dl4py.parallel.launched import launched_by_torchrun, launched_world, run_launched_rank
from dl4py.parallel.main_guard import check_main_guard
from dl4py.parallel.pool import PoolLayout, WorkerPool
from dl4py.parallel.preflight import (
    check_picklable,
    check_plan_transport,
    check_world,
    own_source,
    private_copy,
    process_group_backend,
)
from dl4py.parallel.rank import RankReport
from dl4py.parallel.sources import GroupCopies, batches_per_epoch, is_shardable
from dl4py.parallel.threads import worker_threads
from dl4py.parallel.worker import WorkerSpec
from dl4py.train.history import History
from dl4py.train.interrupt import DeferredInterrupt
from dl4py.train.loop import EpochSummary, TrainingInterrupted
from dl4py.train.numbering import epoch_name, stop_point
from dl4py.train.progress import batches_of, console_listeners
from dl4py.train.randomness import SeededReading
from dl4py.train.validation import EpochValidation, fit_metrics

__all__ = ["ParallelWrapper", "launched_by_torchrun"]


class _Option:
    """``wrapper.workers`` and the like: the option in effect (``shown``: how it reads).
    Setting one checks it as the constructor does; the next fit starts other worker
    processes if it needs them."""

    def __init__(self, shown=None):
        self.shown = shown

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, wrapper, owner=None):
        if wrapper is None:
            return self
        return self.shown(wrapper.options) if self.shown else getattr(wrapper.options, self.name)

    def __set__(self, wrapper, value):
        wrapper.options = dataclasses.replace(wrapper.options, **{self.name: value}).validate()


class _EarlierPlanOption(_Option):
    """``wrapper.training_mode`` and ``wrapper.tensor_parallel_size``: an earlier release's
    spelling of the plan, read as it was and set through ``parallelism`` (noted as deprecated)."""

    def __set__(self, wrapper, value):
        mode = value if self.name == "training_mode" else wrapper.options.parallelism.mode
        size = value if self.name == "tensor_parallel_size" else wrapper.options.parallelism.tensor_size
        plan = fold_training_mode({"training_mode": mode, "tensor_parallel_size": size}, "ParallelWrapper")
        wrapper.options = dataclasses.replace(wrapper.options, **plan).validate()


class ParallelWrapper:
    """Data-parallel training. Options are DL4J's (``ParallelOptions`` says what each does);
    one that cannot apply is an error. DL4J's options that dl4py has no use for
    (``use_legacy_averaging``, ``workspace_mode``, ...) are accepted and noted in the log
    (``dl4j_options.py``). The options can be changed between fits: a fit that needs other
    worker processes starts them. ``options``: a ``ParallelOptions`` in place of the keywords
    (a run config's ``training.parallel_options()``), taken as it is once validated."""

    workers = _Option()
    prefetch_buffer = _Option()
    averaging_frequency = _Option(lambda options: options.rounds_per_average)
    report_score_after_averaging = _Option()
    average_updaters = _Option(lambda options: options.averages_updater_state)
    parallelism = _Option()
    devices = _Option(lambda options: None if options.devices is None else list(options.devices))
    timeout = _Option()
    threads_per_worker = _Option()
    training_mode = _EarlierPlanOption(lambda options: options.parallelism.mode)  # deprecated: parallelism
    tensor_parallel_size = _EarlierPlanOption(lambda options: options.parallelism.tensor_size)  # deprecated

    def __init__(
        self,
        model: Model,
        workers: int | None = None,
        prefetch_buffer: int = 16,
        averaging_frequency: int | None = None,
        report_score_after_averaging: bool = False,
        average_updaters: bool | None = None,
        parallelism: ParallelPlan | str | dict | None = None,
        devices: list | None = None,
        timeout: float = 300.0,
        *,
        threads_per_worker: int | None = None,
        training_mode: str | None = None,  # deprecated: parallelism
        tensor_parallel_size: int | None = None,  # deprecated: parallelism
        options: ParallelOptions | None = None,
        **dl4j_options,
    ):
        if not isinstance(model, Model):
            raise TypeError(f"ParallelWrapper needs a dl4py model (MultiLayerNetwork or TorchModel), got {type(model).__name__}")
        note_dl4j_options(dl4j_options, [*ParallelOptions.names(), "options"])
        self.model = model
        keywords = dict(
            workers=workers, prefetch_buffer=prefetch_buffer, averaging_frequency=averaging_frequency,
            report_score_after_averaging=report_score_after_averaging, average_updaters=average_updaters,
            parallelism=parallelism, devices=devices, timeout=timeout, threads_per_worker=threads_per_worker,
            training_mode=training_mode, tensor_parallel_size=tensor_parallel_size,
        )
        self.options = given_options(options, keywords, "ParallelWrapper")
        self.last_records: dict[int, list[float]] = {}
        self.last_report: RankReport | None = None
        self.last_threads: dict[int, int] = {}  # intra-op threads each worker trained with, by rank
        self._pool = WorkerPool()
        self._training_accuracy = False  # set by each fit from its metrics

    # ---- public ---------------------------------------------------------------------------
    def fit(self, iterator, epochs: int = 1, listeners=(), *, validation=None, metrics=None, verbose="auto",
            accumulate_batches: int | None = None, controller=None, _record_examples: bool = False) -> History:
        """Train ``epochs`` epochs; the model then holds the averaged parameters. With
        ``validation`` (anything ``Model.fit`` accepts), the averaged model is scored after
        each epoch, as ``Model.fit`` does. ``verbose`` as ``Model.fit``'s: this process
        draws the bar (or the lines), counting every worker's batches. ``accumulate_batches``
        as ``Model.fit``'s (the model's setting; None keeps it): each worker sums the
        gradients of that many of its own batches into each update. Returns the History
        of the epochs.

        ``controller``: an ``EarlyStoppingController`` that decides when training stops,
        ``epochs`` being then at most: every worker asks its iteration conditions after each
        round, and this process (rank 0 under torchrun) scores the averaged model after each
        epoch and decides; ``last_report.stop`` then says which condition fired, e.g.

            controller = EarlyStoppingController(config)
            history = wrapper.fit(train, 100, controller=controller, verbose=0)
            result = controller.result(*wrapper.last_report.stop, history)

        (what ``EarlyStoppingParallelTrainer.fit`` does)."""
        if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1:
            raise ConfigError("epochs", f"must be a positive integer, got {epochs!r}")
        if accumulate_batches is not None:
            self.model.set_accumulate_batches(accumulate_batches)
        # Anything Model.fit accepts (a DataLoader, a DataFrame, arrays, ...), as an iterator.
        iterator = as_iterator(iterator, None, seed=getattr(self.model, "seed", 0), training=True)
        listeners = list(listeners)
        listeners += console_listeners(verbose, self.model.epoch_count + epochs, batches_of(iterator), listeners)
        validator = None
        if validation is not None:
            held_out = as_iterator(validation, None)
            self.model.check_data(held_out)
            validator = EpochValidation(held_out, None if metrics is None else list(metrics))
            listeners = [validator, *listeners]
        # History's "accuracy", as Model.fit counts it: each worker's hits, summed at the epoch's end.
        # Not under the tensor and hybrid plans, whose ranks' forward passes do not give one
        # output row per example of their own batch.
        self._training_accuracy = ("accuracy" in fit_metrics(self.model, metrics)
                                   and self.options.parallelism.kind not in ("tensor", "hybrid"))
        summaries = self._train(iterator, epochs, listeners, _record_examples, controller)
        return History(validator.apply(summaries) if validator is not None else summaries)

    def close(self) -> None:
        """End the worker processes (a later ``fit`` starts new ones). Also done by ``with``,
        when the wrapper is collected, and at the end of the program."""
        self._pool.close()

    def __enter__(self) -> "ParallelWrapper":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def _train(self, iterator, epochs, listeners, record, controller) -> list[EpochSummary]:
        """Train; with an early-stopping ``controller``, until its conditions say stop.
        ``self.last_report`` then holds worker 0's report (its controller and stop reason)."""
        launched = launched_by_torchrun()
        if not launched:
            check_main_guard()  # before anything else: spawned workers would run the script's top level
        self.model.init()
        self.model.check_data(iterator)  # every label of in-memory data, before any worker starts
        if self.model.batch_in_epoch:
            self._check_resumable(iterator)
        self._controller = controller
        if controller is not None:
            controller.start(self.model.epoch_count)
        if launched:
            reports = self._fit_launched(iterator, epochs, list(listeners), record)
        else:
            reports = self._fit_spawned(iterator, epochs, list(listeners), record)
        self.last_records = {rank: report.records for rank, report in reports.items()}
        self.last_threads = {rank: report.threads for rank, report in reports.items()}
        self.last_report = reports[min(reports)]  # worker 0's; under torchrun, this rank's
        return self.last_report.summaries

    def _check_resumable(self, iterator) -> None:
        """A DataError, before any worker starts, when the rest of the model's stopped epoch
        cannot be trained as the uninterrupted run would have."""
        model = self.model
        where = f"cannot continue {epoch_name(model.epoch_count)} after batch {model.batch_in_epoch}"
        refusal = iterator.replay_refusal()
        if refusal is not None:
            raise DataError(f"{where}: {refusal}")
        if self.options.parallelism.mode == "averaging" and not self.options.averages_updater_state:
            raise DataError(f"{where}: with average_updaters=False each worker keeps its own updater state, and "
                            "the model holds worker 0's alone, so every worker would go on with worker 0's; "
                            "resume from an epoch's end, or train with average_updaters on")

    # ---- shared set-up -----------------------------------------------------------------
    def _resolve_devices(self) -> list[str]:
        if self.options.devices is not None:
            for d in self.options.devices:
                if d.startswith("cuda") and not torch.cuda.is_available():
                    raise ConfigError("devices", f"{d} is not usable: this machine has no CUDA device")
            return list(self.options.devices)
        if self.model.backend.device.type == "cuda":
            return [f"cuda:{i}" for i in environment().usable_cuda_devices()]
        return ["cpu"]

    def _spec(self, iterator, epochs, devices, world, record) -> WorkerSpec:

        cpu_workers = sum(1 for rank in range(world) if devices[rank % len(devices)] == "cpu")
        check_mode_fits_model(self.options.parallelism.mode, self.model)
        if not cpu_workers and self.options.threads_per_worker is not None:
            raise ConfigError("threads_per_worker", f"applies to workers on the CPU; these all train on "
                                                    f"{', '.join(sorted(set(devices)))}")
        threads = worker_threads(cpu_workers, self.options.threads_per_worker, launched_by_torchrun())
        return WorkerSpec(
            model_file="",  # written by the launcher, as of the fit's start
            torch_model=self.model if isinstance(self.model, TorchModel) else None,
            source=own_source(iterator),
            num_batches=None if is_shardable(iterator) else batches_per_epoch(iterator),
            epochs=epochs,
            options=self.options,
            devices=devices,
            precision=self.model.precision,  # the policy itself, settings and all
            threads=threads if cpu_workers else None,
            environment=environment().to_dict(),  # every worker applies the same settings
            record_examples=record,
            early_stopping=self._controller is not None,
            iteration_conditions=[] if self._controller is None else list(self._controller.config.iteration_conditions),
            accumulate_batches=self.model.accumulate_batches,
            training_accuracy=self._training_accuracy,
        )

    _process_group_backend = staticmethod(process_group_backend)

    # ---- spawned workers, watched by this process ----------------------------------------
    def _fit_spawned(self, iterator, epochs, listeners, record) -> dict[int, RankReport]:
        devices = self._resolve_devices()
        world = self.options.workers or (len(devices) if devices[0].startswith("cuda") else 2)
        check_world(world, devices, iterator)  # before any process starts
        check_plan_transport(self.options.parallelism, world, devices)
        self.options.mesh_shape(world)  # tensor groups that divide the workers
        spec = self._spec(iterator, epochs, devices, world, record)
        if spec.torch_model is not None:
            spec.torch_model = private_copy(spec.torch_model)
        check_picklable(spec)
        replay = EventReplay(self.model, listeners, self._controller)  # the listeners run here
        spec.relay_epochs, spec.relay_iterations = replay.relays_epochs, replay.relays_iterations
        layout = PoolLayout(world, tuple(devices), process_group_backend(devices, world), self.options.parallelism.mode,
                            max(self.options.prefetch_buffer, 1), self.options.timeout,
                            json.dumps(spec.environment, sort_keys=True, default=str))
        with tempfile.TemporaryDirectory(prefix="dl4py-parallel-") as tmp, DeferredInterrupt() as interrupt:
            coordinator = Coordinator(self.model, replay)
            spec.model_file = coordinator.save(Path(tmp) / "model.dl4py")  # the model as of this fit, changes included
            # Parts of listeners that read worker 0's live replica (a StatsListener's); from here
            # until on_fit_end those listeners take their records from the relay.
            spec.listener_parts = replay.worker_parts(world)
            return coordinator.run(lambda: self._run_workers(spec, layout, iterator, world, replay, interrupt))

    def _run_workers(self, spec, layout, iterator, world, replay, interrupt) -> RanksEnded:
        """The pool's workers train this fit; on any error they are killed at once, and the
        pool closed."""
        try:
            self._pool.ensure(layout, spec.log_level)
            replay.decisions = self._pool.decisions if self._controller is not None else None  # read by worker 0
            dealt, copies = self._dealt(iterator, world) if spec.source is None else (iterator, 1)
            reports = self._pool.run(spec, dealt, self.model.epoch_count, self.model.batch_in_epoch * copies,
                                     replay, interrupt)
        except KeyboardInterrupt:  # a second Ctrl-C / SIGTERM
            raise TrainingInterrupted(f"parallel training stopped by {interrupt.cause or 'Ctrl-C'}; every worker "
                                      "was stopped at once (second signal) and the model keeps its state from "
                                      "before this fit") from None
        first = reports[0]
        state, first.state = first.state, None  # the model takes it
        interrupted = None
        if first.interrupted:  # a signal after the workers' last vote: the fit completed
            # A signal here (a terminal's Ctrl-C reaches the workers too) is the one to name.
            cause = interrupt.cause or first.stop_cause("worker") or "Ctrl-C"
            interrupted = partial(self._interrupted, cause, "worker")
        return RanksEnded(reports, state, interrupted)

    def _dealt(self, iterator, world: int):
        """What this process deals to the workers, and how many times each batch: read as
        Model.fit reads it, each batch with the generators seeded for its position (the same
        order, resumed or not), and in tensor mode once for every rank of a tensor group."""
        shape = self.options.mesh_shape(world)  # (world,): one tensor group; (groups, tensor ranks)
        copies = (world if len(shape) == 1 else shape[1]) if self.options.parallelism.mode == "tensor" else 1
        return GroupCopies(SeededReading(iterator, getattr(self.model, "seed", 0)), copies), copies

    def _interrupted(self, cause: str, noun: str) -> TrainingInterrupted:
        model = self.model
        return TrainingInterrupted(
            f"parallel training stopped by {cause}; every {noun} was stopped after a whole round, "
            f"at iteration {model.iteration_count} ({stop_point(model.epoch_count, model.batch_in_epoch)}); "
            "the model is consistent"
        )

    # ---- under torchrun: this process is one rank ----------------------------------------
    def _fit_launched(self, iterator, epochs, listeners, record) -> dict[int, RankReport]:
        world, local_world = launched_world()
        if self.options.workers is not None and self.options.workers != world:
            raise ConfigError("workers", f"is {self.options.workers} but torchrun launched {world} processes; "
                                         "leave it unset under torchrun")
        self.options.mesh_shape(world)  # tensor groups that divide the ranks
        node_devices = self._resolve_devices()
        # This node's workers share its cores; other nodes have their own.
        spec = self._spec(iterator, epochs, node_devices, local_world, record)
        report = run_launched_rank(self.model, spec, iterator, node_devices, listeners, self._controller)
        if report.interrupted:  # rank 0's listeners have kept the checkpoint; every rank says why it stopped
            raise self._interrupted(report.stop_cause("rank") or "a stop request", "rank")
        return {int(os.environ["RANK"]): report}

