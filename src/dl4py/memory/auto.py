"""``batch_size: auto``: the largest batch the estimate says fits the model's device.

The budget is the device's memory as the process sees it when training starts: free CUDA
memory within any ``max_device_cache``, plus what this process already holds (the
estimate counts the parameters itself), or the RAM available; parallel workers placed on
the same device share it. A margin stays free for what the
estimate leaves out (allocator fragmentation, cuDNN's workspaces). The training set is
counted as device-resident where it may be kept there, and the batch never exceeds it.
"""

from __future__ import annotations

import logging

import torch

from dl4py.errors import ConfigError
from dl4py.memory.capacity import device_memory, max_batch_size

log = logging.getLogger("dl4py")

AUTO_MARGIN = 0.15


def auto_batch_size(config, device: torch.device, train_examples: int, example_bytes: int,
                    workers: int = 1, margin: float = AUTO_MARGIN) -> tuple[int, str]:
    """(batch size, a sentence saying how it was chosen)."""
    memory = device_memory(device)
    budget = memory.bytes
    if device.type == "cuda":
        budget += torch.cuda.memory_allocated(device)
    if workers > 1:  # workers on one device share it (each with its own CUDA context)
        budget //= _workers_per_device(device, workers)
    data_bytes = train_examples * example_bytes if device.type == "cuda" and _data_may_live_on_device() else 0
    largest = max_batch_size(config, budget, config.training.precision, device=device.type, margin=margin,
                             context=memory.context_included, data_bytes=data_bytes)
    if largest == 0:
        raise ConfigError(
            "training.batch_size",
            f"is auto, but not even a batch of 1 fits: {memory.source}; see `dl4py memory` for the breakdown",
        )
    chosen = min(largest, train_examples)
    capped = " (the whole training set)" if chosen < largest else ""
    why = (f"batch_size auto: {chosen:,}{capped}; the largest that fits {device} with a "
           f"{margin:.0%} margin is {largest:,} ({memory.source})")
    log.info(why)
    return chosen, why


def _workers_per_device(device: torch.device, workers: int) -> int:
    if device.type != "cuda":
        return workers  # CPU workers share the machine's memory
    from dl4py.backend.cuda_environment import environment

    return -(-workers // max(len(environment().usable_cuda_devices()), 1))  # placed round-robin over the GPUs


def _data_may_live_on_device() -> bool:
    from dl4py.backend.cuda_environment import environment

    return environment().device_data != "off"
