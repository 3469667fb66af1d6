"""The program of one rank, whoever launched it: ``run_rank``.

Every launcher ends here: a worker of the ParallelWrapper's pool (``pool_worker.py``), a
process torchrun started (``launched.py``), and whatever runs ``ParallelWrapper.fit``
under torchrun's variables (a Spark task). The launcher has set up the process group and
says where the batches come from, who sees the events and who decides on early stopping;
the rank builds its replica from the fit's model, trains it epoch by epoch
(``train.epoch.run_epoch``, meeting the other ranks round by round: ``round_meeting.py``)
and reports, as a ``RankReport``. A distributed mode's replica (sharded, tensor, hybrid) is
built directly by its plan in torchtitan's order: module, conversion, optimizer, then rank
0's whole state loaded by name; rank 0 keeps a plain twin on the host besides.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from dl4py.backend.cuda_environment import Environment
from dl4py.config.parallel import DISTRIBUTED_MODES
from dl4py.nn.serialization import model_bytes, restore_meta
from dl4py.parallel import collectives
from dl4py.parallel.averaging import broadcast, replica_state, share_gradients, stepped_parameters
from dl4py.parallel.distributed_state import state_by_name
from dl4py.parallel.phase import PHASE
from dl4py.parallel.preflight import private_copy
from dl4py.parallel.round_meeting import RoundMeeting
from dl4py.parallel.sharding import shard_replica
from dl4py.parallel.tensor_parallel import apply_tensor_parallel
from dl4py.parallel.tensor_replica import TensorParallelReplica
from dl4py.parallel.worker import WorkerSpec, build_replica, replica_to_build, worker_device
from dl4py.train.epoch import EpochSummary, run_epoch
from dl4py.train.listeners import Listeners


@dataclass
class RankReport:
    """What one rank tells its launcher at the end of a fit."""

    summaries: list[EpochSummary] = field(default_factory=list)  # the epochs trained, all workers counted
    stop: tuple[str, str] | None = None  # early stopping's (condition kind, reason) when one fired
    interrupted: bool = False  # a stop was asked for (Ctrl-C, SIGTERM): all stopped after the same round
    signalled: tuple[str, list[int]] | None = None  # with interrupted: the signal and the ranks that got it
    records: list = field(default_factory=list)  # with record_examples: feature 0 of every example trained
    state: bytes | None = None  # the trained replica as a model file, when the launcher asked for it
    threads: int = 0  # the intra-op threads this rank trained with (torch.get_num_threads() there)

    def stop_cause(self, noun: str = "rank") -> str | None:
        """``SIGTERM at rank 1``: who got the signal that stopped the fit; None when no rank
        got one itself (the launcher asked: a pool's coordinator)."""
        if self.signalled is None:
            return None
        cause, ranks = self.signalled
        if len(ranks) == 1:
            return f"{cause} at {noun} {ranks[0]}"
        shown = ", ".join(map(str, ranks[:4])) + (", ..." if len(ranks) > 4 else "")
        return f"{cause} at {len(ranks)} {noun}s ({shown})"


def run_rank(rank: int, world: int, spec: WorkerSpec, source, *, should_stop=None, listeners=(), decide=None,
             keep_state: bool = False) -> RankReport:
    """Train this rank's replica for ``spec.epochs`` epochs on ``source``'s batches, or until
    ``should_stop()`` says so on any rank (give it on all or none): it answers with a false
    value, True (the launcher asks) or the name of a signal this process got ("SIGTERM").

    ``listeners`` see this replica's events (rank 0's: the fit's listeners under torchrun,
    the relay to the coordinator in a pool); with ``spec.early_stopping``, rank 0's
    ``decide(replica)`` says after each epoch why all should stop, or None. With
    ``keep_state`` the report carries the trained replica (``RankReport.state``)."""
    PHASE.start_fit()
    device = worker_device(spec, rank)
    replica, layout = _replica_for(rank, spec, device)
    if layout is not None:  # listeners are shown rank 0's plain twin
        listeners = [TwinListener(listener, layout) for listener in listeners]
    listeners = Listeners(listeners)
    listeners.on_fit_start(replica)
    report = RankReport(threads=torch.get_num_threads())  # as _replica_for set them
    meeting = RoundMeeting(rank, world, spec, source, device, report, should_stop)
    for condition in spec.iteration_conditions:
        condition.initialize()  # MaxTime counts from here, in this process
    try:
        for _ in range(spec.epochs):
            summary = run_epoch(replica, meeting, listeners, spec.training_accuracy)
            report.summaries.append(summary)
            if report.stop is not None or not summary.completed:
                break  # an iteration condition fired, or a stop was asked for: all stopped in the same round
            PHASE.enter("end of epoch")  # rank 0's listeners (a checkpoint, validation) keep the others waiting
            judged = replica if layout is None else layout.gather()  # every rank takes part; rank 0's twin holds it
            listeners.on_epoch_end(replica, summary)
            # Asked even after a stop voted in the epoch's last round: the relay has sent the
            # epoch's end, and the coordinator's answer must not be left for the next fit.
            if spec.early_stopping and _epoch_decision(judged, decide, rank, device, report):
                break
            if report.interrupted:
                break  # asked in the epoch's last round: the epoch is complete
        if layout is not None:
            layout.gather()  # every rank, as all leave the loop together: rank 0's twin takes the final state
    finally:
        PHASE.enter("end of fit")  # an interrupted fit's checkpoint is written now (rank 0's listeners)
        # Under torchrun the replica is the program's own model: its later fits are its own.
        replica.share_gradients(None)
        # A pool's worker 0 has the relay as listener: an interrupted fit ends in the
        # coordinator, which restores this replica's state and runs on_fit_end(model, True).
        listeners.on_fit_end(replica, report.interrupted)
    if spec.record_examples:
        report.records = torch.cat(report.records).tolist() if report.records else []
    if keep_state or layout is not None:
        report.state = _trained_state(replica, layout, rank, keep_state, device)
    return report


def _replica_for(rank: int, spec: WorkerSpec, device):
    """This rank's replica, on ``device``, at worker 0's state, as the plan lays it
    out: ``(replica, layout)``, the layout None for the data-parallel modes."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif spec.threads:
        torch.set_num_threads(spec.threads)  # the user's budget shared out (threads.py), or threads_per_worker
    if spec.environment is not None:  # installed as this process's environment
        Environment.from_dict(spec.environment).apply(device)
    if spec.options.parallelism.mode in DISTRIBUTED_MODES:
        layout = _distributed_replica(rank, spec, device)
        return layout.replica, layout
    replica = build_replica(spec, device)
    _ready_to_train(replica, spec)
    # All replicas start from worker 0's state, whatever each process built.
    broadcast(replica_state(replica, include_updater=True), src=0)
    replica.precision_state.after_sync()
    if spec.options.parallelism.mode == "shared_gradients":
        params = stepped_parameters(replica)

        def share(took_part):
            share_gradients(params, took_part)

        replica.share_gradients(share)  # every step averages the gradients before its update
    return replica, None


def _trained_state(replica, layout, rank: int, keep_state: bool, device) -> bytes | None:
    """The trained model's file for the report (``keep_state``). With a layout, rank 0's twin
    holds the state: under torchrun every rank's model takes it (rank 0's file, sent to all);
    in a pool only worker 0 keeps it. Asked of all ranks (a collective), so all agree."""
    if layout is None:
        return model_bytes(replica)
    others_keep = torch.tensor([1.0 if keep_state and rank != 0 else 0.0], device=device)
    dist.all_reduce(others_keep, op=dist.ReduceOp.MAX)
    state = [model_bytes(layout.twin) if rank == 0 and keep_state else None]
    if others_keep.item() > 0:
        dist.broadcast_object_list(state, src=0)
    return state[0] if keep_state else None


def _ready_to_train(replica, spec: WorkerSpec) -> None:
    replica.set_accumulate_batches(spec.accumulate_batches)  # a model file does not carry it
    replica.module.train()


def _distributed_replica(rank: int, spec: WorkerSpec, device):
    """This rank's part of a replica the plan distributes over all ranks (returns its
    layout), built in torchtitan's order by the mode's plan: the module, its conversion, the
    optimizer over the result, then rank 0's whole state loaded by name (all ranks start from
    it, as the data-parallel modes' broadcast makes them). Rank 0 keeps a plain copy on the
    host, its twin, which each gather fills: the whole model and its updater state, which the
    device must not hold beside its shards (saved, scored and shown to the listeners)."""
    from torch.distributed.device_mesh import init_device_mesh  # lazy: only distributed plans load it

    torch_model = spec.torch_model
    if torch_model is not None and not isinstance(torch_model, bytes):
        torch_model = private_copy(torch_model)  # under torchrun: never convert the program's own model
    private = replace(spec, torch_model=torch_model)
    twin = build_replica(private, torch.device("cpu")) if rank == 0 else None
    state = _state_of_rank_0(twin)
    replica, saved = replica_to_build(private, device)
    # Tensor and hybrid with a tensor_size: data groups x tensor groups.
    shape = spec.options.mesh_shape(dist.get_world_size())
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=("data", "tensor") if len(shape) == 2 else None)
    mode = spec.options.parallelism.mode
    if mode == "sharded":
        layout = shard_replica(replica, mesh, twin=twin, state=state)
    else:
        plan = apply_tensor_parallel(replica, mesh, hybrid=mode == "hybrid", state=state)
        replica.share_gradients(plan.gradient_hook)
        layout = TensorParallelReplica(replica, plan, twin)
        replica.lay_out(layout)
    restore_meta(replica, saved)  # the rest of its own file: counters, normalizer, loss scale, score
    _ready_to_train(replica, spec)
    return layout


def _state_of_rank_0(twin) -> tuple:
    """Rank 0's whole state by name (its twin's: the fit's model as of its start), on every
    rank; a copy, which shares no tensor with the twin."""
    state = [copy.deepcopy(state_by_name(twin)) if twin is not None else None]
    dist.broadcast_object_list(state, src=0)
    return state[0]


class TwinListener:
    """A listener of a sharded, tensor-parallel or hybrid fit: it is shown the plain twin
    (rank 0's), its counters and score those of the distributed replica, its parameters as
    of the last gather (each epoch's end)."""

    def __init__(self, listener, layout):
        self.listener, self.layout = listener, layout

    def _twin(self):
        if self.layout.twin is None:  # a rank without the twin: its own (distributed) replica
            return self.layout.replica
        self.layout.twin.training_state.copy_from(self.layout.replica.training_state)
        return self.layout.twin

    def on_fit_start(self, model):
        self.listener.on_fit_start(self._twin())

    def on_epoch_start(self, model, epoch):
        self.listener.on_epoch_start(self._twin(), epoch)

    def iteration_done(self, model, iteration, epoch, loss, batch_size):
        self.listener.iteration_done(self._twin(), iteration, epoch, loss, batch_size)

    def on_epoch_end(self, model, summary):
        self.listener.on_epoch_end(self._twin(), summary)

    def on_fit_end(self, model, interrupted):
        self.listener.on_fit_end(self._twin(), interrupted)

    def __getattr__(self, name):  # what else the fit asks of the listener (the relay's decision)
        return getattr(self.listener, name)


def _epoch_decision(replica, decide, rank, device, report: RankReport) -> bool:
    """Rank 0 has the (averaged) replica scored and the epoch conditions asked; all follow it."""
    reason = decide(replica) if rank == 0 else None
    flag = torch.tensor([1.0 if reason is not None else 0.0], device=device)
    collectives.broadcast(flag, src=0)
    if flag.item() > 0:
        report.stop = ("EpochTerminationCondition", reason)
        return True
    return False
