"""What the ParallelWrapper checks and prepares before any worker starts: the worker count
against the data and the machine, where the workers read their batches, what must travel
to them by pickle, and the process group's transport."""

from __future__ import annotations

import io
import pickle

import torch

from dl4py.data import ArrayDataSetIterator
from dl4py.errors import ConfigError
from dl4py.parallel.sources import ShardedSource, StreamShardSource, batches_per_epoch, is_shardable
from dl4py.parallel.threads import usable_cores

# More CPU workers than this many per core only thrash: each needs its own process, model
# replica and memory, and they take turns on the cores.
CPU_WORKERS_PER_CORE = 4


def private_copy(model) -> bytes:
    """A TorchModel for spawned workers: bytes holding a copy of every tensor, read onto
    the CPU there. Handed over as it is, spawn's pickler would share the parent's tensors
    (shared memory on a CPU, CUDA IPC on a GPU), and the workers on the parent's device
    would all train the parent's own parameters."""
    buffer = io.BytesIO()
    try:
        torch.save(model, buffer)
    except Exception as exc:
        raise ConfigError("model", f"must be picklable to reach the worker processes: {exc} (define the "
                                   "module, loss and optimizer factory at module level, not as lambdas or "
                                   "local functions; or launch the script with torchrun, where nothing is "
                                   "pickled)") from None
    return buffer.getvalue()


def check_picklable(spec) -> None:
    """Spawned workers receive the spec by pickle; say what cannot travel before starting any.
    (Listeners stay in this process, which runs them.)"""
    for name, value in (("iterator", spec.source), ("iteration_conditions", spec.iteration_conditions)):
        try:
            pickle.dumps(value)
        except Exception as exc:
            raise ConfigError(name, f"must be picklable to reach the worker processes: {exc}") from None


def own_source(iterator):
    """Where workers read their batches themselves (None: the coordinator deals them)."""

    if isinstance(iterator, ArrayDataSetIterator):
        return ShardedSource(iterator)
    if is_shardable(iterator):
        return StreamShardSource(iterator)
    return None


def check_world(world: int, devices: list[str], iterator) -> None:
    """Refuse a worker count that cannot work before anything is started, naming the limit."""
    if is_shardable(iterator):
        pieces = len(iterator.pieces())
        if world > pieces:
            raise ConfigError("workers", f"is {world} but the streamed data has {pieces} pieces (files or Parquet "
                                         f"row groups) to share out; each worker reads whole pieces: use at most "
                                         f"{pieces} workers, or split the data into more files")
    check_batches_for_world(world, iterator)
    cpu_workers = sum(1 for rank in range(world) if devices[rank % len(devices)] == "cpu")
    cores = usable_cores()  # the cores this process may run on (taskset, a container), not the machine's
    if cpu_workers > CPU_WORKERS_PER_CORE * cores:
        raise ConfigError("workers", f"is {world}, which puts {cpu_workers} workers on the {cores} CPU cores this "
                                     f"process may use; use at most {CPU_WORKERS_PER_CORE * cores} "
                                     f"({CPU_WORKERS_PER_CORE} per core)")


def check_batches_for_world(world: int, iterator) -> None:
    """Every worker needs a batch in the first round: refuse more workers than an epoch has
    batches (a streamed source's pieces are counted where it is shared out)."""
    if is_shardable(iterator):
        return
    batches = batches_per_epoch(iterator)
    if batches and world > batches:
        raise ConfigError("workers", f"is {world} but an epoch has only {batches} batches: every worker needs a "
                                     f"batch in the first round; use at most {batches} workers or a smaller batch size")


def check_plan_transport(plan, world: int, devices: list[str]) -> None:
    """Refuse a sharded, tensor or hybrid plan whose ranks would share a GPU, before any starts.

    Those plans all-gather and reduce-scatter the model's CUDA tensors. NCCL does that, with a
    GPU for each rank; ranks sharing a GPU are joined by gloo, which has no CUDA all-gather:
    torch's DTensor then kills the worker with SIGSEGV at its first batch (seen on an H200).
    Averaging and shared gradients only all-reduce, which gloo does on CUDA tensors."""
    if plan.kind == "data":
        return
    gpus = [devices[rank % len(devices)] for rank in range(world)]
    if not any(d.startswith("cuda") for d in gpus) or process_group_backend(devices, world) == "nccl":
        return
    distinct = sorted({d for d in gpus if d.startswith("cuda")})
    raise ConfigError("workers", f"is {world} on {len(distinct)} GPU(s) ({', '.join(distinct)}): the {plan.kind} plan "
                                 f"needs a GPU of its own for each rank (NCCL; the gloo transport of ranks that share "
                                 f"a GPU cannot all-gather CUDA tensors); use one worker per GPU, or parallelism "
                                 f"data, whose workers may share a GPU")


def process_group_backend(devices: list[str], world: int) -> str:
    """NCCL needs one process per GPU; CPU workers, or several workers sharing a GPU (the
    seed recommends workers >= GPUs), communicate through gloo."""
    gpus = [devices[r % len(devices)] for r in range(world)]
    if all(d.startswith("cuda") for d in gpus) and len(set(gpus)) == world:
        return "nccl"
    return "gloo"
