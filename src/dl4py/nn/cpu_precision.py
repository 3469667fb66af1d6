"""Whether a 16-bit precision policy is slow on this CPU, and what to use instead.

A 16-bit policy (``half``, ``bfloat16``, ``mixed-fp16``, ``mixed-bf16``) is fast on a CPU only
where the CPU has native instructions for its 16-bit type (AVX512-BF16 or AMX for bfloat16,
AVX512-FP16 for float16); elsewhere PyTorch emulates the arithmetic. On the seed LeNet that
made ``mixed-bf16`` about 0.5x float, and compiling it did not help (docs/precision.md). The
answer comes from ``nn.convolution.cpu_has_native``, the check PyTorch's own convolution makes.
"""

from __future__ import annotations

import torch

from dl4py.nn.convolution import cpu_has_native

_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def slow_dtype(precision, device: torch.device) -> torch.dtype | None:
    """The 16-bit dtype ``precision`` computes in that this CPU has no native kernels for;
    None on a GPU, for a 32/64-bit policy, or where the CPU has them."""
    if device.type != "cpu":
        return None
    for dtype in (precision.autocast_dtype, precision.param_dtype):
        if dtype in _NAMES and not cpu_has_native(dtype):
            return dtype
    return None


def slow_precision_message(precision, dtype: torch.dtype) -> str:
    """One line naming the policy, what this CPU lacks and the faster choice."""
    if dtype == torch.float16:  # "no fast float16 kernels": the phrase the float16 warning always had
        speed = "many times slower than float"
    else:
        speed = "at about half the speed of float"
    return (f"precision '{precision}' on this CPU: it has no fast {_NAMES[dtype]} kernels (no native "
            f"{_NAMES[dtype]} instructions), so this runs {speed}; use precision 'float'")
