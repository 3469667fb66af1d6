"""Global pooling over a sequence's steps (DL4J's GlobalPoolingLayer on RNN data): ``[time, size] ->
[size]``, max, mean or sum; with a padded batch's mask, over each sequence's real steps only (DL4J's
MaskedReductionUtil), so a sequence pools the same alone or padded in a batch. Its memory estimate
is within 5% of the measured peak."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dl4py import (
    LSTM,
    GlobalPoolingLayer,
    InputType,
    MultiLayerNetwork,
    NetworkConfig,
    OutputLayer,
)
from dl4py.memory import estimate
from dl4py.memory.measure import measure_training_step

POOLS = ["max", "avg", "sum"]


def _net(pooling: str, length=None) -> MultiLayerNetwork:
    return MultiLayerNetwork(NetworkConfig(
        layers=[LSTM(n_out=6), GlobalPoolingLayer(pooling_type=pooling), OutputLayer(n_out=3, activation="identity",
                                                                                   loss="mse")],
        input_type=InputType.recurrent(4, length), seed=2), backend="cpu").init()


@pytest.mark.parametrize("pooling", POOLS)
def test_pooling_over_steps_equals_numpy_and_ignores_padding(pooling):
    net = _net(pooling)
    lstm, pool = net.module[0], net.module[1]
    rng = np.random.default_rng(3)
    lengths = [5, 2, 4]
    x = torch.zeros(3, 5, 4)
    for i, length in enumerate(lengths):
        x[i, :length] = torch.from_numpy(rng.normal(size=(length, 4)).astype(np.float32))
    mask = (torch.arange(5)[None] < torch.tensor(lengths)[:, None]).float()
    net.set_mask(mask)
    with torch.no_grad():
        steps = lstm(x)
        pooled = pool(steps).numpy()
    net.set_mask(None)
    reduce = {"max": np.max, "avg": np.mean, "sum": np.sum}[pooling]
    for i, length in enumerate(lengths):
        np.testing.assert_allclose(pooled[i], reduce(steps[i, :length].numpy(), axis=0), rtol=1e-6, atol=1e-7)
    # and the whole network: a sequence padded in a batch gives what it gives alone
    net.set_mask(mask)
    with torch.no_grad():
        together = net.module(x).numpy()
    net.set_mask(None)
    for i, length in enumerate(lengths):
        alone = net.output(x[i:i + 1, :length]).numpy()
        np.testing.assert_allclose(together[i], alone[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pooling", POOLS)
def test_memory_estimate_is_within_5_percent_of_the_measured_peak(pooling):
    conf = NetworkConfig(layers=[LSTM(n_out=32), GlobalPoolingLayer(pooling_type=pooling), OutputLayer(n_out=3)],
                         input_type=InputType.recurrent(8, 20), seed=1)
    net = MultiLayerNetwork(conf, backend="cpu").init()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(16, 20, 8, generator=g)
    mask = torch.ones(16, 20)
    mask[:8, 17:] = 0  # half the sequences 3 steps shorter, as SequenceDataSetIterator pads them
    measured = measure_training_step(net, x, torch.randint(0, 3, (16,), generator=g), mask=mask)
    assert estimate(conf, 16, device="cpu").peak_bytes == pytest.approx(measured.peak_bytes, rel=0.05)


def test_the_shape_is_one_value_per_feature():
    config = NetworkConfig(layers=[LSTM(n_out=6), GlobalPoolingLayer(), OutputLayer(n_out=2)],
                           input_type=InputType.recurrent(4))
    assert [(s.output.kind, s.output.dims) for s in config.layer_shapes()][:2] == [("rnn", (None, 6)), ("ff", (6,))]
