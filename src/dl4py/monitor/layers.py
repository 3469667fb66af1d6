"""A model's layers as the statistics name them: each with its parameters and its module.

- ``MultiLayerNetwork``: one entry per configured layer, named ``"{index}_{class}"``
  (``"0_ConvolutionLayer"``), parameterless layers (pooling, dropout) included: their
  activations are still worth watching;
- ``TorchModel``: one entry per module that owns parameters itself, named by its dotted
  path (``"encoder.fc1"``), ``"model"`` for parameters of the root module.

The parameters are the ones the optimizer steps: with float32 master weights (precision
``half``, ``bfloat16``) the masters, which also hold the true gradients after a step; the
module is the one forward runs through (16-bit under master weights), for activations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dl4py.nn.signature import MULTILAYER


@dataclass
class Layer:
    name: str
    parameters: list[torch.Tensor]  # the stepped ones (float32 masters where the model keeps them)
    module: nn.Module  # the module forward runs through: its output is the layer's activation

    @property
    def size(self) -> int:
        return sum(p.numel() for p in self.parameters)


def model_layers(model) -> list[Layer]:
    """The layers of an initialised ``model``, in forward order."""
    forward_root = model.module
    stepped_root = model.stepped_module
    if model.signature().model == MULTILAYER and isinstance(forward_root, nn.Sequential):
        return [Layer(f"{index}_{type(layer).__name__}", list(stepped.parameters()), forward)
                for index, (layer, stepped, forward) in enumerate(zip(model.config.layers, stepped_root, forward_root))]
    forward_modules = dict(forward_root.named_modules())
    layers, seen = [], set()
    for name, module in stepped_root.named_modules():
        # A parameter shared by two modules (tied weights) counts once, with the first.
        params = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in params)
        if params:
            layers.append(Layer(name or "model", params, forward_modules[name]))
    return layers
