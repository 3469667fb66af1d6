"""What each Spark task runs: the ParallelWrapper, as the worker of a launched process.

TorchDistributor starts one ``torchrun`` per task, so ``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK`` are set and ``ParallelWrapper.fit`` runs as it does under torchrun: the
same rank program for every launcher. ``TaskJob`` is all a rank receives (by pickle):
the model as the bytes of its saved file, the data, and the driver's ``ParallelOptions``
(validated there, taken here as they are). The process torchrun starts forks the rank and
watches it (``supervisor.py``); every rank tells the driver where it runs and how it
ended (``reports.py``).
"""

from __future__ import annotations

import io
import os
import traceback
from dataclasses import dataclass
from multiprocessing import AuthenticationError

import torch

from dl4py.backend import Precision
from dl4py.config.parallel import ParallelOptions
from dl4py.errors import DL4PyError
from dl4py.nn import load
from dl4py.nn.serialization import model_bytes, restore_state
from dl4py.parallel.events import EventRelay
from dl4py.parallel.processes import is_lost_peer
from dl4py.parallel.wrapper import ParallelWrapper
from dl4py.spark.events import DriverLine, send_once
from dl4py.spark.reports import (ERROR, LOST_PEER, STOPPED, TASK_GONE, USER_ERROR, RankExited, RankFailed, RankFinished,
                                 RankStarted, TaskProcesses, ended_above)
from dl4py.spark.supervisor import await_cancellation, supervise
from dl4py.train.loop import TrainingInterrupted


@dataclass
class TaskJob:
    model: bytes  # Model.save's file: weights, updater state, counters (and a network's config)
    torch_model: bytes | None  # a TorchModel's recipe (torch.save'd), to load ``model`` into
    data: object  # an iterator every rank can rebuild: in-memory, or a table directory it reads its shard of
    validation: object | None
    metrics: list | None
    epochs: int
    options: ParallelOptions  # validated by the driver
    use_gpu: bool
    precision: Precision  # the policy object, its settings (max_skipped_steps) included
    address: tuple[str, int]  # the driver's EventServer
    key: bytes
    relay: bool  # rank 0 sends its epochs (the driver has listeners) ...
    relay_iterations: bool  # ... and its steps
    cpus: int = 1  # spark.task.cpus: the cores this task may use (CPU training)
    listener_parts: tuple = ()  # rank 0 runs them on its replica and relays what they make (a StatsListener's)
    accumulate_batches: int = 1  # the model's setting, which its file does not carry


def train_task(job: TaskJob):
    """One rank's training. Rank 0 returns the trained model file's bytes and its epochs'
    summaries. A rank that fails tells the driver, which names the cause in one line and
    cancels the job; until the cancel ends it, the rank waits, quiet: its traceback goes no
    further than the driver's debug log."""
    rank = int(os.environ["RANK"])
    device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if job.use_gpu else "cpu"
    processes = TaskProcesses.above(rank, device)
    exits = _line(job)  # opened before the fork: the parent's, held until the rank has ended
    if supervise(lambda pid, code: _tell(exits, RankExited(rank, pid, code), last=True)):
        processes = processes.of_rank(os.getpid())
    if exits is not None:
        exits.close()  # this process's copy: the parent holds its own
    # Each task runs one torchrun, so a rank cannot count its neighbours on the executor: the
    # cores Spark gave the task are its share (read by the wrapper's thread count).
    os.environ["OMP_NUM_THREADS"] = str(job.cpus)
    line = None
    try:
        line = DriverLine(job.address, job.key) if rank == 0 and job.relay else _line(job)
        if line is not None:
            line.put(RankStarted(processes))
        result = _train(job, rank, line)
    except Exception as exc:
        if _report(job, processes, exc, line):
            if line is not None:
                line.close()  # said: the driver need not wait for this connection to end
            await_cancellation()  # the driver names the cause; Spark's cancel ends this process
        raise
    except BaseException as exc:  # KeyboardInterrupt, SystemExit: reported, and left as they are
        _report(job, processes, exc, line)
        raise
    else:
        if line is not None:
            line.put(RankFinished(rank))
        return result
    finally:
        if line is not None:
            line.close()


def _train(job: TaskJob, rank: int, line):
    model = _replica(job)
    listeners = []
    if rank == 0 and job.relay:
        relay = EventRelay(line, None, job.relay_iterations, job.options.timeout, parts=job.listener_parts)
        listeners.extend([*relay.parts, relay])
    # verbose=0: the driver shows progress, from the relayed events; a task prints none.
    history = ParallelWrapper(model, options=job.options).fit(job.data, epochs=job.epochs, listeners=listeners,
                                                              validation=job.validation, metrics=job.metrics,
                                                              verbose=0, accumulate_batches=job.accumulate_batches)
    if rank != 0:
        return None

    return {"model": model_bytes(model), "summaries": list(history)}


def _line(job: TaskJob):
    """A connection to the driver, or None when it cannot be reached: then this rank trains
    unwatched (rank 0 relaying events needs one, and fails without)."""
    try:
        return DriverLine(job.address, job.key)
    except (OSError, EOFError, AuthenticationError):
        return None


def _replica(job: TaskJob):

    backend = "gpu" if job.use_gpu else "cpu"  # TorchDistributor gives a GPU task its GPU alone
    if job.torch_model is None:
        return load(job.model, backend=backend, precision=job.precision)

    model = torch.load(io.BytesIO(job.torch_model), map_location="cpu", weights_only=False)
    model.place(backend, job.precision)
    restore_state(model, job.model)
    return model


def _tell(line, message, last: bool = False) -> bool:
    """Send ``message`` on ``line`` (then close it, when it is the ``last``); False when it
    could not be sent."""
    if line is None:
        return False
    try:
        line.put(message)
        return True
    except (OSError, EOFError):
        return False
    finally:
        if last:
            line.close()


def _report(job: TaskJob, processes: TaskProcesses, exc: BaseException, line) -> bool:
    """Tell the driver why this rank failed; False when it could not be told."""
    # A problem with the user's data or settings is its sentence; anything else keeps its
    # traceback (DL4PY_DEBUG=1: every traceback), as a spawned worker reports.
    debug = os.environ.get("DL4PY_DEBUG", "") not in ("", "0")
    user_error = isinstance(exc, DL4PyError) and not debug
    detail = str(exc) if user_error else traceback.format_exc()
    above = ended_above(processes.gone())
    if above is not None:  # the rank was stopped because its Spark task ended under it
        kind, detail = TASK_GONE, above
    elif isinstance(exc, TrainingInterrupted):
        kind = STOPPED
    elif is_lost_peer(traceback.format_exc()):
        kind = LOST_PEER
    else:
        kind = USER_ERROR if user_error else ERROR
    report = RankFailed(processes.rank, processes.device, detail, kind)
    return _tell(line, report) or send_once(job.address, job.key, report)
