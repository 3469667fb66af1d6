"""Run by tests/test_parallel.py: a long parallel fit, to be stopped by Ctrl-C (SIGINT)."""

import sys

import torch

from dl4py import ArrayDataSetIterator, DenseLayer, InputType, MultiLayerNetwork, NetworkConfig, OutputLayer, Sgd
from dl4py.parallel import ParallelWrapper
from dl4py.train import TrainingInterrupted

if __name__ == "__main__":
    x = torch.randn(4096, 5)
    y = (x[:, 0] > 0).long()
    config = NetworkConfig(layers=[DenseLayer(n_out=8), OutputLayer(n_out=2)],
                           input_type=InputType.feed_forward(5), updater=Sgd(0.1))
    try:
        ParallelWrapper(MultiLayerNetwork(config, backend="cpu"), workers=2).fit(
            ArrayDataSetIterator(x, y, batch_size=8), epochs=10_000)
    except TrainingInterrupted as exc:
        print(f"interrupted: {exc}", flush=True)
        sys.exit(130)
    sys.exit(0)
