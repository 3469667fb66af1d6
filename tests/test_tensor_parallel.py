"""Tensor-parallel and hybrid (data-parallel convolutions, tensor-parallel dense layers)
training on 2 CPU ranks with gloo ends where the single-process run on the same batches
ends; a distributed model gathered whole loads in a single process bit for bit, and back.

One spawn of 2 ranks runs every distributed case (each process start costs seconds); the
ranks write what they ended with, and the tests compare it with single-process runs here.
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

WORLD, STEPS, BATCH = 2, 5, 32
PLAIN = 2  # steps each rank trains as a single process before its model is converted
UPDATERS = {"sgd": lambda: Sgd(learning_rate=0.1), "adam": lambda: Adam(learning_rate=0.01)}
TOLERANCE = {"sgd": 1e-5, "adam": 1e-4}
# "hybrid-uneven": the ranks' shares of a batch differ, and in one round one rank has none.
CASES = [(mode, updater) for mode in ("tensor", "hybrid") for updater in UPDATERS] + [("hybrid-uneven", "sgd")]
SPLITS = [0, 20, 32]  # hybrid-uneven: rank 0's rows of each converted batch, rank 1 the rest


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
            buffer = io.BytesIO()
            torch.save(results, buffer)
            with open(out, "wb") as f:
                f.write(buffer.getvalue())
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The STEPS MNIST batches, what the 2 ranks ended with, and the single-process runs."""
    from conftest import mnist_dir

    if mnist_dir() is None:
        pytest.skip("MNIST files not found: set DL4PY_DATA to a folder holding mnist/")
    data = MnistDataSetIterator(BATCH, train=True, seed=1, limit=BATCH * STEPS)
    batches = [(batch.features, batch.labels) for batch in data]
    folder = tmp_path_factory.mktemp("tensor_parallel")
    out = folder / "results.pt"
    mp.spawn(_rank, args=(str(folder / "rendezvous"), str(out), batches), nprocs=WORLD)
    results = torch.load(out, weights_only=False)
    single, threads = {}, torch.get_num_threads()
    torch.set_num_threads(1)  # tiny networks: threads only wait on each other on a busy machine
    try:
        for case in CASES:
            model = MultiLayerNetwork(config_for(*case), backend="cpu").init()
            train(model, batches)
            single[case] = model
    finally:
        torch.set_num_threads(threads)
    return batches, results, single


@pytest.mark.parametrize("mode,updater", CASES)
def test_ranks_end_with_the_single_process_parameters(runs, mode, updater):
    _, results, single = runs
    model_state, optimizer_state = results[(mode, updater)]
    expected = single[(mode, updater)].module.state_dict()
    assert sorted(model_state) == sorted(expected)
    start = MultiLayerNetwork(config_for(mode, updater), backend="cpu").init().module.state_dict()
    for name, value in expected.items():
        assert not torch.equal(value, start[name]), f"{name} did not train"  # a real comparison
        torch.testing.assert_close(model_state[name], value, rtol=0, atol=TOLERANCE[updater], msg=name)
    if updater == "adam":  # the moments, split like their parameters, gathered whole
        moments = single[(mode, updater)].optimizer.state
        names = {id(p): name for name, p in single[(mode, updater)].module.named_parameters()}
        for p, state in moments.items():
            torch.testing.assert_close(optimizer_state["state"][names[id(p)]]["exp_avg_sq"], state["exp_avg_sq"],
                                       rtol=1e-3, atol=1e-8, msg=names[id(p)])


@pytest.mark.parametrize("mode", ["tensor", "hybrid"])
def test_a_distributed_model_file_loads_in_one_process_bit_exactly(runs, mode, tmp_path):
    _, results, _ = runs
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
