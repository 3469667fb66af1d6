"""SparkTrainer: data-parallel training whose ranks Spark starts (DL4J's SparkDl4jMultiLayer).

    trainer = SparkTrainer(model, workers=4, averaging_frequency=3)
    history = trainer.fit(df, label="y", batch_size=64, epochs=2)

The driver (this process) stages the data, starts one Spark task per rank with
TorchDistributor (a barrier stage: all run at once), and waits. Each task runs
``task.train_task``: the ParallelWrapper as a launched process's worker, on the model's
saved bytes. Rank 0 streams its events here, where the fit's listeners run
(``events.py``), and returns the trained model file, which ``model`` then takes. A rank
that fails or dies stops the job; ``fit`` raises one ``WorkerError`` naming it and how
(``verdict.py``), or a ``TrainingError`` naming the Spark JVM when that died. The fit's
tail (listeners' start and end, the model put back after a failure) is the pool's own
(``parallel/coordinator.py``).
"""

from __future__ import annotations

import io
import logging
import queue
import threading
import time
import uuid

import torch

from dl4py.config.parallel import ParallelOptions, ParallelPlan, given_options
from dl4py.errors import ConfigError, TrainingError
from dl4py.nn.model import Model
from dl4py.nn.torch_model import TorchModel
from dl4py.parallel.coordinator import Coordinator, RanksEnded
from dl4py.parallel.events import EventReplay
from dl4py.parallel.preflight import check_batches_for_world
from dl4py.parallel.processes import exit_description
from dl4py.spark.data import rank_source
from dl4py.spark.events import EventServer
from dl4py.spark.logs import quiet_failure_logs, spark_reason
from dl4py.spark.session import check_slots, jvm_exit
from dl4py.spark.task import TaskJob, train_task
from dl4py.spark.verdict import RankOutcomes
from dl4py.train.history import History
from dl4py.train.loop import TrainingInterrupted
from dl4py.train.progress import batches_of, console_listeners

log = logging.getLogger("dl4py")

POLL_SECONDS = 0.1
# After a rank reports only that a peer went away, how long to wait for the peer's own report.
SETTLE_SECONDS = 5.0


