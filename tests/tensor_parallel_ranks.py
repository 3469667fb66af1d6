"""The rank programs of ``test_tensor_parallel.py``: what each of the 2 (1-D mesh) or 4 (2-D
mesh) ranks trains, directly on converted replicas and through the rank program (``run_rank``),
on the CPU (gloo) or on a GPU each (NCCL: ranks sharing a GPU are refused).
Rank 0 writes what the ranks ended with; the tests compare it with single-process runs.
"""

from __future__ import annotations

import io

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from dl4py import (
    Adam,
    ArrayDataSetIterator,
    ConvolutionLayer,
    DenseLayer,
    InputType,
    MultiLayerNetwork,
    NetworkConfig,
    OutputLayer,
    Sgd,
    SubsamplingLayer,
)
from dl4py.nn.serialization import model_bytes
from dl4py.parallel.distributed_state import full_state, load_full_state, optimizer_state_by_name, plain_twin
from dl4py.config.parallel import ParallelOptions, ParallelPlan
from dl4py.parallel.preflight import own_source
from dl4py.parallel.rank import run_rank
from dl4py.parallel.tensor_parallel import apply_tensor_parallel
from dl4py.parallel.worker import WorkerSpec

from devices import backend_for  # noqa: E402
from ranks import join_group  # noqa: E402
from toy import toy  # noqa: E402

WORLD, STEPS, BATCH = 2, 5, 32
PLAIN = 2  # steps each rank trains as a single process before its model is converted
UPDATERS = {"sgd": lambda: Sgd(learning_rate=0.1), "adam": lambda: Adam(learning_rate=0.01)}
# "hybrid-uneven": the ranks' shares of a batch differ, and in one round one rank has none.
CASES = [(mode, updater) for mode in ("tensor", "hybrid") for updater in UPDATERS] + [("hybrid-uneven", "sgd")]
SPLITS = [0, 20, 32]  # hybrid-uneven: rank 0's rows of each converted batch, rank 1 the rest
# The 2-D mesh: 2 data groups of 2 tensor ranks; rank r in data group r // 2.
WORLD_2D, TENSOR_2D = 4, 2
CASES_2D = [(mode, updater) for mode in ("tensor", "hybrid") for updater in UPDATERS]
FIT_EXAMPLES, FIT_BATCH = 70, 8  # the rank program's epoch: 9 batches, the last of 6
# Tensor mode's 5 rounds (2 data groups) in windows of 3 rounds and 2: in the second, group 0
# has 14 rows (8 + 6) and group 1 has 8, so the mean of the groups' means is not the mean
# over the rows, and a wrong weighting shows.
ACCUMULATE = 3


def mlp(updater: str) -> NetworkConfig:
    """Two hidden layers that pair (63 units: split 32 + 31), one left over, the output."""
    return NetworkConfig(seed=7, updater=UPDATERS[updater](), input_type=InputType.feed_forward(784), layers=[
        DenseLayer(n_out=63, activation="relu"), DenseLayer(n_out=64, activation="tanh"),
        DenseLayer(n_out=32, activation="relu"), OutputLayer(n_out=10)])


def lenet(updater: str) -> NetworkConfig:
    """Convolution and subsampling (data-parallel), a large dense pair, the output."""
    return NetworkConfig(seed=7, updater=UPDATERS[updater](), input_type=InputType.convolutional_flat(28, 28, 1),
                         layers=[ConvolutionLayer(n_out=4, kernel_size=(5, 5), activation="relu"),
                                 SubsamplingLayer(kernel_size=(2, 2), stride=(2, 2)),
                                 DenseLayer(n_out=96, activation="relu"), DenseLayer(n_out=31, activation="tanh"),
                                 OutputLayer(n_out=10)])


def config_for(mode: str, updater: str) -> NetworkConfig:
    return mlp(updater) if mode == "tensor" else lenet(updater)


def rank_batches(mode: str, rank: int, batches):
    """Tensor mode: every rank the whole batch; hybrid: rank i the i-th half of it (uneven:
    split at SPLITS, an empty share where a rank has no rows: every rank steps every round)."""
    if mode == "tensor":
        return batches
    if mode == "hybrid-uneven":
        return [(x[:n], y[:n]) if rank == 0 else (x[n:], y[n:]) for (x, y), n in zip(batches, SPLITS)]
    return [(x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]) for x, y in batches]


def train(model, batches) -> None:
    device = model.backend.device
    for x, y in batches:
        model.train_step(model.prepare_input(x.to(device)), y.to(device))


