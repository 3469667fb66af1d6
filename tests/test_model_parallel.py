"""Sharded data parallelism (``parallelism="sharded"``, FSDP2) on CPU with gloo, and the
tensor-parallel and hybrid modes as the ParallelWrapper runs them (their arithmetic on a
LeNet-like net: tests/test_tensor_parallel.py).

Each update of a sharded fit is the shared-gradients mode's: the mean gradient of the
round's batches, applied once. So a 2-worker sharded fit over batches of 8 ends where a
single process ends that steps once per round on the round's batches together (16
examples; the last round, which worker 1 sits out, on worker 0's batch alone).

The fits run on each device (tests/devices.py): on CUDA a GPU for each worker, joined by
NCCL (ranks sharing a GPU are refused, tested below); the single process they are compared
with runs on the same device.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from dl4py import (
    Adam,
    ArrayDataSetIterator,
    DenseLayer,
    InputType,
    MultiLayerNetwork,
    NetworkConfig,
    OutputLayer,
    Sgd,
)
from dl4py.nn.loading import load
from dl4py.parallel import ParallelPlan, ParallelWrapper
from dl4py.parallel.sharding import RowBlocks, row_blocks, split_large_linears

from devices import backend_for, gpu_per_rank, on_devices, tolerance
from toy import DiesInItsThirdBatch  # noqa: E402

WORKERS, BATCH, EXAMPLES = 2, 8, 70  # 9 batches, the last of 6: worker 1 sits the 5th round out


def network(updater) -> NetworkConfig:
    # 64 -> 17,000 holds 1,088,000 weights, over 1/16 of them all and over 2**20: gathered in 2 row blocks.
    return NetworkConfig(layers=[DenseLayer(n_out=64, activation="tanh"), DenseLayer(n_out=17_000, activation="relu"),
                                 OutputLayer(n_out=3)],
                         input_type=InputType.feed_forward(5), updater=updater, seed=7)


def toy_data():
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(EXAMPLES, 5, generator=generator)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()


def rounds(x, y):
    """The batches a single process steps on: each round's batches together."""
    starts = list(range(0, EXAMPLES, BATCH))
    for r in range(0, len(starts), WORKERS):
        end = min(starts[min(r + WORKERS, len(starts)) - 1] + BATCH, EXAMPLES)
        yield x[starts[r]:end], y[starts[r]:end]


def model(updater, device, **options) -> MultiLayerNetwork:
    return MultiLayerNetwork(network(updater), backend=backend_for(device), **options).init()


def workers_on(device) -> dict:
    """The ParallelWrapper's device option: a GPU for each worker (the case skipped on fewer),
    or the default (CPU)."""
    gpus = gpu_per_rank(device, WORKERS)
    return {"devices": gpus} if gpus else {}


def step(net, features, labels) -> None:
    net.train_step(net.prepare_input(features.to(net.device)), labels.to(net.device))


def single_process(updater, epochs, device="cpu"):
    net = model(updater, device)
    x, y = toy_data()
    for _ in range(epochs):
        for features, labels in rounds(x, y):
            step(net, features, labels)
    return net


def sharded_fit(net, epochs, device="cpu"):
    x, y = toy_data()
    ParallelWrapper(net, workers=WORKERS, parallelism="sharded", **workers_on(device)).fit(
        ArrayDataSetIterator(x, y, batch_size=BATCH, shuffle=False), epochs=epochs)
    return net


_TWO_EPOCHS: dict[tuple[str, str], MultiLayerNetwork] = {}


def sharded_two_epochs(updater, device) -> MultiLayerNetwork:
    """A 2-epoch sharded fit with ``updater``, made once per module and device (two tests read it)."""
    key = (repr(updater), device)
    if key not in _TWO_EPOCHS:
        _TWO_EPOCHS[key] = sharded_fit(model(updater, device), epochs=2, device=device)
    return _TWO_EPOCHS[key]


def largest_gap(a, b) -> float:
    return max((p.cpu() - q.cpu()).abs().max().item()
               for p, q in zip(a.module.state_dict().values(), b.module.state_dict().values()))


def allowed(device, cpu: float) -> float:
    """The largest gap allowed: the test's own on the CPU, a GPU's float32 rounding there."""
    return tolerance(device, cpu=cpu)["atol"]


