"""The softsign activation (DL4J's SoftSign, added for its GravesLSTM files) in the memory
estimator: three operators (|x|, 1 + |x|, the quotient) whose saved tensors and backward
temporaries the estimate counts, within 5% of the measured peak after a dense and a
convolutional layer (exact on this CPU when written)."""

from __future__ import annotations

import pytest
import torch

from dl4py import ConvolutionLayer, DenseLayer, GlobalPoolingLayer, InputType, MultiLayerNetwork, NetworkConfig, OutputLayer
from dl4py.memory import estimate
from dl4py.memory.measure import measure_training_step

CASES = {
    "dense": (InputType.feed_forward(64), [DenseLayer(n_out=512, activation="softsign"),
                                           DenseLayer(n_out=256, activation="softsign"), OutputLayer(n_out=3)]),
    "convolution": (InputType.convolutional(16, 16, 3), [ConvolutionLayer(n_out=8, kernel_size=3, activation="softsign"),
                                                         GlobalPoolingLayer(), OutputLayer(n_out=3)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_softsign_is_estimated_within_5_percent(name):
    input_type, layers = CASES[name]
    conf = NetworkConfig(layers=layers, input_type=input_type, seed=1)
    net = MultiLayerNetwork(conf, backend="cpu").init()
    g = torch.Generator().manual_seed(5)
    shape = (64,) if name == "dense" else (3, 16, 16)
    measured = measure_training_step(net, torch.randn(32, *shape, generator=g), torch.randint(0, 3, (32,), generator=g))
    assert estimate(conf, 32, device="cpu").peak_bytes == pytest.approx(measured.peak_bytes, rel=0.05)
