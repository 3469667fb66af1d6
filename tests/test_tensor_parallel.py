"""Tensor-parallel and hybrid (data-parallel convolutions, tensor-parallel dense layers)
training on 2 ranks ends where the single-process run on the same batches
ends; a distributed model gathered whole loads in a single process bit for bit, and back.
On 4 ranks as a 2-D mesh (2 data groups x 2 tensor ranks) likewise: each step one update on
the round's batches together, directly and through the rank program (``run_rank``) over an
epoch whose last round leaves a group without data.

Tensor mode accumulates (``accumulate_batches``) on the 2-D mesh as the shared-gradients mode
does: each update on the mean of the data groups' mean gradients over their window's rows.

One start of 2 ranks runs every 1-D case, one of 4 every 2-D case (each process start costs
seconds), per device: on CUDA a GPU for each rank, joined by NCCL, as dl4py requires (ranks
sharing a GPU are refused; the cases are skipped on fewer GPUs). The ranks (their programs in
``tensor_parallel_ranks.py``) write what they ended with, and the tests compare it with
single-process runs on the same device here. ``run_ranks`` bounds each start and names a
rank that fails or hangs.
"""

from __future__ import annotations

import copy

import pytest
import torch

from dl4py import (
    BatchNormalization,
    ConfigError,
    DropoutLayer,
    DenseLayer,
    MnistDataSetIterator,
    MultiLayerNetwork,
    OutputLayer,
    load,
)

from devices import backend_for, gpu_per_rank, on_devices, tolerance  # noqa: E402
from ranks import run_ranks  # noqa: E402
from tensor_parallel_ranks import (  # noqa: E402
    ACCUMULATE, BATCH, CASES, CASES_2D, FIT_BATCH, FIT_EXAMPLES, STEPS, WORLD, WORLD_2D, config_for, lenet, mlp,
    rank_1d, rank_2d, toy_network, train,
)
from toy import toy  # noqa: E402

TOLERANCE = {"sgd": 1e-5, "adam": 1e-4}
# Four ranks importing nothing (forked from the forkserver), each a few seconds of work, on
# two cores that other tests load too: a generous bound, which only a hang reaches.
RANKS_TIMEOUT = 240


def close(device: str, updater: str) -> dict:
    """How near a distributed run ends to the single process's: on the CPU the updater's bound
    (only the partial sums' order differs), on CUDA ``tolerance`` (TF32 convolutions)."""
    return {"rtol": 0.0, "atol": TOLERANCE[updater]} if device == "cpu" else tolerance(device)


def _read(out) -> dict:
    return torch.load(out, weights_only=False, map_location="cpu")  # compared on the host


class PerDevice:
    """A module fixture's value for each device, made when a test first asks for it (a cuda
    case skipped makes nothing). A start that failed fails the later tests at once, with its
    error, rather than starting the ranks again (and waiting out a hang again)."""

    def __init__(self, make):
        self.make, self.made, self.failed = make, {}, {}

    def __call__(self, device: str):
        if device in self.failed:
            raise self.failed[device]
        if device not in self.made:
            try:
                self.made[device] = self.make(device)
            except Exception as error:
                self.failed[device] = error
                raise
        return self.made[device]


@pytest.fixture(scope="module")
def mnist_batches():
    """The STEPS MNIST batches every case trains on."""
    from conftest import require_mnist

    require_mnist()
    data = MnistDataSetIterator(BATCH, train=True, seed=1, limit=BATCH * STEPS)
    return [(batch.features, batch.labels) for batch in data]


@pytest.fixture(scope="module")
def single(mnist_batches):
    """``single(device)``: the single-process runs on the whole batches, by case."""

    def make(device):
        runs, threads = {}, torch.get_num_threads()
        torch.set_num_threads(1)  # tiny networks: threads only wait on each other on a busy machine
        try:
            for case in CASES:
                model = MultiLayerNetwork(config_for(*case), backend=backend_for(device)).init()
                train(model, mnist_batches)
                runs[case] = model
        finally:
            torch.set_num_threads(threads)
        return runs

    return PerDevice(make)


