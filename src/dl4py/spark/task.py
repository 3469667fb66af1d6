"""What each Spark task runs: the ParallelWrapper, as the worker of a launched process.

TorchDistributor starts one ``torchrun`` per task, so ``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK`` are set and ``ParallelWrapper.fit`` runs as it does under torchrun: the
same rank program for every launcher. ``TaskJob`` is all a rank receives (by pickle):
the model as the bytes of its saved file, the data, and the wrapper's options.
"""

from __future__ import annotations

import io
import os
import socket
import traceback
from dataclasses import dataclass

from dl4py.errors import DL4PyError


@dataclass
class TaskJob:
    model: bytes  # Model.save's file: weights, updater state, counters (and a network's config)
    torch_model: bytes | None  # a TorchModel's recipe (torch.save'd), to load ``model`` into
    data: object  # an iterator every rank can rebuild: in-memory, or a table directory it reads its shard of
    validation: object | None
    metrics: list | None
    epochs: int
    options: dict  # the ParallelWrapper's
    use_gpu: bool
    precision: str
    address: tuple[str, int]  # the driver's EventServer
    key: bytes
    relay: bool  # rank 0 sends its epochs (the driver has listeners) ...
    relay_iterations: bool  # ... and its steps
    cpus: int = 1  # spark.task.cpus: the cores this task may use (CPU training)
    listener_parts: tuple = ()  # rank 0 runs them on its replica and relays what they make (a StatsListener's)
    accumulate_batches: int = 1  # the model's setting, which its file does not carry


def train_task(job: TaskJob):
    """One rank's training. Rank 0 returns the trained model file's bytes and its epochs'
    summaries; a failing rank reports its error to the driver first."""
    from dl4py.parallel import ParallelWrapper
    from dl4py.parallel.events import EventRelay
    from dl4py.process_guard import die_with_parent
    from dl4py.spark.events import DriverLine

    die_with_parent(os.getppid())  # torchrun's agent: a cancelled task leaves no rank training
    # Each task runs one torchrun, so a rank cannot count its neighbours on the executor: the
    # cores Spark gave the task are its share (read by the wrapper's thread count).
    os.environ["OMP_NUM_THREADS"] = str(job.cpus)
    rank = int(os.environ["RANK"])
    line = None
    try:
        model = _replica(job)
        listeners = []
        if rank == 0 and job.relay:
            line = DriverLine(job.address, job.key)
            relay = EventRelay(line, None, job.relay_iterations, job.options["timeout"], parts=job.listener_parts)
            listeners.extend([*relay.parts, relay])
        # verbose=0: the driver shows progress, from the relayed events; a task prints none.
        history = ParallelWrapper(model, **job.options).fit(job.data, epochs=job.epochs, listeners=listeners,
                                                            validation=job.validation, metrics=job.metrics,
                                                            verbose=0, accumulate_batches=job.accumulate_batches)
    except BaseException as exc:
        _report(job, rank, exc)
        raise
    finally:
        if line is not None:
            line.close()
    if rank != 0:
        return None
    from dl4py.nn.serialization import model_bytes

    return {"model": model_bytes(model), "summaries": list(history)}


def _replica(job: TaskJob):
    from dl4py.nn import load
    from dl4py.nn.serialization import restore_state

    backend = "gpu" if job.use_gpu else "cpu"  # TorchDistributor gives a GPU task its GPU alone
    if job.torch_model is None:
        return load(job.model, backend=backend, precision=job.precision)
    import torch

    model = torch.load(io.BytesIO(job.torch_model), map_location="cpu", weights_only=False)
    model.place(backend, job.precision)
    restore_state(model, job.model)
    return model


def _report(job: TaskJob, rank: int, exc: BaseException) -> None:
    from dl4py.parallel.messages import Failed
    from dl4py.spark.events import send_once

    # A problem with the user's data or settings is its sentence; anything else keeps its
    # traceback (DL4PY_DEBUG=1: every traceback), as a spawned worker reports.
    user_error = isinstance(exc, DL4PyError) and os.environ.get("DL4PY_DEBUG", "") in ("", "0")
    device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if job.use_gpu else "cpu"
    detail = str(exc) if user_error else traceback.format_exc()
    send_once(job.address, job.key, Failed(rank, f"{device} on {socket.gethostname()}", detail, user_error))