class SparkTrainer:
    """Train ``model`` on ``workers`` Spark tasks. The options are the ParallelWrapper's,
    checked the same way (one that cannot apply is an error), plus:

    - ``spark``: the SparkSession (default: this process's active one);
    - ``use_gpu``: one GPU per task (TorchDistributor's ``use_gpu``; see docs/spark.md for
      the ``spark.*.resource.gpu`` settings the cluster needs); else the ranks use the CPU;
    - ``staging_dir``: where a DataFrame is written for the ranks to read (default: a
      temporary folder on the driver; on a cluster, a folder every executor can read at
      the same path);
    - ``options``: a ``ParallelOptions`` in place of the ParallelWrapper's keywords (a run
      config's); ``devices`` has no place in it, as Spark gives each task its device.

    The options are validated once, here: every task receives this object as it is.
    """

    def __init__(self, model: Model, workers: int | None = None, *, spark=None, prefetch_buffer: int = 16,
                 averaging_frequency: int | None = None, report_score_after_averaging: bool = False,
                 average_updaters: bool | None = None, parallelism: ParallelPlan | str | dict | None = None,
                 use_gpu: bool = False, staging_dir=None, timeout: float = 300.0,
                 options: ParallelOptions | None = None,
                 training_mode: str | None = None, tensor_parallel_size: int | None = None):  # deprecated: parallelism
        keywords = dict(workers=workers, prefetch_buffer=prefetch_buffer, averaging_frequency=averaging_frequency,
                        report_score_after_averaging=report_score_after_averaging,
                        average_updaters=average_updaters, parallelism=parallelism, timeout=timeout,
                        training_mode=training_mode, tensor_parallel_size=tensor_parallel_size)
        if (workers if options is None else options.workers) is None:
            raise ConfigError("workers", "is required: how many Spark tasks train (each one rank)")
        if not isinstance(model, Model):
            raise TypeError(f"SparkTrainer needs a dl4py model (MultiLayerNetwork or TorchModel), "
                            f"got {type(model).__name__}")
        # Validated here, once: each task takes the object as it is.
        self.options = given_options(options, keywords, "SparkTrainer")
        if self.options.devices is not None:
            raise ConfigError("devices", "applies to the ParallelWrapper, not to Spark tasks: Spark gives each task "
                                         "its device (use_gpu)")
        self.model, self.workers = model, self.options.workers
        self.spark, self.use_gpu, self.staging_dir = spark, bool(use_gpu), staging_dir
        self.timeout = self.options.timeout

    def fit(self, data, epochs: int = 1, listeners=(), *, validation=None, metrics=None, label=None, features=None,
            batch_size: int | None = None, shuffle_buffer: int | None = None, seed: int | None = None,
            verbose="auto") -> History:
        """Train ``epochs`` epochs on ``data``; the model then holds the averaged state.

        ``data``: a Spark DataFrame (``label`` column, ``features`` columns: default all
        others; numbers, arrays or ML vectors), a directory of Parquet/CSV files every
        executor can read, or any iterator ``ParallelWrapper.fit`` accepts that pickles (it
        travels to every rank). ``batch_size``, ``shuffle_buffer`` and ``seed`` batch a
        DataFrame or directory as ``TableDirectoryIterator`` does. ``validation`` (it
        travels too) is scored by rank 0 after each epoch. ``listeners`` run here, and so does
        the progress ``verbose`` asks for (as ``Model.fit``'s), from rank 0's relayed events."""
        if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1:
            raise ConfigError("epochs", f"must be a positive integer, got {epochs!r}")
        spark = self._session()
        check_slots(spark.sparkContext.master, self.workers)
        model = self.model
        model.init()
        with rank_source(data, model, self.workers, label=label, features=features, batch_size=batch_size,
                         shuffle_buffer=shuffle_buffer, seed=seed, staging_dir=self.staging_dir) as source:
            check_batches_for_world(self.workers, source)  # each rank reads whole pieces of a table
            _check_picklable(data=source, validation=validation)
            torch_model = _torch_model(model)
            listeners = [*listeners, *console_listeners(verbose, model.epoch_count + epochs, batches_of(source),
                                                        listeners)]
            replay = EventReplay(model, listeners)
            coordinator = Coordinator(model, replay)
            server = EventServer(spark.conf.get("spark.driver.host"), spark.conf.get("spark.driver.bindAddress", ""))
            try:
                job = TaskJob(model=coordinator.save(), torch_model=torch_model, data=source, validation=validation,
                              metrics=None if metrics is None else list(metrics), epochs=epochs, options=self.options,
                              use_gpu=self.use_gpu, precision=model.precision, address=server.address,
                              key=server.key, relay=replay.relays_epochs, relay_iterations=replay.relays_iterations,
                              cpus=_task_cpus(spark), listener_parts=tuple(replay.worker_parts(self.workers)),
                              accumulate_batches=model.accumulate_batches)
                result = coordinator.run(lambda: self._ranks(spark, job, server, replay))
            finally:
                server.close(timeout=0)  # closed already, unless the fit failed here
        return History(result["summaries"])

    def _session(self):
        if self.spark is not None:
            return self.spark
        from pyspark.sql import SparkSession  # optional: pyspark (extra spark)

        active = SparkSession.getActiveSession()
        if active is None:
            raise ConfigError("spark", "no SparkSession is active: pass spark=, or start one first, e.g. "
                                       "SparkSession.builder.master('local[4]').getOrCreate() "
                                       "(or dl4py.spark.spark_session)")
        return active

    def _ranks(self, spark, job: TaskJob, server: EventServer, replay: EventReplay) -> RanksEnded:
        with quiet_failure_logs(spark):  # the fit names what failed, in one line
            result = self._run(spark, job, server, replay)
        return RanksEnded(result, result["model"])

    def _run(self, spark, job: TaskJob, server: EventServer, replay: EventReplay) -> dict:
        """Run the Spark job, replaying rank 0's events meanwhile; the first rank to fail or
        die stops it, and what ended it is what is raised (``verdict.py``)."""
        from pyspark.ml.torch.distributor import TorchDistributor  # optional: pyspark (extra spark)

        try:
            distributor = TorchDistributor(num_processes=self.workers, local_mode=False, use_gpu=self.use_gpu)
        except RuntimeError as exc:  # e.g. use_gpu without the cluster's GPU settings
            raise ConfigError("use_gpu" if self.use_gpu else "spark", str(exc)) from None
        runner = _Job(spark.sparkContext, distributor, job)
        outcomes = RankOutcomes()
        try:
            runner.start()
            _watch(runner, server, outcomes, replay)
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM from dl4py's command
            runner.cancel()
            raise TrainingInterrupted("Spark training stopped (Ctrl-C or SIGTERM): the Spark job was cancelled, "
                                      "which stops every rank; the model keeps its state from before this "
                                      "fit") from None
        except BaseException:  # a listener failed (a full disk, say): nothing goes on training
            runner.cancel()
            raise
        finally:
            runner.join(self.timeout)
        server.close(timeout=min(self.timeout, 30.0))  # the reports sent before the ranks ended
        while not server.messages.empty():
            message = server.messages.get()
            if not outcomes.take(message) and not outcomes.ends and runner.error is None:
                replay.handle(message)
        return _job_result(spark, runner, outcomes)


