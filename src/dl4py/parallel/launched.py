"""Under torchrun: this process is one rank of the job.

torchrun (or any launcher that sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``, as a
Spark task may) starts one process per rank, on any number of machines; each calls
``ParallelWrapper.fit``, which runs the rank program here instead of spawning workers.
There is no coordinator: rank 0 runs the fit's listeners and early stopping's decisions,
and every rank's model ends holding the trained state. Nothing is pickled.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from dl4py.nn.serialization import model_bytes, restore_state
from dl4py.parallel.preflight import process_group_backend
from dl4py.parallel.rank import RankReport, run_rank
from dl4py.parallel.sources import StrideSource
from dl4py.parallel.worker import WorkerSpec


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def launched_world() -> tuple[int, int]:
    """(processes in the job, processes on this node). Without ``LOCAL_WORLD_SIZE`` (launchers
    other than torchrun) the job counts as one node's, which errs towards gloo: every rank
    must reach the same process-group backend."""
    world = int(os.environ["WORLD_SIZE"])
    return world, int(os.environ.get("LOCAL_WORLD_SIZE", world))


def run_launched_rank(model, spec: WorkerSpec, iterator, node_devices: list[str], listeners, controller) -> RankReport:
    """Train ``model`` as this process's rank; it then holds the trained (averaged) state."""
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world, local_world = launched_world()
    spec.devices = [node_devices[local_rank % len(node_devices)]] * world  # this process's device, whatever its rank
    spec.model_file = model_bytes(model)
    source = spec.source or StrideSource(iterator)
    owns_group = not dist.is_initialized()
    if owns_group:
        # NCCL refuses two ranks on one GPU, which more processes per node than GPUs gives.
        dist.init_process_group(process_group_backend(node_devices, local_world), init_method="env://",
                                timeout=timedelta(seconds=spec.options.timeout))
    try:
        lead = rank == 0
        decide = _decided_here(controller) if lead and controller is not None else None
        report = run_rank(rank, world, spec, source, listeners=listeners if lead else [], decide=decide,
                          keep_state=True)
    finally:
        if owns_group:
            dist.destroy_process_group()
    restore_state(model, report.state)
    report.state = None  # it is in the model now
    return report


def _decided_here(controller):
    """Early stopping's epoch decision made in this process, on its replica (rank 0)."""
    def decide(replica):
        return controller.end_of_epoch(replica, replica.epoch_count - 1)
    return decide
