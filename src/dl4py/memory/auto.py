"""``batch_size: auto``: the largest batch the estimate says fits the model's device.

The budget is the device's memory as the process sees it when training starts: free CUDA
memory within any ``max_device_cache``, plus what this process already holds (the
estimate counts the parameters itself), less the part of the CUDA context not yet paid;
or the RAM available. Parallel workers are processes of their own: they share the free
memory of the device they are placed on, each paying a whole CUDA context, while the
model stays where it is in this process. A margin stays free for what the
estimate leaves out (allocator fragmentation, cuDNN's workspaces). The training set is
counted as device-resident where it may be kept there. The batch is also at most the training
examples / 64 (/ the workers), so that an epoch makes at least 64 updates: on a machine with
much memory (a CPU's RAM) the largest batch that fits is often the whole training set, one
update an epoch. That bound never goes below 32 (Keras' default batch), nor the batch above the
training set.
No batch is chosen at which a tensor reaches 2**31 elements (``max_batch_size``).
"""

from __future__ import annotations

import logging

import torch

from dl4py.backend.cuda_environment import environment
from dl4py.errors import ConfigError
from dl4py.memory.capacity import DeviceMemory, device_memory, max_batch_size
from dl4py.memory.estimate import estimate

log = logging.getLogger("dl4py")

AUTO_MARGIN = 0.15
MIN_UPDATES_PER_EPOCH = 64
SMALLEST_AUTO_BATCH = 32


def auto_batch_size(config, device: torch.device, train_examples: int, example_bytes: int,
                    workers: int = 1, margin: float = AUTO_MARGIN) -> tuple[int, str]:
    """(batch size, a sentence saying how it was chosen)."""
    memory = device_memory(device)
    budget, context = training_budget(memory, device, workers)
    # Memory is one bound; the updates an epoch makes are the other: the largest batch that
    # fits a roomy device (a CPU's RAM) can be the whole training set, one update an epoch.
    # (Parallel workers share the examples: each makes its updates on its part.)
    # Never below Keras' default batch, though: a handful of examples a step is its own trouble.
    most_for_updates = max(SMALLEST_AUTO_BATCH, train_examples // (MIN_UPDATES_PER_EPOCH * workers))

    plan = config.training.plan()
    # A data-parallel worker's replica meets the others in a flat buffer beside its step.
    exchange = {"parallelism": plan, "workers": workers} if workers > 1 and plan.kind == "data" else {}

    def largest_with(data_bytes: int) -> int:
        return max_batch_size(config, budget, config.training.precision, device=device.type, margin=margin,
                              context=context, data_bytes=data_bytes, **exchange)

    data_bytes = train_examples * example_bytes if device.type == "cuda" and _data_may_live_on_device() else 0
    largest, data_note = largest_with(data_bytes), ""
    if data_bytes and largest < min(most_for_updates, train_examples) and environment().device_data == "auto":
        # device_data auto keeps a training set on the host when it does not fit beside the
        # step (data/device.py); a batch squeezed by a copy that will not be made helps nobody.
        host = largest_with(0)
        if host > largest:
            largest, data_note = host, f"; the training set ({data_bytes:,} bytes) stays on the host"
    if largest == 0:
        raise ConfigError(
            "training.batch_size",
            f"is auto, but not even a batch of 1 fits: {memory.source}; see `dl4py memory` for the breakdown",
        )
    chosen = min(largest, most_for_updates, train_examples)
    share = f" / {workers} workers" if workers > 1 else ""
    capped = ("" if chosen == largest else " (the whole training set)" if chosen == train_examples
              else f" ({SMALLEST_AUTO_BATCH}, the least auto takes)" if chosen == SMALLEST_AUTO_BATCH
              else f" ({train_examples:,} training examples{share} / {MIN_UPDATES_PER_EPOCH}: an epoch makes at least "
                   f"{MIN_UPDATES_PER_EPOCH} updates)")
    sharing = _workers_per_device(device, workers) if workers > 1 else 1
    shared = (f" shared by {sharing} worker processes" if sharing > 1
              else " for each worker process" if workers > 1 else "")
    elements = estimate(config, 1, config.training.precision, device=device.type).max_batch_by_elements
    bound = ", as no tensor may reach 2**31 elements" if largest == elements else ""
    why = (f"batch_size auto: {chosen:,}{capped}; the largest that fits {device}{shared} with a "
           f"{margin:.0%} margin is {largest:,}{bound}{data_note} ({memory.source})")
    log.info(why)
    return chosen, why


def training_budget(memory: DeviceMemory, device: torch.device, workers: int = 1) -> tuple[int, bool | int]:
    """(bytes one training process may use, how much CUDA context is still to come out of them).

    Training here: what this process already holds is its own (the estimate counts the
    parameters itself), and its context is partly paid. ParallelWrapper workers are spawned
    processes: this process's model stays on the device, so its bytes are not theirs, and
    each worker brings a whole context of its own.
    """
    if workers > 1:  # this process's cached blocks are no more theirs than its model
        return (memory.bytes - memory.cached) // _workers_per_device(device, workers), True
    held = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    return memory.bytes + held, memory.context_included


def _workers_per_device(device: torch.device, workers: int) -> int:
    if device.type != "cuda":
        return workers  # CPU workers share the machine's memory
    return -(-workers // max(len(environment().usable_cuda_devices()), 1))  # placed round-robin over the GPUs


def _data_may_live_on_device() -> bool:
    return environment().device_data != "off"