def _watch(runner: "_Job", server: EventServer, outcomes: RankOutcomes, replay: EventReplay) -> None:
    """While the job runs: replay rank 0's events, and cancel the job once a rank's failure
    is known (or, after a rank said only that a peer went away, once the peer's own report
    has had ``SETTLE_SECONDS`` to arrive)."""
    settle_until = None
    while runner.is_alive():
        try:
            message = server.messages.get(timeout=POLL_SECONDS)
        except queue.Empty:
            message = None
        if outcomes.take(message):
            if outcomes.cause_known():
                runner.cancel()  # the cause is known: stop the others now
            elif outcomes.ends and settle_until is None:  # an echo: wait a moment for its cause
                settle_until = time.monotonic() + SETTLE_SECONDS
        elif message is not None:
            replay.handle(message)
        if settle_until is not None and time.monotonic() > settle_until:
            runner.cancel()


def _job_result(spark, runner: "_Job", outcomes: RankOutcomes) -> dict:
    """Rank 0's result of the ended job, or the error that says what ended it: the JVM's
    death, the first rank's failure, or the job's own error."""
    jvm_end = jvm_exit(spark)
    if jvm_end is not None:
        pid, exitcode = jvm_end
        how = exit_description(exitcode).removeprefix("was ") if exitcode < 0 else f"exit code {exitcode}"
        raise TrainingError(f"the Spark JVM (pid {pid}) died during training ({how}), which ended every rank; "
                            f"the model keeps its state from before this fit") from None
    cause = outcomes.error()
    if cause is not None:
        if runner.error is not None:
            log.debug("the Spark job ended with: %s", runner.error)
        raise cause from None
    if runner.error is not None:
        log.debug("the Spark job ended with: %s", runner.error)
        raise TrainingError(f"the Spark job failed before any rank reported an error (look at the executors' "
                            f"logs): {spark_reason(runner.error)}") from None
    if not isinstance(runner.result, dict):
        raise TrainingError(f"rank 0 returned {type(runner.result).__name__}, not the trained model")
    return runner.result


class _Job(threading.Thread):
    """The Spark job, run from a thread of its own so that this process's main thread can
    run the listeners meanwhile; ``cancel`` kills its tasks (and so every rank)."""

    def __init__(self, sc, distributor, job: TaskJob):
        super().__init__(name="dl4py-spark-job", daemon=True)
        self.sc, self.distributor, self.job = sc, distributor, job
        self.group = f"dl4py-{uuid.uuid4().hex[:12]}"
        self.result = self.error = None
        self._cancelled = False

    def run(self) -> None:
        try:
            self.sc.setJobGroup(self.group, "dl4py: data-parallel training", interruptOnCancel=True)
            self.result = self.distributor.run(train_task, self.job)
        except BaseException as exc:
            self.error = exc

    def cancel(self) -> None:
        if not self._cancelled:
            self._cancelled = True
            try:
                self.sc.cancelJobGroup(self.group)
            except Exception as exc:  # the JVM is gone, and the job with it: said after the job's end
                log.debug("could not cancel the Spark job: %r", exc)


def _task_cpus(spark) -> int:
    """``spark.task.cpus``: the cores Spark reserves for each task (1 unless the cluster says)."""
    try:
        return max(1, int(spark.conf.get("spark.task.cpus", "1")))
    except ValueError:
        raise ConfigError("spark.task.cpus", f"must be a positive integer, got "
                                             f"{spark.conf.get('spark.task.cpus')!r}") from None


def _torch_model(model):
    """A TorchModel's recipe for the ranks; cloudpickle carries a module class defined in a
    notebook or script (``__main__``) by value, where the executors could not import it."""

    if not isinstance(model, TorchModel):
        return None
    from pyspark import cloudpickle  # optional: pyspark (extra spark)

    buffer = io.BytesIO()
    try:
        torch.save(model, buffer, pickle_module=cloudpickle)
    except Exception as exc:
        raise ConfigError("model", f"must be picklable to reach the Spark executors: {exc}") from None
    return buffer.getvalue()


def _check_picklable(**values) -> None:
    """Say what cannot travel to the executors before any task starts."""
    from pyspark import cloudpickle  # optional: pyspark (extra spark)

    for name, value in values.items():
        try:
            cloudpickle.dumps(value)
        except Exception as exc:
            raise ConfigError(name, f"must be picklable to reach the Spark executors: {exc}") from None
