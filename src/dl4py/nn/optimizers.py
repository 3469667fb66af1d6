"""Updater config -> torch optimizer, with DL4J's L2 placement (weights only, per layer)."""

from __future__ import annotations

import torch
from torch import nn

from dl4py.config.layers import BatchNormalization
from dl4py.config.network import NetworkConfig
from dl4py.config.updaters import Adam, AdamW, Nesterovs, RmsProp, Sgd, Updater


def param_groups(config: NetworkConfig, module: nn.Sequential) -> list[dict]:
    """One group per distinct L2 value. Biases and batch-norm parameters get no L2 (DL4J's default)."""
    groups: dict[float, list[torch.nn.Parameter]] = {}
    decayed = isinstance(config.updater, AdamW)
    for layer, layer_module in zip(config.layers, module):
        layer_l2 = getattr(layer, "l2", None)
        l2 = config.l2 if layer_l2 is None else layer_l2
        if decayed:
            l2 = config.updater.weight_decay
        for name, param in layer_module.named_parameters():
            is_weight = name.endswith("weight") and not isinstance(layer, BatchNormalization)
            groups.setdefault(l2 if is_weight else 0.0, []).append(param)
    return [{"params": params, "weight_decay": l2} for l2, params in groups.items()]


def make_optimizer(updater: Updater, groups) -> torch.optim.Optimizer:
    lr = updater.learning_rate
    if isinstance(updater, Nesterovs):
        return torch.optim.SGD(groups, lr=lr, momentum=updater.momentum, nesterov=updater.momentum > 0)
    if isinstance(updater, Sgd):
        return torch.optim.SGD(groups, lr=lr)
    if isinstance(updater, AdamW):
        return torch.optim.AdamW(groups, lr=lr, betas=(updater.beta1, updater.beta2), eps=updater.epsilon)
    if isinstance(updater, Adam):
        return torch.optim.Adam(groups, lr=lr, betas=(updater.beta1, updater.beta2), eps=updater.epsilon)
    if isinstance(updater, RmsProp):
        return torch.optim.RMSprop(groups, lr=lr, alpha=updater.rms_decay, eps=updater.epsilon)
    raise TypeError(f"no optimizer for updater {type(updater).__name__}")
