"""channels_last: convolution tensors stored as NHWC instead of NCHW.

cuDNN's tensor-core convolutions work in NHWC; with NCHW tensors every convolution pays
for transposes around the kernel (and in fp16/bf16 those dominate small networks). On a
CPU, oneDNN's float32 convolutions are faster in NHWC too: a training step of the seed
LeNet took half the time at one thread, the small VGG 0.8x, the residual graph 0.7x
(docs/performance.md).
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


def use_channels_last(setting: str, module: nn.Module, device: torch.device, sixteen_bit: bool = False) -> bool:
    """The environment's ``channels_last`` for this module on this device.

    ``auto``: on for networks with 2-D convolutions on CUDA, where cuDNN's tensor-core
    kernels work in NHWC, and on a CPU whose convolutions run in oneDNN (mkldnn) in float32 or
    float64 (``sixteen_bit``: the precision computes in float16 or bfloat16, whose CPU
    convolutions are not measured in NHWC: ``nn/convolution.py`` may run them in float32
    chunks) and without a layer normalization of a convolution's output; ``on``: on for any
    device, an error for a network without convolutions (nothing to convert); ``off``: never.
    """
    if setting == "off":
        return False
    weights = [p for p in module.parameters() if p.dim() == 4]
    if setting == "on" and not weights:
        raise BackendError(
            "environment setting channels_last=on, but this network has no 2-D convolutions, "
            "so there is nothing to store channels-last; set it to auto or off"
        )
    if not weights or setting == "on" or device.type == "cuda":
        return bool(weights)
    # A layer normalization of a convolution's output (GroupNorm over one group) keeps a copy
    # of its NHWC input for the backward pass, a quarter more memory in the cases measured, which
    # the memory estimate's CPU rules (exact in NCHW) would not see: such networks stay NCHW.
    normalized = any(isinstance(m, nn.GroupNorm) for m in module.modules())
    return device.type == "cpu" and torch.backends.mkldnn.is_available() and not sixteen_bit and not normalized


def to_channels_last(x: torch.Tensor) -> torch.Tensor:
    """An image batch ``[n, c, h, w]`` in channels_last; other tensors as they are."""
    return x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x