@pytest.fixture(scope="module")
def runs(mnist_batches, tmp_path_factory):
    """``runs(device)``: what the 2 ranks ended with."""

    def make(device):
        gpu_per_rank(device, WORLD)
        folder = tmp_path_factory.mktemp(f"tensor_parallel_{device}")
        run_ranks(rank_1d, (str(folder / "rendezvous"), str(folder / "results.pt"), mnist_batches, device), WORLD,
                  timeout=RANKS_TIMEOUT)
        return _read(folder / "results.pt")

    return PerDevice(make)


@pytest.fixture(scope="module")
def runs_2d(mnist_batches, tmp_path_factory):
    """``runs_2d(device)``: what the 4 ranks of the 2-D mesh ended with (the batches of ``runs``)."""

    def make(device):
        gpu_per_rank(device, WORLD_2D)
        folder = tmp_path_factory.mktemp(f"tensor_parallel_2d_{device}")
        run_ranks(rank_2d, (str(folder / "rendezvous"), str(folder / "results.pt"), mnist_batches, device),
                  WORLD_2D, timeout=RANKS_TIMEOUT)
        return _read(folder / "results.pt")

    return PerDevice(make)


def assert_the_single_process_state(gathered, reference, config, updater, device) -> None:
    """``gathered`` (``full_state``'s pair, on the host) holds ``reference``'s parameters to the
    updater's tolerance, every one of them trained from ``config``'s start; with Adam its
    moments too."""
    model_state, optimizer_state = gathered
    expected = {name: value.cpu() for name, value in reference.module.state_dict().items()}
    assert sorted(model_state) == sorted(expected)
    start = MultiLayerNetwork(config, backend=backend_for(device)).init().module.state_dict()
    for name, value in expected.items():
        assert not torch.equal(value, start[name].cpu()), f"{name} did not train"  # a real comparison
        torch.testing.assert_close(model_state[name], value, **close(device, updater), msg=name)
    if updater == "adam":  # the moments, split like their parameters, gathered whole
        names = {id(p): name for name, p in reference.module.named_parameters()}
        for p, state in reference.optimizer.state.items():
            value = state["exp_avg_sq"].cpu()
            # On CUDA a squared gradient's small entries carry its TF32 error relatively magnified.
            bounds = {"rtol": 1e-3, "atol": 1e-8} if device == "cpu" else \
                {"rtol": 1e-2, "atol": 1e-2 * float(value.abs().max())}
            torch.testing.assert_close(optimizer_state["state"][names[id(p)]]["exp_avg_sq"], value, **bounds,
                                       msg=names[id(p)])


@on_devices
@pytest.mark.parametrize("mode,updater", CASES)
def test_ranks_end_with_the_single_process_parameters(runs, single, mode, updater, device):
    assert_the_single_process_state(runs(device)[(mode, updater)], single(device)[(mode, updater)],
                                    config_for(mode, updater), updater, device)


@on_devices
@pytest.mark.parametrize("mode,updater", CASES_2D)
def test_on_a_2d_mesh_the_ranks_end_with_the_single_process_parameters(single, runs_2d, mode, updater, device):
    """Tensor mode: each data group trains half of every batch; hybrid: each rank a quarter,
    gathered within its tensor group. Averaged over the data groups, each step is the single
    process's on the whole batch."""
    assert_the_single_process_state(runs_2d(device)[(mode, updater)], single(device)[(mode, updater)],
                                    config_for(mode, updater), updater, device)


@on_devices
@pytest.mark.parametrize("mode,per_round", [("tensor", 2), ("hybrid", 4)])
def test_the_rank_program_on_a_2d_mesh_steps_once_per_round_on_its_batches(runs_2d, mode, per_round, device,
                                                                           tmp_path):
    """Tensor mode: a round is one batch per data group (2), the hybrid one per rank (4); the
    single process steps once per round on the round's batches together. The last round (one
    batch of 6) leaves a group without data: it counts for nothing, not for a zero or a NaN."""
    (tmp_path / "model.dl4py").write_bytes(runs_2d(device)[("fit", mode)])
    trained = load(tmp_path / "model.dl4py", backend="cpu")
    assert (trained.epoch_count, trained.iteration_count) == (1, 9)  # batches of the data, not counted per rank
    reference = MultiLayerNetwork(toy_network(), backend=backend_for(device)).init()
    x, y = toy(FIT_EXAMPLES, seed=3)
    rows = FIT_BATCH * per_round
    train(reference, [(x[start:start + rows], y[start:start + rows]) for start in range(0, FIT_EXAMPLES, rows)])
    assert_the_single_process_state((trained.module.state_dict(), None), reference, toy_network(), "sgd", device)


