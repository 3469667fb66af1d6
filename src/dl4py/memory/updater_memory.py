"""The scratch tensors PyTorch's optimizers allocate during an update.

How many depends on the implementation PyTorch picks. The for-loop one works one
parameter tensor at a time, so its scratch is a few copies of the largest tensor. The
foreach one works on a whole parameter group at once, so its scratch is copies of the
group. The fused one (SGD, Adam, AdamW) has none. Which one a model uses is the
environment's ``fused_optimizer`` setting (``nn.optimizers.optimizer_kernel``). The counts
below are read off torch.optim's ``_single_tensor_*`` and ``_multi_tensor_*`` functions:
coupled L2 (``grad + l2 * w``) makes a copy of the gradient; Nesterov makes another in
the for-loop form; Adam's denominator ``sqrt(v) / c`` makes two in the for-loop form and
one in foreach (after it has freed the decayed copy); RMSProp's ``sqrt(v)`` one.
"""

from __future__ import annotations

import torch

from dl4py.backend.cuda_environment import environment
from dl4py.config.updaters import Adam, AdamW, Nesterovs, RmsProp, Sgd, Updater
from dl4py.errors import ConfigError
from dl4py.nn.optimizers import optimizer_kernel

IMPLEMENTATIONS = ("loop", "foreach", "fused")


def optimizer_implementation(requested: str, updater: Updater, device_type: str, loss_scaling: bool) -> str:
    """The implementation a model built now would use (``auto``: what the environment's
    ``fused_optimizer`` setting picks for this updater and device), or the one requested."""
    if requested == "auto":
        return optimizer_kernel(environment().fused_optimizer, updater, torch.device(device_type), loss_scaling)
    if requested not in IMPLEMENTATIONS:
        raise ConfigError("optimizer", f"must be auto or one of {', '.join(IMPLEMENTATIONS)}, got {requested!r}")
    return requested


def update_temporaries(updater: Updater, implementation: str, tensors: list[tuple[int, float]],
                       itemsize: int) -> int:
    """Peak scratch bytes of one update; ``tensors`` are (elements, coupled L2) pairs in the
    order the optimizer holds them. It steps one param group (one L2 value) at a time."""
    if implementation == "fused" or not tensors:
        return 0
    groups: dict[float, list[int]] = {}
    for elements, l2 in tensors:
        groups.setdefault(l2, []).append(elements)
    peak = 0
    for l2, sizes in groups.items():
        copies = _copies(updater, l2, per_tensor=implementation == "loop")
        if implementation == "loop":
            # Adam's denominator and RMSProp's sqrt of the previous tensor live on until
            # the loop's next assignment replaces them.
            carried = 1 if isinstance(updater, (Adam, RmsProp)) else 0
            previous = [0] + sizes[:-1]
            peak = max(peak, max(copies * n + carried * p for n, p in zip(sizes, previous)))
        else:
            peak = max(peak, copies * sum(sizes))
    return peak * itemsize


def _copies(updater: Updater, l2: float, per_tensor: bool) -> int:
    decay = 1 if l2 > 0 and not isinstance(updater, AdamW) else 0
    if isinstance(updater, Nesterovs):
        return decay + (1 if per_tensor and updater.momentum > 0 else 0)
    if isinstance(updater, Adam):  # AdamW included: it decays the weights in place
        # foreach Adam frees its decayed gradients before it takes sqrt(v)
        return decay + 2 if per_tensor else max(decay, 1)
    if isinstance(updater, RmsProp):
        return decay + 1
    if isinstance(updater, Sgd):
        return decay
    raise TypeError(f"the memory estimator has no rule for updater {type(updater).__name__}")