@pytest.mark.slow
@on_devices
@pytest.mark.parametrize("updater, gap", [(Sgd(0.1), 1e-5), (Adam(1e-3), 1e-4)], ids=["sgd", "adam"])
def test_sharded_training_ends_with_the_single_process_parameters(updater, gap, device):
    sharded = sharded_two_epochs(updater, device)
    reference = single_process(updater, epochs=2, device=device)
    assert largest_gap(sharded, reference) < allowed(device, gap)
    assert sharded.iteration_count == 18 and sharded.epoch_count == 2
    # The updater state came back whole too (momentum / Adam's moments), under the plain names.
    ours, theirs = sharded.optimizer.state_dict()["state"], reference.optimizer.state_dict()["state"]
    assert ours.keys() == theirs.keys()
    for index in theirs:
        for key, value in theirs[index].items():
            assert (ours[index][key].cpu().float() - value.cpu().float()).abs().max().item() < allowed(device, gap), \
                (index, key)


@pytest.mark.slow
@on_devices
def test_sharded_to_single_process_to_sharded_is_bit_exact(tmp_path, device):
    """One sharded epoch, saved; loaded and saved again by a single process; one more sharded
    epoch from that file: the same bits as two sharded epochs in a row (on a GPU, where two
    runs of the same steps agree to rounding, the same to that; the files' round trip is
    bit-exact on both)."""
    straight = sharded_two_epochs(Adam(1e-3), device)
    first = sharded_fit(model(Adam(1e-3), device), epochs=1, device=device)
    first.save(tmp_path / "sharded.zip")
    single = load(tmp_path / "sharded.zip", backend=backend_for(device))
    for (name, a), b in zip(first.module.state_dict().items(), single.module.state_dict().values()):
        assert torch.equal(a.cpu(), b.cpu()), name
    single.save(tmp_path / "single.zip")
    resumed = sharded_fit(load(tmp_path / "single.zip", backend=backend_for(device)), epochs=1, device=device)
    for (name, a), b in zip(straight.module.state_dict().items(), resumed.module.state_dict().values()):
        assert_close(b.cpu(), a.cpu(), **tolerance(device), msg=lambda m: f"{name}: {m}")
    for index, state in straight.optimizer.state_dict()["state"].items():
        for key, value in state.items():
            assert_close(resumed.optimizer.state_dict()["state"][index][key].cpu(), value.cpu(), **tolerance(device),
                         msg=lambda m: f"updater state {index} {key}: {m}")


@on_devices
def test_large_dense_layers_are_split_into_row_blocks_that_compute_the_same(device):
    # The seed-sized MLP 784-4000-4000-10: its 4000 x 4000 layer in blocks of at most 19.2M / 16.
    assert row_blocks(16_000_000, 19_190_010) == 14 and row_blocks(3_136_000, 19_190_010) == 3
    assert row_blocks(1_000_000, 1_100_000) == 1  # under 2**20: one unit whatever its share
    net = model(Sgd(0.1), device)
    x = toy_data()[0].to(net.device)
    before = net.module(x)
    split = split_large_linears(net.module)
    assert split == {"1.op": 2}
    assert isinstance(net.module[1].op, RowBlocks)
    assert_close(net.module(x), before, **tolerance(device, cpu=1e-6))


@on_devices
@pytest.mark.parametrize("precision", ["bfloat16", "mixed-bf16"])
def test_16_bit_precisions_train_sharded_with_float32_master_shards(precision, tmp_path, device):
    """FSDP's mixed precision: float32 shards, gathered in 16 bits; the result matches the
    single process's to 16-bit rounding, and the saved model keeps its precision."""
    sharded = sharded_fit(model(Sgd(0.1), device, precision=precision), epochs=1, device=device)
    reference = model(Sgd(0.1), device, precision=precision)
    x, y = toy_data()
    for features, labels in rounds(x, y):
        step(reference, features, labels)
    assert largest_gap(sharded, reference) < 1e-2  # bf16 keeps 8 bits: steps of 0.1 * gradients
    sharded.save(tmp_path / "m.zip")
    again = load(tmp_path / "m.zip", backend=backend_for(device))
    assert again.precision.name == precision
    if sharded.precision_state.keeps_masters:  # bfloat16: its float32 masters came back whole
        for a, b in zip(sharded.stepped_module.parameters(), again.stepped_module.parameters()):
            assert torch.equal(a.cpu(), b.cpu())