def groups_accumulated(device: str, groups: int = 2):
    """The tensor-mode fit with ``ACCUMULATE`` by hand, on one module: round r deals batch
    ``r * groups + g`` to data group g; every ``ACCUMULATE`` rounds, and after the epoch's last,
    each group's gradient is the mean over the rows it saw in those rounds, and the update steps
    on the mean over the groups that saw any (the shared-gradients mode's rule). Nothing of
    dl4py's step, accumulation or collectives is used. Returns the module's state."""
    net = MultiLayerNetwork(toy_network(), backend=backend_for(device)).init()
    module = copy.deepcopy(net.module)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)  # toy_network's updater
    x, y = (t.to(net.backend.device) for t in toy(FIT_EXAMPLES, seed=3))
    batches = [(x[s:s + FIT_BATCH], y[s:s + FIT_BATCH]) for s in range(0, FIT_EXAMPLES, FIT_BATCH)]
    rounds = -(-len(batches) // groups)
    seen = [[] for _ in range(groups)]
    for r in range(rounds):
        for group, b in enumerate(range(r * groups, min((r + 1) * groups, len(batches)))):
            seen[group].append(batches[b])
        if (r + 1) % ACCUMULATE and r != rounds - 1:
            continue
        gradients = []
        for window in (w for w in seen if w):
            module.zero_grad(set_to_none=True)
            net.loss(module(torch.cat([f for f, _ in window])), torch.cat([l for _, l in window])).backward()
            gradients.append([p.grad.clone() for p in module.parameters()])
        for i, p in enumerate(module.parameters()):
            p.grad = torch.stack([g[i] for g in gradients]).mean(0)
        optimizer.step()
        seen = [[] for _ in range(groups)]
    return module.state_dict()


@on_devices
def test_tensor_mode_on_a_2d_mesh_accumulates_as_the_shared_gradients_mode(runs_2d, device, tmp_path):
    """``accumulate_batches=3`` through the rank program: 9 batches, 2 updates (windows of 3
    rounds and of the last 2). An accumulation the rank program dropped (as its distributed
    copy once did) makes 5 updates; a window weighted by the rows of both groups together
    misses the reference's second update."""
    (tmp_path / "model.dl4py").write_bytes(runs_2d(device)[("fit", "tensor", "accumulate")])
    trained = load(tmp_path / "model.dl4py", backend="cpu")
    assert (trained.iteration_count, trained.update_count) == (9, 2)
    for name, value in groups_accumulated(device).items():
        torch.testing.assert_close(trained.module.state_dict()[name], value.cpu(), **close(device, "sgd"), msg=name)


@on_devices
def test_a_tensor_group_without_rows_has_a_loss_of_zero(runs_2d, device):
    """Not the NaN of a mean over no rows (its gradients count for nothing: the rank program's
    test above)."""
    assert runs_2d(device)["empty group's loss"] == 0.0


@on_devices
@pytest.mark.parametrize("mesh,mode", [(mesh, mode) for mesh in ("1-D", "2-D") for mode in ("tensor", "hybrid")])
def test_a_distributed_model_file_loads_in_one_process_bit_exactly(runs, runs_2d, mesh, mode, device, tmp_path):
    results = runs(device) if mesh == "1-D" else runs_2d(device)
    model_state, optimizer_state = results[(mode, "adam")]
    (tmp_path / "model.dl4py").write_bytes(results[("file", mode)])  # plain_twin's, as model_bytes writes it
    loaded = load(tmp_path / "model.dl4py", backend="cpu")
    for name, value in loaded.module.state_dict().items():
        assert torch.equal(value, model_state[name]), name
    names = {id(p): name for name, p in loaded.module.named_parameters()}
    for p, state in loaded.optimizer.state.items():
        for key, value in state.items():
            assert torch.equal(value, optimizer_state["state"][names[id(p)]][key]), (names[id(p)], key)
    assert loaded.update_count == STEPS and loaded.optimizer.param_groups[0]["lr"] == 0.01


@on_devices
def test_a_single_process_state_distributed_and_gathered_again_is_bit_identical(runs, device):
    model_state, optimizer_state, (gathered_model, gathered_optimizer) = runs(device)["round trip"]
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
