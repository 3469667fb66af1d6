"""Sharded data parallelism (``training_mode="sharded"``, FSDP2) on CPU with gloo.

Each update of a sharded fit is the shared-gradients mode's: the mean gradient of the
round's batches, applied once. So a 2-worker sharded fit over batches of 8 ends where a
single process ends that steps once per round on the round's batches together (16
examples; the last round, which worker 1 sits out, on worker 0's batch alone).
"""

from __future__ import annotations

import pytest
import torch

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
from dl4py.parallel import ParallelWrapper
from dl4py.parallel.sharding import RowBlocks, row_blocks, split_large_linears

WORKERS, BATCH, EXAMPLES = 2, 8, 70  # 9 batches, the last of 6: worker 1 sits the 5th round out


def network(updater) -> NetworkConfig:
    # 64 -> 300 holds 19,200 of 21,169 weights: more than 1/16, so it is gathered in row blocks.
    return NetworkConfig(layers=[DenseLayer(n_out=64, activation="tanh"), DenseLayer(n_out=300, activation="relu"),
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


def single_process(updater, epochs):
    net = MultiLayerNetwork(network(updater)).init()
    x, y = toy_data()
    for _ in range(epochs):
        for features, labels in rounds(x, y):
            net.train_step(net.prepare_input(features), labels)
    return net


def sharded_fit(net, epochs):
    x, y = toy_data()
    ParallelWrapper(net, workers=WORKERS, training_mode="sharded").fit(
        ArrayDataSetIterator(x, y, batch_size=BATCH, shuffle=False), epochs=epochs)
    return net


def largest_gap(a, b) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.module.state_dict().values(), b.module.state_dict().values()))


@pytest.mark.parametrize("updater, tolerance", [(Sgd(0.1), 1e-5), (Adam(1e-3), 1e-4)], ids=["sgd", "adam"])
def test_sharded_training_ends_with_the_single_process_parameters(updater, tolerance):
    sharded = sharded_fit(MultiLayerNetwork(network(updater)).init(), epochs=2)
    reference = single_process(updater, epochs=2)
    assert largest_gap(sharded, reference) < tolerance
    assert sharded.iteration_count == 18 and sharded.epoch_count == 2
    # The updater state came back whole too (momentum / Adam's moments), under the plain names.
    ours, theirs = sharded.optimizer.state_dict()["state"], reference.optimizer.state_dict()["state"]
    assert ours.keys() == theirs.keys()
    for index in theirs:
        for key, value in theirs[index].items():
            assert (ours[index][key].float() - value.float()).abs().max().item() < tolerance, (index, key)


def test_sharded_to_single_process_to_sharded_is_bit_exact(tmp_path):
    """One sharded epoch, saved; loaded and saved again by a single process; one more sharded
    epoch from that file: the same bits as two sharded epochs in a row."""
    straight = sharded_fit(MultiLayerNetwork(network(Adam(1e-3))).init(), epochs=2)
    first = sharded_fit(MultiLayerNetwork(network(Adam(1e-3))).init(), epochs=1)
    first.save(tmp_path / "sharded.zip")
    single = load(tmp_path / "sharded.zip")
    for (name, a), b in zip(first.module.state_dict().items(), single.module.state_dict().values()):
        assert torch.equal(a, b), name
    single.save(tmp_path / "single.zip")
    resumed = sharded_fit(load(tmp_path / "single.zip"), epochs=1)
    for (name, a), b in zip(straight.module.state_dict().items(), resumed.module.state_dict().values()):
        assert torch.equal(a, b), name
    for index, state in straight.optimizer.state_dict()["state"].items():
        for key, value in state.items():
            assert torch.equal(resumed.optimizer.state_dict()["state"][index][key], value), (index, key)


def test_large_dense_layers_are_split_into_row_blocks_that_compute_the_same():
    assert row_blocks(16_000_000, 19_200_000) == 14 and row_blocks(1000, 19_200_000) == 1
    net = MultiLayerNetwork(network(Sgd(0.1))).init()
    x, _ = toy_data()
    before = net.module(x)
    split = split_large_linears(net.module)
    assert split == {"1.op": 15}  # 19,200 weights over a limit of 21,169 / 16
    assert isinstance(net.module[1].op, RowBlocks)
    assert torch.allclose(net.module(x), before, atol=1e-6)
