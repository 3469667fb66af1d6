"""How much memory a device offers this process now: free CUDA memory within the allocator's
limits and the CUDA context still to come, or the host's available RAM.

The memory estimator (``memory/``) answers what a step needs; this answers what a device has,
for ``dl4py memory``, ``max_batch_size`` and the device data set's choice (``data/device.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from dl4py.backend.cuda_environment import device_cache_limit, environment
from dl4py.backend.environment_settings import parse_size
from dl4py.errors import BackendError

# Outside PyTorch's allocator, so torch.cuda.memory_allocated never shows it: the CUDA
# context with cuDNN and cuBLAS loaded lazily (CUDA 12) is typically 300-600 MiB.
CUDA_CONTEXT_BYTES = 512 * 2**20


@dataclass(frozen=True)
class DeviceMemory:
    """Memory a device offers: ``bytes``, where the figure came from, and how much of the
    CUDA context is still to come out of it, ``context_included``: True for all of it,
    False for none, or a number of bytes (``MemoryReport.needed_bytes``)."""

    bytes: int
    source: str
    device_type: str
    context_included: bool | int
    cached: int = 0  # of ``bytes``: blocks this process's allocator caches unused (reusable by it alone)


def device_memory(device: str | torch.device) -> DeviceMemory:
    """Free memory of a CUDA device as this process sees it, or available RAM for the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise BackendError(f"device {device} was named but CUDA is not available here; "
                               "give --device-memory instead (e.g. 80GB)")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise BackendError(f"device cuda:{index} does not exist: {torch.cuda.device_count()} CUDA device(s) visible")
        free, total = torch.cuda.mem_get_info(index)
        name = torch.cuda.get_device_name(index)
        source = f"cuda:{index} ({name}): {free:,} of {total:,} bytes free"
        # Blocks this process's allocator keeps cached but unused are its to reuse, though
        # CUDA counts them as taken (a second fit after the first freed its data, say).
        cached = torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)
        usable = free + cached
        if cached:
            source += f", {cached:,} more cached by this process"
        capped = _within_cache_limit(usable, total, index)
        if capped < usable:
            source += f", {capped:,} within max_device_cache"
        due = _context_still_due(free, total, usable - capped, index)
        if due:
            source += f"; {due:,} bytes of the CUDA context still to come"
        return DeviceMemory(capped, source, "cuda", due, min(cached, capped))
    if device.type == "cpu":
        available = _available_ram()
        return DeviceMemory(available, f"cpu: {available:,} bytes of RAM available", "cpu", 0)
    raise BackendError(f"cannot read the memory of device {device}; give --device-memory instead")


def fixed_budget(size: int | str, device_type: str = "cuda") -> DeviceMemory:
    """A device's total memory given as a size (``80GB``): the CUDA context comes out of it."""
    memory = parse_size(size, "--device-memory")
    context = CUDA_CONTEXT_BYTES if device_type == "cuda" else 0
    return DeviceMemory(memory, f"{memory:,} bytes given", device_type, context)


def _context_still_due(free: int, total: int, beyond_budget: int, index: int) -> int:
    """Bytes of the CUDA context that will still come out of the budget. Free memory is read
    after the context is created, but cuBLAS and cuDNN handles and lazily loaded kernels
    come later, outside the allocator: what the device holds outside this process's
    allocator so far (other processes' memory too, so on a shared GPU this errs low)
    counts as the part already paid."""
    outside_allocator = total - free - torch.cuda.memory_reserved(index)
    due = max(0, CUDA_CONTEXT_BYTES - outside_allocator)
    # Under max_device_cache the budget is the cap; the context, outside the allocator,
    # takes from the cap only what free memory above the cap (``beyond_budget``) cannot hold.
    return max(0, due - beyond_budget)


def _within_cache_limit(usable: int, total: int, index: int) -> int:
    """Of ``usable`` bytes (free, and cached unused), what this process may still take under
    the environment's max_device_cache, which bounds what its allocator reserves."""
    cap = environment().max_device_cache
    if cap is None:
        return usable
    kind, amount = device_cache_limit(cap)
    limit = amount * total if kind == "fraction" else amount
    return int(min(usable, max(int(limit) - torch.cuda.memory_allocated(index), 0)))


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
