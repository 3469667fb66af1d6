"""channels_last: convolution tensors stored as NHWC instead of NCHW.

cuDNN's tensor-core convolutions work in NHWC; with NCHW tensors every convolution pays
for transposes around the kernel (and in fp16/bf16 those dominate small networks).
Converting the module converts only its 4-D tensors, the convolution weights; a
convolution whose weight is channels_last produces channels_last output, so the rest of
the network follows by itself, and a flatten reads the values in the usual order.
Results equal the default format's within floating-point rounding; saved weights are
written contiguous, so a file does not depend on the format.
"""

from __future__ import annotations

import torch
from torch import nn

from dl4py.errors import BackendError


def use_channels_last(setting: str, module: nn.Module, device: torch.device) -> bool:
    """The environment's ``channels_last`` for this module on this device.

    ``auto``: on for networks with 2-D convolutions on CUDA, where cuDNN's tensor-core
    kernels work in NHWC (on a CPU it is not known to help, so auto leaves it off); ``on``:
    on for any device, an error for a network without convolutions (nothing to convert);
    ``off``: never.
    """
    if setting == "off":
        return False
    convolutional = any(p.dim() == 4 for p in module.parameters())
    if setting == "on" and not convolutional:
        raise BackendError(
            "environment setting channels_last=on, but this network has no 2-D convolutions, "
            "so there is nothing to store channels-last; set it to auto or off"
        )
    return convolutional and (setting == "on" or device.type == "cuda")


def to_channels_last(x: torch.Tensor) -> torch.Tensor:
    """An image batch ``[n, c, h, w]`` in channels_last; other tensors as they are."""
    return x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x
