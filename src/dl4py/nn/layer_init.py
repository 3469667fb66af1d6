"""What every layer builder shares: the activation modules by name, and DL4J's weight
initialisation (biases start at zero):
xavier N(0, 2/(fan_in+fan_out)), relu N(0, 2/fan_in), normal N(0, 1/fan_in),
uniform U(-1/sqrt(fan_in), 1/sqrt(fan_in)), zero.
"""

from __future__ import annotations

import math

import torch
from torch import nn

ACTIVATIONS = {
    "identity": nn.Identity,
    "relu": nn.ReLU,
    "leakyrelu": lambda: nn.LeakyReLU(0.01),  # DL4J's default alpha
    "tanh": nn.Tanh,
    "sigmoid": nn.Sigmoid,
    "softmax": lambda: nn.Softmax(dim=1),
    "gelu": nn.GELU,
    "softsign": nn.Softsign,  # DL4J's: x / (1 + |x|)
}


def init_weight(weight: torch.Tensor, scheme: str, gen: torch.Generator) -> None:
    fan_in, fan_out = nn.init._calculate_fan_in_and_fan_out(weight)
    with torch.no_grad():
        if scheme == "xavier":
            weight.normal_(0.0, math.sqrt(2.0 / (fan_in + fan_out)), generator=gen)
        elif scheme == "relu":
            weight.normal_(0.0, math.sqrt(2.0 / fan_in), generator=gen)
        elif scheme == "normal":
            weight.normal_(0.0, 1.0 / math.sqrt(fan_in), generator=gen)
        elif scheme == "uniform":
            bound = 1.0 / math.sqrt(fan_in)
            weight.uniform_(-bound, bound, generator=gen)
        elif scheme == "zero":
            weight.zero_()
        else:
            raise ValueError(f"unknown weight init {scheme!r}")


def init_weight_and_bias(module: nn.Module, scheme: str, gen: torch.Generator) -> None:
    """A linear or convolution module's weight by ``scheme``, its bias (if any) zero."""
    init_weight(module.weight, scheme, gen)
    if module.bias is not None:
        nn.init.zeros_(module.bias)