@on_devices
def test_early_stopping_scores_the_gathered_model(tmp_path, device):
    from dl4py.parallel import EarlyStoppingParallelTrainer
    from dl4py.train.early_stopping import (
        DataSetLossCalculator,
        EarlyStoppingConfiguration,
        LocalFileModelSaver,
        MaxEpochs,
    )

    x, y = toy_data()
    validation = ArrayDataSetIterator(x, y, batch_size=35, shuffle=False)
    config = EarlyStoppingConfiguration(score_calculator=DataSetLossCalculator(validation),
                                        epoch_conditions=[MaxEpochs(2)], model_saver=LocalFileModelSaver(tmp_path))
    trainer = EarlyStoppingParallelTrainer(config, MultiLayerNetwork(network(Sgd(0.1)), backend=backend_for(device)),
                                           ArrayDataSetIterator(x, y, batch_size=BATCH, shuffle=False),
                                           workers=WORKERS, parallelism="sharded", **workers_on(device))
    with trainer:
        result = trainer.fit()
    assert result.total_epochs == 2 and sorted(result.score_vs_epoch) == [0, 1]
    reference = single_process(Sgd(0.1), epochs=2, device=device)
    # Epoch 2's score is the loss of the gathered model: the single process's, to float rounding
    # (on a GPU the gathered model is scored on the host, the reference on the GPU).
    assert result.score_vs_epoch[1] == pytest.approx(reference.score(validation),
                                                     rel=tolerance(device, cpu=1e-5)["rtol"])
    best = load(tmp_path / "bestModel.dl4py", backend=backend_for(device))
    assert best.score(validation) == pytest.approx(result.best_model_score, rel=tolerance(device, cpu=1e-6)["rtol"])


@on_devices
def test_a_killed_rank_stops_the_sharded_fit_naming_it(device):
    import multiprocessing

    from dl4py.errors import WorkerError

    x, y = toy_data()
    net = model(Sgd(0.1), device)
    before = [p.detach().clone() for p in net.module.parameters()]
    options = workers_on(device)
    where = "cuda:1" if device == "cuda" else "cpu"
    # Named as a death ("was killed by SIGKILL"), not as a rank the others waited for until the
    # watchdog's timeout: the coordinator saw the process end.
    with pytest.raises(WorkerError, match=rf"worker 1 \(device {where}\) failed: was killed by SIGKILL") as info:
        ParallelWrapper(net, workers=WORKERS, parallelism="sharded", prefetch_buffer=0, **options).fit(
            DiesInItsThirdBatch(x, y, batch_size=BATCH, shuffle=False), epochs=20)
    assert info.value.rank == 1
    assert multiprocessing.active_children() == []
    assert all(torch.equal(a, b) for a, b in zip(before, net.module.parameters()))  # untouched


@on_devices
@pytest.mark.parametrize("mode", ["tensor", "hybrid"])
def test_tensor_and_hybrid_fits_end_with_the_single_process_parameters(mode, device):
    """Tensor mode: both ranks train every batch together (one stream, dense pairs split), as
    one process on the same batches. Hybrid on a dense network: each rank its own batch,
    gathered at the first layer, as one process on each round's batches; in the last round
    worker 1 steps with an empty batch."""
    x, y = toy_data()
    net = model(Sgd(0.1), device)
    ParallelWrapper(net, workers=WORKERS, parallelism=ParallelPlan.from_training_mode(mode), **workers_on(device)).fit(
        ArrayDataSetIterator(x, y, batch_size=BATCH, shuffle=False), epochs=2)
    if mode == "tensor":
        reference = model(Sgd(0.1), device)
        for _ in range(2):
            for start in range(0, EXAMPLES, BATCH):
                step(reference, x[start:start + BATCH], y[start:start + BATCH])
    else:
        reference = single_process(Sgd(0.1), epochs=2, device=device)
    assert largest_gap(net, reference) < allowed(device, 1e-5)
    assert (net.epoch_count, net.iteration_count) == (2, 18)  # batches of the data, not counted per rank


