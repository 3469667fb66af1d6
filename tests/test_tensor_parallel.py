"""Tensor-parallel and hybrid (data-parallel convolutions, tensor-parallel dense layers)
training on 2 CPU ranks with gloo ends where the single-process run on the same batches
ends; a distributed model gathered whole loads in a single process bit for bit, and back.
On 4 ranks as a 2-D mesh (2 data groups x 2 tensor ranks) likewise: each step one update on
the round's batches together, directly and through the rank program (``run_rank``) over an
epoch whose last round leaves a group without data.

One start of 2 ranks runs every 1-D case, one of 4 every 2-D case (each process start costs
seconds); the ranks write what they ended with, and the tests compare it with single-process
runs here.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.multiprocessing as mp

from dl4py import (
    Adam,
    BatchNormalization,
    ConfigError,
    DropoutLayer,
    ConvolutionLayer,
    DenseLayer,
    InputType,
    MnistDataSetIterator,
    MultiLayerNetwork,
    NetworkConfig,
    OutputLayer,
    Sgd,
    SubsamplingLayer,
    load,
)
from dl4py.nn.serialization import model_bytes

from toy import toy  # noqa: E402

WORLD, STEPS, BATCH = 2, 5, 32
PLAIN = 2  # steps each rank trains as a single process before its model is converted
UPDATERS = {"sgd": lambda: Sgd(learning_rate=0.1), "adam": lambda: Adam(learning_rate=0.01)}
TOLERANCE = {"sgd": 1e-5, "adam": 1e-4}
# "hybrid-uneven": the ranks' shares of a batch differ, and in one round one rank has none.
CASES = [(mode, updater) for mode in ("tensor", "hybrid") for updater in UPDATERS] + [("hybrid-uneven", "sgd")]
SPLITS = [0, 20, 32]  # hybrid-uneven: rank 0's rows of each converted batch, rank 1 the rest
# The 2-D mesh: 2 data groups of 2 tensor ranks; rank r in data group r // 2.
WORLD_2D, TENSOR_2D = 4, 2
CASES_2D = [(mode, updater) for mode in ("tensor", "hybrid") for updater in UPDATERS]
FIT_EXAMPLES, FIT_BATCH = 70, 8  # the rank program's epoch: 9 batches, the last of 6


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
    for x, y in batches:
        model.train_step(model.prepare_input(x), y)


def _rank(rank: int, rendezvous: str, out: str, batches) -> None:
    """Every distributed case on this rank; rank 0 writes the results to ``out``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dl4py.parallel.distributed_state import full_state, load_full_state, optimizer_state_by_name, plain_twin
    from dl4py.parallel.tensor_parallel import apply_tensor_parallel

    torch.set_num_threads(1)  # two ranks share the cores
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        results = {}
        for mode, updater in CASES:
            replica = MultiLayerNetwork(config_for(mode, updater), backend="cpu").init()
            train(replica, batches[:PLAIN])  # converted with updater state to carry over
            plan = apply_tensor_parallel(replica, mesh, hybrid=mode != "tensor")
            replica.share_gradients(plan.gradient_hook)
            train(replica, rank_batches(mode, rank, batches[PLAIN:]))
            results[(mode, updater)] = full_state(replica)
            if updater == "adam":
                results[("file", mode)] = model_bytes(plain_twin(replica))
        # A single-process model's state, distributed over the ranks and gathered again.
        plain = MultiLayerNetwork(mlp("adam"), backend="cpu").init()
        train(plain, batches[:2])
        names = {id(p): name for name, p in plain.module.named_parameters()}
        replica = MultiLayerNetwork(mlp("adam").replace(seed=8), backend="cpu").init()
        apply_tensor_parallel(replica, mesh)
        load_full_state(replica, dict(plain.module.state_dict()), optimizer_state_by_name(plain.optimizer, names))
        results["round trip"] = (dict(plain.module.state_dict()), optimizer_state_by_name(plain.optimizer, names),
                                 full_state(replica))
        if rank == 0:
            _write(results, out)
    finally:
        dist.destroy_process_group()


