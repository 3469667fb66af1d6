"""A tiny classification problem and network, shared by the parallel and early-stopping tests."""

import torch

from dl4py import DenseLayer, InputType, NetworkConfig, OutputLayer, Sgd


def mlp(lr=0.1) -> NetworkConfig:
    return NetworkConfig(
        layers=[DenseLayer(n_out=12, activation="tanh"), OutputLayer(n_out=3)],
        input_type=InputType.feed_forward(5), updater=Sgd(lr), seed=11,
    )


def toy(n: int = 256, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=gen)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
