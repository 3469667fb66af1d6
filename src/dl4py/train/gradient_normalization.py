"""DL4J's GradientNormalization: gradients clipped or renormalised per layer before the update.

A "layer" is one configured layer of the network (``network.layers[i]``: all its parameters
together); a "param type" is one of its parameters (weights, biases, batch norm's gamma and
beta). The modes, as DL4J's ``BaseMultiLayerUpdater.preApply`` computes them (g: a gradient):

- ``renormalize_l2_per_layer``: g / ||layer||  (a norm of 0 counts as 1e-5, as in DL4J)
- ``renormalize_l2_per_param_type``: g / ||g||  (same guard)
- ``clip_element_wise_absolute_value``: every element clamped to [-threshold, threshold]
- ``clip_l2_per_layer``: g * threshold / ||layer|| where ||layer|| > threshold, else g
- ``clip_l2_per_param_type``: g * threshold / ||g|| where ||g|| > threshold, else g

It runs on the gradients the updater steps (the float32 masters where there are some),
after a loss scaler has unscaled them and after a parallel trainer has averaged them, and
before the updater adds L2 (DL4J's order). Everything is device math: norms and the
"where" stay tensors, so a step never waits for the GPU.
"""

from __future__ import annotations

import torch

from dl4py.config.graph import GraphConfig
from dl4py.config.network import NetworkConfig

# DL4J replaces a zero norm by this before dividing (0/0 would be NaN).
_ZERO_NORM = 1e-5


class GradientNormalizer:
    """``normalize()`` applies each layer's mode to its parameters' current gradients."""

    def __init__(self, layers: list[tuple[str, float, list[torch.nn.Parameter]]]):
        self.layers = layers  # (mode, threshold, parameters) per layer with a mode

    def normalize(self) -> None:
        with torch.no_grad():
            for mode, threshold, params in self.layers:
                grads = [p.grad for p in params if p.grad is not None]
                if grads:
                    _MODES[mode](grads, threshold)


def gradient_normalizer(model) -> GradientNormalizer | None:
    """The model's normalizer, or None where no layer normalizes (nothing to do per step).

    Layers come from a MultiLayerNetwork's config; the parameters are those the optimizer
    updates (float32 masters under 16-bit precisions), in the module's ``<layer index>.``
    naming. Other models (TorchModel) have no per-layer config and are not normalized.
    """
    config = getattr(model, "config", None)
    if not isinstance(config, (NetworkConfig, GraphConfig)):  # a graph's module yields its layers in order
        return None
    module = model.stepped_module
    layers = []
    for layer, layer_module in zip(config.layers, module):
        mode, threshold = layer_setting(config, layer)
        params = [p for p in layer_module.parameters() if p.requires_grad]
        if mode != "none" and params:
            layers.append((mode, threshold, params))
    return GradientNormalizer(layers) if layers else None


def layer_setting(config, layer) -> tuple[str, float]:
    """(mode, threshold) of ``layer``: its own where set, else the network's (DL4J's rule)."""
    mode = getattr(layer, "gradient_normalization", None) or config.gradient_normalization
    threshold = getattr(layer, "gradient_normalization_threshold", None)
    return mode, config.gradient_normalization_threshold if threshold is None else threshold


def _norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all ``grads`` together, as a float32 (or float64) device tensor."""
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))


def _renormalize_per_layer(grads, threshold) -> None:
    norm = _norm(grads)
    torch._foreach_div_(grads, torch.where(norm == 0, _ZERO_NORM, norm))


def _renormalize_per_param_type(grads, threshold) -> None:
    norms = torch.stack(torch._foreach_norm(grads))
    divisors = torch.where(norms == 0, _ZERO_NORM, norms)
    torch._foreach_div_(grads, list(divisors.unbind()))


def _clip_element_wise(grads, threshold) -> None:
    torch._foreach_clamp_min_(grads, -threshold)
    torch._foreach_clamp_max_(grads, threshold)


def _clip_per_layer(grads, threshold) -> None:
    norm = _norm(grads)
    # threshold/norm only where the norm is over the threshold: no division by 0 is used
    torch._foreach_mul_(grads, torch.where(norm > threshold, threshold / norm, 1.0))


def _clip_per_param_type(grads, threshold) -> None:
    norms = torch.stack(torch._foreach_norm(grads))
    factors = torch.where(norms > threshold, threshold / norms, 1.0)
    torch._foreach_mul_(grads, list(factors.unbind()))


_MODES = {
    "renormalize_l2_per_layer": _renormalize_per_layer,
    "renormalize_l2_per_param_type": _renormalize_per_param_type,
    "clip_element_wise_absolute_value": _clip_element_wise,
    "clip_l2_per_layer": _clip_per_layer,
    "clip_l2_per_param_type": _clip_per_param_type,
}