def test_the_parallelism_key_names_the_plan():
    from dl4py.config.run import TrainingConfig
    from dl4py.errors import ConfigError

    def mode(**training):
        return TrainingConfig.from_dict({"workers": 2, **training}, "training").parallel_options().parallelism.mode

    assert mode() == "averaging"
    assert mode(parallelism="sharded") == "sharded" and mode(parallelism="tensor") == "tensor"
    assert mode(parallelism="hybrid") == "hybrid"
    assert mode(parallelism={"conv": "data", "dense": "tensor"}) == "hybrid"  # an earlier spelling, still read
    assert mode(parallelism={"kind": "data", "sync": "shared_gradients"}) == "shared_gradients"
    with pytest.raises(ConfigError, match=r"training.parallelism: per kind of layer"):
        mode(parallelism={"conv": "tensor", "dense": "data"})
    with pytest.raises(ConfigError, match=r"training.parallelism: and training.training_mode: shared_gradients both"):
        mode(parallelism="sharded", training_mode="shared_gradients")
    with pytest.raises(ConfigError, match=r"training.parallelism.sync: applies to the data plan only"):
        mode(parallelism={"kind": "sharded", "sync": "shared_gradients"})
    with pytest.raises(ConfigError, match=r"training.parallelism.shards: is not a key of a plan"):
        mode(parallelism={"kind": "sharded", "shards": 2})
    with pytest.raises(ConfigError, match=r"training.parallelism: applies to parallel training only"):
        TrainingConfig.from_dict({"workers": 1, "parallelism": "sharded"}, "training")


@pytest.mark.parametrize("kind", ["sharded", "tensor", "hybrid"])
def test_ranks_that_would_share_a_gpu_are_refused_for_the_distributed_plans(kind):
    """gloo, the transport of ranks sharing a GPU, has no CUDA all-gather: on an H200 the
    workers of every such plan died of SIGSEGV at their first batch. Refused, naming the GPUs;
    the data plan's all-reduce works there and is allowed."""
    from dl4py.errors import ConfigError
    from dl4py.parallel.preflight import check_plan_transport

    plan = ParallelPlan(kind, tensor_size=2 if kind == "hybrid" else None)
    with pytest.raises(ConfigError, match=rf"workers: is 2 on 1 GPU\(s\) \(cuda:0\): the {kind} plan needs a GPU of "
                                          r"its own for each rank .* or parallelism data"):
        check_plan_transport(plan, 2, ["cuda:0"])
    with pytest.raises(ConfigError, match=r"is 4 on 2 GPU\(s\) \(cuda:0, cuda:1\)"):
        check_plan_transport(plan, 4, ["cuda:0", "cuda:1"])
    check_plan_transport(plan, 2, ["cuda:0", "cuda:1"])  # NCCL: a GPU each
    check_plan_transport(plan, 2, ["cpu"])
    check_plan_transport(ParallelPlan("data"), 2, ["cuda:0"])


@pytest.mark.gpu
def test_a_sharded_fit_of_two_workers_on_one_gpu_is_refused_before_any_starts():
    import multiprocessing

    from dl4py.errors import ConfigError

    x, y = toy_data()
    net = model(Sgd(0.1), "cuda")
    with pytest.raises(ConfigError, match=r"workers: is 2 on 1 GPU\(s\) \(cuda:0\): the sharded plan needs"):
        ParallelWrapper(net, workers=WORKERS, parallelism="sharded", devices=["cuda:0"]).fit(
            ArrayDataSetIterator(x, y, batch_size=BATCH, shuffle=False))
    assert multiprocessing.active_children() == []


def test_accumulation_with_the_sharded_mode_is_refused_before_any_worker_starts():
    from dl4py.errors import ConfigError

    x, y = toy_data()
    net = MultiLayerNetwork(network(Sgd(0.1))).init().set_accumulate_batches(2)
    with pytest.raises(ConfigError, match="training.accumulate_batches: is not supported with parallelism sharded"):
        ParallelWrapper(net, workers=WORKERS, parallelism="sharded").fit(
            ArrayDataSetIterator(x, y, batch_size=BATCH, shuffle=False))


def test_what_tensor_and_hybrid_cannot_train_is_refused_before_any_worker_starts():
    from torch import nn

    from dl4py import TorchModel
    from dl4py.errors import ConfigError

    x, y = toy_data()
    data = ArrayDataSetIterator(x, y, batch_size=BATCH, shuffle=False)
    torch_model = TorchModel(nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)), loss=nn.CrossEntropyLoss(),
                             optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    with pytest.raises(ConfigError, match="parallelism: 'tensor' splits the dense layers of a MultiLayerNetwork; "
                                          "this model is a TorchModel"):
        ParallelWrapper(torch_model, workers=WORKERS, parallelism="tensor").fit(data)
    with pytest.raises(ConfigError, match="training.precision: 'bfloat16' keeps float32 master weights"):
        ParallelWrapper(MultiLayerNetwork(network(Sgd(0.1)), precision="bfloat16"), workers=WORKERS,
                        parallelism="hybrid").fit(data)
