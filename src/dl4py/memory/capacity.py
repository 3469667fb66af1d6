"""The estimator turned around: how many parameters, and how large a batch, fit.

``max_parameters`` is the seed's back-of-the-envelope question in general form: device
memory less a reserve, over the bytes each parameter costs (its value, its gradient, the
updater's copies, a float32 master for 16-bit weights). ``max_batch_size`` searches the
full estimate, activations included, for the largest batch under a budget.
"""

from __future__ import annotations

import torch

from dl4py.backend.device_memory import CUDA_CONTEXT_BYTES, DeviceMemory, device_memory, fixed_budget  # noqa: F401
from dl4py.backend.environment_settings import parse_size
from dl4py.backend.precision import resolve_precision
from dl4py.config.updaters import Nesterovs, Updater
from dl4py.errors import ConfigError
from dl4py.memory.estimate import estimate
from dl4py.parallel.sharding import UNIT_FRACTION


def bytes_per_parameter(precision: str = "float", updater: Updater | None = None, gradients: bool = True) -> int:
    """Bytes one trained parameter needs, activations aside."""
    policy = resolve_precision(precision)
    updater = updater if updater is not None else Nesterovs()
    value = torch.empty((), dtype=policy.param_dtype).element_size()
    stepped = 4 if policy.master_weights else value  # what the updater and gradients are kept in
    master = 4 if policy.master_weights else 0
    return value + master + (stepped if gradients else 0) + updater.state_copies * stepped


def max_parameters(
    memory_bytes: int | str,
    precision: str = "float",
    updater: Updater | None = None,
    reserved_bytes: int | str = 0,
    gradients: bool = True,
    shards: int = 1,
) -> int:
    """The most parameters that fit, activations aside. The seed's example, 6 GiB less a
    400 MiB reserve, parameters and momentum only, float: 752,877,568::

        max_parameters("6GiB", "float", Nesterovs(), reserved_bytes="400MiB", gradients=False)

    ``shards=N``: the most a network trained sharded over N such devices may have. Each
    device keeps 1/N of the ``b = bytes_per_parameter`` bytes of every parameter, and holds
    besides a few gathered units, none over 1/UNIT_FRACTION (16) of the parameters: in
    training 4 (the unit's parameters and full gradient, the next unit's all-gather output,
    the previous unit's reduce-scatter input; ``g`` = 3 values and a stepped gradient per
    element), in a forward alone 3 (``g`` = 3 values). So P parameters fit when
    ``P * b / N + P * g / 16 <= memory - reserved``, that is, with F = 16::

        P = (memory - reserved) * F * N // (F * b + g * N)

    N times the single-device figure less the gathered units, and never more than
    ``(memory - reserved) * 16 / g`` however many devices. (Units of up to 2^20 elements are
    never split, which only matters under 16.8 million parameters.)
    ``estimate(..., parallelism="sharded")`` answers for a given network, activations and all.
    """
    memory = parse_size(memory_bytes, "memory_bytes")
    reserved = 0 if reserved_bytes in (0, "0") else parse_size(reserved_bytes, "reserved_bytes")
    if reserved >= memory:
        raise ConfigError("reserved_bytes", f"{reserved:,} bytes leaves nothing of {memory:,}")
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ConfigError("shards", f"must be a whole number of devices, 1 or more, got {shards!r}")
    per_parameter = bytes_per_parameter(precision, updater, gradients)
    if shards == 1:
        return (memory - reserved) // per_parameter
    policy = resolve_precision(precision)
    value = torch.empty((), dtype=policy.param_dtype).element_size()
    stepped = 4 if policy.master_weights else value
    gathered = 3 * value + stepped if gradients else 3 * value  # bytes per element of a unit
    return (memory - reserved) * UNIT_FRACTION * shards // (UNIT_FRACTION * per_parameter + gathered * shards)


def max_batch_size(
    config,
    memory_bytes: int | str,
    precision: str | None = None,
    updater: Updater | None = None,
    device: str = "cuda",
    margin: float = 0.0,
    context: bool | int = True,
    limit: int = 1 << 24,
    **options,
) -> int:
    """The largest batch whose estimated training step fits in ``memory_bytes`` less a
    ``margin`` (a fraction kept free for what the estimate leaves out); 0 if none does.
    Never one at which a tensor of the step reaches 2**31 elements, which CUDA kernels
    cannot index (``MemoryReport.max_batch_by_elements``).

    ``context`` is how much of the CUDA context is still to come out of ``memory_bytes``:
    True for a card's total, the bytes ``device_memory`` says for free memory read from a
    device whose context is partly paid (``MemoryReport.needed_bytes``).
    """
    if not 0 <= margin < 1:
        raise ConfigError("margin", f"must be a fraction in [0, 1), got {margin!r}")
    budget = parse_size(memory_bytes, "memory_bytes") * (1 - margin)

    def fits(batch: int) -> bool:
        return estimate(config, batch, precision, updater, device=device, **options).needed_bytes(context) <= budget

    one = estimate(config, 1, precision, updater, device=device, **options)
    limit = min(limit, one.max_batch_by_elements)
    if limit < 1 or one.needed_bytes(context) > budget:
        return 0
    low, high = 1, 2
    while high <= limit and fits(high):  # memory grows with the batch: double, then bisect
        low, high = high, high * 2
    high = min(high, limit + 1)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


__all__ = ["CUDA_CONTEXT_BYTES", "DeviceMemory", "bytes_per_parameter", "device_memory", "fixed_budget",
           "max_batch_size", "max_parameters"]
