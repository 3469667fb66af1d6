"""Under torchrun: this process is one rank of the job.

torchrun (or any launcher that sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``, as a
Spark task may) starts one process per rank, on any number of machines; each calls
``ParallelWrapper.fit``, which runs the rank program here instead of spawning workers.
There is no coordinator: rank 0 runs the fit's listeners and early stopping's decisions,
and every rank's model ends holding the trained state. Nothing is pickled.

A rank that gets Ctrl-C or SIGTERM (sent to it alone, by torchrun's agent, by a scheduler)
asks every rank to stop: all stop after the same round (the vote in ``worker.py``), rank
0's listeners keep the checkpoint before any rank leaves, and ``fit`` raises
TrainingInterrupted naming the rank. A rank that keeps the others waiting at a collective
for longer than ``timeout`` is named by the watchdogs (``watchdog.py``), which meet in the
rendezvous store: every rank prints the line and exits.
"""

from __future__ import annotations

import itertools
import os
from datetime import timedelta

import torch.distributed as dist

from dl4py.nn.serialization import model_bytes, restore_state
from dl4py.parallel.phase import PHASE
from dl4py.parallel.preflight import check_plan_transport, process_group_backend
from dl4py.parallel.rank import RankReport, run_rank
from dl4py.parallel.sources import StrideSource
from dl4py.parallel.watchdog import StoreBoard, Watchdog, backstop
from dl4py.parallel.worker import WorkerSpec
from dl4py.train.interrupt import DeferredInterrupt

_FITS = itertools.count()  # this process's fits, the same on every rank: each has its own watchdog keys


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
    check_plan_transport(spec.options.parallelism, local_world, node_devices)  # every rank refuses alike
    spec.devices = [node_devices[local_rank % len(node_devices)]] * world  # this process's device, whatever its rank
    spec.model_file = model_bytes(model)
    source = spec.source or StrideSource(iterator)
    timeout = spec.options.timeout
    owns_group = not dist.is_initialized()
    board = StoreBoard(_store_connection(owns_group, timeout), world)
    PHASE.start_fit()  # joining the process group is this fit's setup, whatever an earlier fit left
    watchdog = Watchdog(rank, board, timeout, judge=True).start()  # from before the group forms
    try:
        if owns_group:
            # NCCL refuses two ranks on one GPU, which more processes per node than GPUs gives.
            # torch's own timeout only backs the watchdog up: it would not say which rank is missing.
            dist.init_process_group(process_group_backend(node_devices, local_world), init_method="env://",
                                    timeout=backstop(timeout))
        lead = rank == 0
        decide = _decided_here(controller) if lead and controller is not None else None
        with DeferredInterrupt(escalate=False) as signals:  # torchrun's agent kills a rank that must stop at once
            def should_stop():  # the signal this rank got, named
                return signals.requested and (signals.cause or True)

            report = run_rank(rank, world, spec, source, should_stop=should_stop, listeners=listeners if lead else [],
                              decide=decide, keep_state=True)
        if report.interrupted:
            dist.barrier()  # rank 0 has written the checkpoint before any rank ends (torchrun then stops the rest)
    finally:
        watchdog.stop()
        if owns_group:
            dist.destroy_process_group()
    restore_state(model, report.state)
    report.state = None  # it is in the model now
    return report


def _store_connection(owns_group: bool, timeout: float):
    """How the watchdog reaches the rendezvous store, in its own thread, under keys of this
    fit's own (a later fit, a restarted job): a connection of its own to torchrun's store,
    since the process group's is held by each blocking wait while the group forms."""
    prefix = f"dl4py-watchdog/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{next(_FITS)}"
    if not owns_group:  # the program made the group, whatever its init method: the group's store
        store = dist.distributed_c10d._get_default_store()
        return lambda: dist.PrefixStore(prefix, store)

    def connect():
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        return dist.PrefixStore(prefix, dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout)))
    return connect


def _decided_here(controller):
    """Early stopping's epoch decision made in this process, on its replica (rank 0)."""
    def decide(replica):
        return controller.end_of_epoch(replica, replica.epoch_count - 1)
    return decide