def rank_1d(rank: int, rendezvous: str, out: str, batches, device: str) -> None:
    """Every distributed case on this rank; rank 0 writes the results to ``out``."""
    join_group(rank, WORLD, rendezvous, device)
    backend = backend_for(device)
    try:
        mesh = init_device_mesh(device, (WORLD,))
        results = {}
        for mode, updater in CASES:
            replica = MultiLayerNetwork(config_for(mode, updater), backend=backend).init()
            train(replica, batches[:PLAIN])  # converted with updater state to carry over
            plan = apply_tensor_parallel(replica, mesh, hybrid=mode != "tensor")
            replica.share_gradients(plan.gradient_hook)
            train(replica, rank_batches(mode, rank, batches[PLAIN:]))
            results[(mode, updater)] = full_state(replica)
            if updater == "adam":
                results[("file", mode)] = model_bytes(plain_twin(replica))
        # A single-process model's state, distributed over the ranks and gathered again.
        plain = MultiLayerNetwork(mlp("adam"), backend=backend).init()
        train(plain, batches[:2])
        names = {id(p): name for name, p in plain.module.named_parameters()}
        replica = MultiLayerNetwork(mlp("adam").replace(seed=8), backend=backend).init()
        apply_tensor_parallel(replica, mesh)
        load_full_state(replica, dict(plain.module.state_dict()), optimizer_state_by_name(plain.optimizer, names))
        results["round trip"] = (dict(plain.module.state_dict()), optimizer_state_by_name(plain.optimizer, names),
                                 full_state(replica))
        if rank == 0:
            write_results(results, out)
    finally:
        dist.destroy_process_group()


def write_results(results: dict, out: str) -> None:
    """Rank 0's results, for the tests in the parent process."""
    buffer = io.BytesIO()
    torch.save(results, buffer)
    with open(out, "wb") as f:
        f.write(buffer.getvalue())


def rank_batches_2d(mode: str, rank: int, batches):
    """Tensor mode: data group g (ranks 2g, 2g + 1) half g of every batch; hybrid: rank i
    quarter i (its tensor group gathers half of the batch)."""
    if mode == "tensor":
        return [(x.chunk(2)[rank // TENSOR_2D], y.chunk(2)[rank // TENSOR_2D]) for x, y in batches]
    return [(x.chunk(WORLD_2D)[rank], y.chunk(WORLD_2D)[rank]) for x, y in batches]


def toy_network() -> NetworkConfig:
    """A dense pair (17 units: split 9 + 8) and the output, for the rank program's fits."""
    return NetworkConfig(seed=7, updater=Sgd(learning_rate=0.1), input_type=InputType.feed_forward(5), layers=[
        DenseLayer(n_out=16, activation="tanh"), DenseLayer(n_out=17, activation="relu"), OutputLayer(n_out=3)])


def fit_2d(rank: int, mode: str, device: str, accumulate: int = 1) -> bytes:
    """One epoch of the rank program on the 2-D mesh: tensor mode deals the 9 batches to the 2
    data groups (the last round: group 1 has none), the hybrid to the 4 ranks (the last round:
    rank 0 alone, group 1 without rows). Returns the model file every rank receives."""
    data = ArrayDataSetIterator(*toy(FIT_EXAMPLES, seed=3), batch_size=FIT_BATCH, shuffle=False)
    options = ParallelOptions(workers=WORLD_2D, parallelism=ParallelPlan(mode, tensor_size=TENSOR_2D)).validate()
    spec = WorkerSpec(model_file=model_bytes(MultiLayerNetwork(toy_network(), backend="cpu").init()),
                      torch_model=None, source=own_source(data), num_batches=len(data), epochs=1, options=options,
                      devices=["cpu"] if device == "cpu" else [f"cuda:{r}" for r in range(WORLD_2D)],
                      precision="float", threads=1,
                      accumulate_batches=accumulate)
    return run_rank(rank, WORLD_2D, spec, spec.source, keep_state=True).state


def rank_2d(rank: int, rendezvous: str, out: str, batches, device: str) -> None:
    """Every 2-D case on this rank of 4; rank 0 writes the results to ``out``."""
    join_group(rank, WORLD_2D, rendezvous, device)
    backend = backend_for(device)
    try:
        mesh = init_device_mesh(device, (WORLD_2D // TENSOR_2D, TENSOR_2D), mesh_dim_names=("data", "tensor"))
        results = {}
        for mode, updater in CASES_2D:
            replica = MultiLayerNetwork(config_for(mode, updater), backend=backend).init()
            train(replica, batches[:PLAIN])
            plan = apply_tensor_parallel(replica, mesh, hybrid=mode == "hybrid")
            replica.share_gradients(plan.gradient_hook)
            train(replica, rank_batches_2d(mode, rank, batches[PLAIN:]))
            results[(mode, updater)] = full_state(replica)
            if updater == "adam":
                results[("file", mode)] = model_bytes(plain_twin(replica))
        # A hybrid step in which tensor group 0 (ranks 0 and 1) has no rows at all.
        replica = MultiLayerNetwork(config_for("hybrid", "sgd"), backend=backend).init()
        replica.share_gradients(apply_tensor_parallel(replica, mesh, hybrid=True).gradient_hook)
        x, y = rank_batches_2d("hybrid", rank, batches[:1])[0]
        rows = 0 if rank < TENSOR_2D else len(y)
        on = replica.backend.device
        results["empty group's loss"] = float(replica.train_step(replica.prepare_input(x[:rows].to(on)), y[:rows].to(on)))
        for mode in ("tensor", "hybrid"):
            results[("fit", mode)] = fit_2d(rank, mode, device)
        results[("fit", "tensor", "accumulate")] = fit_2d(rank, "tensor", device, ACCUMULATE)
        if rank == 0:
            write_results(results, out)
    finally:
        dist.destroy_process_group()