def _write(results: dict, out: str) -> None:
    """Rank 0's results, for the tests in the parent process."""
    buffer = io.BytesIO()
    torch.save(results, buffer)
    with open(out, "wb") as f:
        f.write(buffer.getvalue())


def start_ranks(rank_program, args: tuple, ranks: int) -> None:
    """Run ``rank_program(rank, *args)`` in ``ranks`` processes and wait for them, started as
    the ParallelWrapper starts its workers (forked from a server that has imported torch and
    dl4py: a spawned process spends seconds on that, four of them sharing two cores more)."""
    from dl4py.parallel.processes import worker_context

    context, _ = worker_context()
    mp.start_processes(rank_program, args=args, nprocs=ranks, start_method=context.get_start_method())


@pytest.fixture(scope="module")
def mnist_batches():
    """The STEPS MNIST batches every case trains on."""
    from conftest import mnist_dir

    if mnist_dir() is None:
        pytest.skip("MNIST files not found: set DL4PY_DATA to a folder holding mnist/")
    data = MnistDataSetIterator(BATCH, train=True, seed=1, limit=BATCH * STEPS)
    return [(batch.features, batch.labels) for batch in data]


@pytest.fixture(scope="module")
def single(mnist_batches):
    """The single-process runs on the whole batches, by case."""
    runs, threads = {}, torch.get_num_threads()
    torch.set_num_threads(1)  # tiny networks: threads only wait on each other on a busy machine
    try:
        for case in CASES:
            model = MultiLayerNetwork(config_for(*case), backend="cpu").init()
            train(model, mnist_batches)
            runs[case] = model
    finally:
        torch.set_num_threads(threads)
    return runs


@pytest.fixture(scope="module")
def runs(mnist_batches, single, tmp_path_factory):
    """The batches, what the 2 ranks ended with, and the single-process runs."""
    folder = tmp_path_factory.mktemp("tensor_parallel")
    out = folder / "results.pt"
    start_ranks(_rank, (str(folder / "rendezvous"), str(out), mnist_batches), WORLD)
    return mnist_batches, torch.load(out, weights_only=False), single


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


def _fit_2d(rank: int, mode: str) -> bytes:
    """One epoch of the rank program on the 2-D mesh: tensor mode deals the 9 batches to the 2
    data groups (the last round: group 1 has none), the hybrid to the 4 ranks (the last round:
    rank 0 alone, group 1 without rows). Returns the model file every rank receives."""
    from dl4py import ArrayDataSetIterator
    from dl4py.parallel.options import ParallelOptions
    from dl4py.parallel.preflight import own_source
    from dl4py.parallel.rank import run_rank
    from dl4py.parallel.worker import WorkerSpec

    data = ArrayDataSetIterator(*toy(FIT_EXAMPLES, seed=3), batch_size=FIT_BATCH, shuffle=False)
    options = ParallelOptions(workers=WORLD_2D, training_mode=mode, tensor_parallel_size=TENSOR_2D).validate()
    spec = WorkerSpec(model_file=model_bytes(MultiLayerNetwork(toy_network(), backend="cpu").init()),
                      torch_model=None, source=own_source(data), num_batches=len(data), epochs=1, options=options,
                      devices=["cpu"], precision="float", threads=1)
    return run_rank(rank, WORLD_2D, spec, spec.source, keep_state=True).state


