"""Updater config -> torch optimizer, with DL4J's L2 placement (weights only, per layer).

torch has three implementations of each optimizer, equal within floating-point rounding:
the per-parameter for-loop, the multi-tensor ``foreach`` one, and for SGD, Adam and AdamW a
``fused`` kernel (one launch for all parameters, on CUDA and on CPU). The environment's
``fused_optimizer`` setting picks one (``optimizer_kernel``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from dl4py.config.layers import BatchNormalization
from dl4py.config.layers_extra import LayerNormalization
from dl4py.config.network import NetworkConfig
from dl4py.config.updaters import Adam, AdamW, Nesterovs, RmsProp, Sgd, Updater
from dl4py.errors import BackendError

_FUSED_UPDATERS = (Sgd, Nesterovs, Adam)  # AdamW is an Adam; RMSprop has no fused kernel
# torch's fused SGD writes its momentum buffers on steps a loss scaler skips (an fp16
# overflow), uninitialised on the first: the weights then blow up. Fused Adam/AdamW skip
# such steps cleanly. Measured on torch 2.13; a known torch problem.
_SCALING_UNSAFE = (Sgd, Nesterovs)
_KERNEL_FLAGS = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def param_groups(config: NetworkConfig, module: nn.Sequential) -> list[dict]:
    """One group per distinct L2 value. Biases and batch- and layer-norm parameters get no L2 (DL4J's
    default); a FrozenLayer's parameters are in no group, so the updater keeps no state for them."""
    groups: dict[float, list[torch.nn.Parameter]] = {}
    decayed = isinstance(config.updater, AdamW)
    for layer, layer_module in zip(config.layers, module):
        layer_l2 = getattr(layer, "l2", None)
        l2 = config.l2 if layer_l2 is None else layer_l2
        if decayed:
            l2 = config.updater.weight_decay
        for name, param in layer_module.named_parameters():
            if not param.requires_grad:  # a FrozenLayer's: no updater state, no L2
                continue
            # "weight", a recurrent layer's "weight_ih_l0" / "weight_hh_l0", and a peephole LSTM's
            # "peephole_*" (DL4J keeps them in the recurrent weights RW, which its L2 reaches); never a bias.
            is_weight = (name.rsplit(".", 1)[-1].startswith(("weight", "peephole"))
                         and not isinstance(layer, (BatchNormalization, LayerNormalization)))
            groups.setdefault(l2 if is_weight else 0.0, []).append(param)
    return [{"params": params, "weight_decay": l2} for l2, params in groups.items()]


def optimizer_kernel(setting: str, updater: Updater, device: torch.device, loss_scaling: bool = False) -> str:
    """``"fused"``, ``"foreach"`` or ``"loop"``: which implementation steps the parameters.

    ``auto``: fused where torch has a sound kernel for the updater on the device (not SGD
    under loss scaling), else foreach; ``on``: fused, a BackendError where it is not to be
    had; ``off``: the for-loop, the reference the others are tested against.
    """
    if setting == "off":
        return "loop"
    name = type(updater).__name__
    if not isinstance(updater, _FUSED_UPDATERS):
        why = f"torch has no fused kernel for {name} (it has them for Sgd, Nesterovs, Adam and AdamW)"
    elif device.type not in _fused_devices():
        why = f"torch has no fused {name} kernel on {device.type}"
    elif loss_scaling and isinstance(updater, _SCALING_UNSAFE):
        why = (f"torch's fused {name} corrupts its momentum on the steps a loss scaler skips, and "
               "this precision scales the loss (half, mixed-fp16)")
    else:
        return "fused"
    if setting == "on":
        raise BackendError(
            f"environment setting fused_optimizer=on, but {why}; set it to auto (fused where "
            "that is sound, else the multi-tensor implementation) or off"
        )
    return "foreach"


def _fused_devices() -> tuple[str, ...]:
    try:  # torch's own list; private, so with a fallback for versions that move it

        return tuple(_get_fused_kernels_supported_devices())
    except ImportError:
        return ("cuda", "cpu")


def make_optimizer(updater: Updater, groups, kernel: str = "loop") -> torch.optim.Optimizer:
    lr, flags = updater.learning_rate, _KERNEL_FLAGS[kernel]
    if isinstance(updater, Nesterovs):
        return torch.optim.SGD(groups, lr=lr, momentum=updater.momentum, nesterov=updater.momentum > 0, **flags)
    if isinstance(updater, Sgd):
        return torch.optim.SGD(groups, lr=lr, **flags)
    if isinstance(updater, AdamW):
        return torch.optim.AdamW(groups, lr=lr, betas=(updater.beta1, updater.beta2), eps=updater.epsilon, **flags)
    if isinstance(updater, Adam):
        return torch.optim.Adam(groups, lr=lr, betas=(updater.beta1, updater.beta2), eps=updater.epsilon, **flags)
    if isinstance(updater, RmsProp):
        return torch.optim.RMSprop(groups, lr=lr, alpha=updater.rms_decay, eps=updater.epsilon, **flags)
    raise TypeError(f"no optimizer for updater {type(updater).__name__}")
