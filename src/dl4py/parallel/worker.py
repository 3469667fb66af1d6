"""What a parallel worker is given and builds: ``WorkerSpec`` and its model replica.

Every rank of a parallel fit (a pool's worker, a process torchrun launched, a Spark task)
gets one ``WorkerSpec``, plain picklable data, and builds its replica on its own device
with ``build_replica``; ``rank.run_rank`` then trains it epoch by epoch
(``train.epoch.run_epoch`` with a ``round_meeting.RoundMeeting``). A distributed mode's
replica is built by its plan instead (module, conversion, then optimizer): the rank takes
it unbuilt from ``replica_to_build``, with its model file.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass, field

import torch

from dl4py.backend import Backend, Precision
from dl4py.config.parallel import ParallelOptions
from dl4py.nn.declared_shapes import check_weights_declared
from dl4py.nn.loading import load, network_model
from dl4py.nn.model_file import ModelFile, read_model_file
from dl4py.nn.serialization import restore_state


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
    precision: Precision  # the policy object, its settings (max_skipped_steps) included
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
    training_accuracy: bool = False  # count History's "accuracy" over every worker's batches


def worker_device(spec: WorkerSpec, rank: int) -> torch.device:
    return torch.device(spec.devices[rank % len(spec.devices)])


def build_replica(spec: WorkerSpec, device: torch.device):

    backend = _backend(device)
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


def replica_to_build(spec: WorkerSpec, device: torch.device) -> tuple:
    """``(model, model_file)``: the fit's model for this worker's device, not built yet (a
    distributed plan builds it: ``Model.init(parallelize=...)``), and its model file, read,
    which holds the state it starts from. ``spec.torch_model`` must be a private copy (bytes)."""
    backend = _backend(device)
    saved: ModelFile = read_model_file(spec.model_file)
    if spec.torch_model is None:
        check_weights_declared(saved)  # before the build: the config alone might ask for terabytes
        return network_model(saved.config, backend=backend, precision=spec.precision or saved.meta["precision"]), saved
    model = torch.load(io.BytesIO(spec.torch_model), map_location="cpu", weights_only=False)
    model.place(backend, spec.precision)
    return model, saved


def _backend(device: torch.device) -> Backend:
    return Backend("gpu" if device.type == "cuda" else "cpu", device, "parallel worker")