def _rank_2d(rank: int, rendezvous: str, out: str, batches) -> None:
    """Every 2-D case on this rank of 4; rank 0 writes the results to ``out``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dl4py.parallel.distributed_state import full_state, plain_twin
    from dl4py.parallel.tensor_parallel import apply_tensor_parallel

    torch.set_num_threads(1)  # four ranks share the cores
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD_2D)
    try:
        mesh = init_device_mesh("cpu", (WORLD_2D // TENSOR_2D, TENSOR_2D), mesh_dim_names=("data", "tensor"))
        results = {}
        for mode, updater in CASES_2D:
            replica = MultiLayerNetwork(config_for(mode, updater), backend="cpu").init()
            train(replica, batches[:PLAIN])
            plan = apply_tensor_parallel(replica, mesh, hybrid=mode == "hybrid")
            replica.share_gradients(plan.gradient_hook)
            train(replica, rank_batches_2d(mode, rank, batches[PLAIN:]))
            results[(mode, updater)] = full_state(replica)
            if updater == "adam":
                results[("file", mode)] = model_bytes(plain_twin(replica))
        # A hybrid step in which tensor group 0 (ranks 0 and 1) has no rows at all.
        replica = MultiLayerNetwork(config_for("hybrid", "sgd"), backend="cpu").init()
        replica.share_gradients(apply_tensor_parallel(replica, mesh, hybrid=True).gradient_hook)
        x, y = rank_batches_2d("hybrid", rank, batches[:1])[0]
        rows = 0 if rank < TENSOR_2D else len(y)
        results["empty group's loss"] = float(replica.train_step(replica.prepare_input(x[:rows]), y[:rows]))
        for mode in ("tensor", "hybrid"):
            results[("fit", mode)] = _fit_2d(rank, mode)
        if rank == 0:
            _write(results, out)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs_2d(mnist_batches, tmp_path_factory):
    """What the 4 ranks of the 2-D mesh ended with (the same batches as ``runs``)."""
    folder = tmp_path_factory.mktemp("tensor_parallel_2d")
    out = folder / "results.pt"
    start_ranks(_rank_2d, (str(folder / "rendezvous"), str(out), mnist_batches), WORLD_2D)
    return torch.load(out, weights_only=False)


def assert_the_single_process_state(gathered, reference, config, updater) -> None:
    """``gathered`` (``full_state``'s pair) holds ``reference``'s parameters to the updater's
    tolerance, every one of them trained from ``config``'s start; with Adam its moments too."""
    model_state, optimizer_state = gathered
    expected = reference.module.state_dict()
    assert sorted(model_state) == sorted(expected)
    start = MultiLayerNetwork(config, backend="cpu").init().module.state_dict()
    for name, value in expected.items():
        assert not torch.equal(value, start[name]), f"{name} did not train"  # a real comparison
        torch.testing.assert_close(model_state[name], value, rtol=0, atol=TOLERANCE[updater], msg=name)
    if updater == "adam":  # the moments, split like their parameters, gathered whole
        names = {id(p): name for name, p in reference.module.named_parameters()}
        for p, state in reference.optimizer.state.items():
            torch.testing.assert_close(optimizer_state["state"][names[id(p)]]["exp_avg_sq"], state["exp_avg_sq"],
                                       rtol=1e-3, atol=1e-8, msg=names[id(p)])


@pytest.mark.parametrize("mode,updater", CASES)
def test_ranks_end_with_the_single_process_parameters(runs, mode, updater):
    _, results, single = runs
    assert_the_single_process_state(results[(mode, updater)], single[(mode, updater)], config_for(mode, updater),
                                    updater)


@pytest.mark.parametrize("mode,updater", CASES_2D)
def test_on_a_2d_mesh_the_ranks_end_with_the_single_process_parameters(single, runs_2d, mode, updater):
    """Tensor mode: each data group trains half of every batch; hybrid: each rank a quarter,
    gathered within its tensor group. Averaged over the data groups, each step is the single
    process's on the whole batch."""
    assert_the_single_process_state(runs_2d[(mode, updater)], single[(mode, updater)], config_for(mode, updater),
                                    updater)


@pytest.mark.parametrize("mode,per_round", [("tensor", 2), ("hybrid", 4)])
def test_the_rank_program_on_a_2d_mesh_steps_once_per_round_on_its_batches(runs_2d, mode, per_round, tmp_path):
    """Tensor mode: a round is one batch per data group (2), the hybrid one per rank (4); the
    single process steps once per round on the round's batches together. The last round (one
    batch of 6) leaves a group without data: it counts for nothing, not for a zero or a NaN."""
    (tmp_path / "model.dl4py").write_bytes(runs_2d[("fit", mode)])
    trained = load(tmp_path / "model.dl4py")
    assert (trained.epoch_count, trained.iteration_count) == (1, 9)  # batches of the data, not counted per rank
    reference = MultiLayerNetwork(toy_network(), backend="cpu").init()
    x, y = toy(FIT_EXAMPLES, seed=3)
    rows = FIT_BATCH * per_round
    for start in range(0, FIT_EXAMPLES, rows):
        reference.train_step(reference.prepare_input(x[start:start + rows]), y[start:start + rows])
    assert_the_single_process_state((trained.module.state_dict(), None), reference, toy_network(), "sgd")


def test_a_tensor_group_without_rows_has_a_loss_of_zero(runs_2d):
    """Not the NaN of a mean over no rows (its gradients count for nothing: the rank program's
    test above)."""
    assert runs_2d["empty group's loss"] == 0.0


@pytest.mark.parametrize("mesh,mode", [(mesh, mode) for mesh in ("1-D", "2-D") for mode in ("tensor", "hybrid")])
def test_a_distributed_model_file_loads_in_one_process_bit_exactly(request, mesh, mode, tmp_path):
    results = request.getfixturevalue("runs")[1] if mesh == "1-D" else request.getfixturevalue("runs_2d")
    model_state, optimizer_state = results[(mode, "adam")]
    (tmp_path / "model.dl4py").write_bytes(results[("file", mode)])  # plain_twin's, as model_bytes writes it
    loaded = load(tmp_path / "model.dl4py")
    for name, value in loaded.module.state_dict().items():
        assert torch.equal(value, model_state[name]), name
    names = {id(p): name for name, p in loaded.module.named_parameters()}
    for p, state in loaded.optimizer.state.items():
        for key, value in state.items():
            assert torch.equal(value, optimizer_state["state"][names[id(p)]][key]), (names[id(p)], key)
    assert loaded.update_count == STEPS and loaded.optimizer.param_groups[0]["lr"] == 0.01


def test_a_single_process_state_distributed_and_gathered_again_is_bit_identical(runs):
    _, results, _ = runs
    model_state, optimizer_state, (gathered_model, gathered_optimizer) = results["round trip"]
    assert sorted(gathered_model) == sorted(model_state)
    for name, value in model_state.items():
        assert torch.equal(gathered_model[name], value), name
    assert sorted(gathered_optimizer["state"]) == sorted(optimizer_state["state"])
    for name, state in optimizer_state["state"].items():
        for key, value in state.items():
            gathered = gathered_optimizer["state"][name][key]
            assert torch.equal(torch.as_tensor(gathered), torch.as_tensor(value)), (name, key)


def test_the_plan_pairs_consecutive_hidden_dense_layers():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from dl4py.parallel.tensor_parallel import gather_point, tensor_parallel_plan

    def kinds(config):
        plan = tensor_parallel_plan(MultiLayerNetwork(config, backend="cpu").init().module)
        return {name: type(style) for name, style in plan.items()}

    assert kinds(mlp("sgd")) == {"0.op": ColwiseParallel, "1.op": RowwiseParallel}  # 2: left over; 3: output
    assert kinds(lenet("sgd")) == {"2.op": ColwiseParallel, "3.op": RowwiseParallel}
    four = mlp("sgd").replace(layers=[DenseLayer(n_out=8)] * 4 + [OutputLayer(n_out=10)])
    assert kinds(four) == {"0.op": ColwiseParallel, "1.op": RowwiseParallel, "2.op": ColwiseParallel,
                           "3.op": RowwiseParallel}
    assert gather_point(MultiLayerNetwork(lenet("sgd"), backend="cpu").init().module) == 2


@pytest.mark.parametrize("where,layer,message", [
    (1, BatchNormalization(), "normalize each rank's rows apart"),
    (3, DropoutLayer(rate=0.5), "different mask on each rank"),
])
def test_the_hybrid_refuses_layers_that_would_differ_from_one_process(where, layer, message):
    from dl4py.parallel.tensor_parallel import gather_point

    config = lenet("sgd")
    config = config.replace(layers=[*config.layers[:where], layer, *config.layers[where:]])
    with pytest.raises(ConfigError, match=rf"network.layers\[{where}\]: .*{message}"):
        gather_point(MultiLayerNetwork(config, backend="cpu").init().module)
