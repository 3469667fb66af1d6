"""How many intra-op threads each CPU worker takes: the user's budget, shared out.

The budget is what this process may use: ``torch.get_num_threads()`` (which
``OMP_NUM_THREADS`` and ``torch.set_num_threads`` set), no more than the cores the process
may run on (its CPU affinity: ``taskset``, a container's cpuset). Spawned workers start
with torch's own default instead (every core), so each is told its share.

    worker_threads(cpu_workers=2)                        # budget 8: 4 each
    worker_threads(cpu_workers=2, threads_per_worker=1)  # the option wins: 1 each
"""

from __future__ import annotations

import os

import torch


def usable_cores() -> int:
    """The cores this process may run on: its affinity where the OS reports one, else all."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows: no affinity to read
        return os.cpu_count() or 1


def thread_budget() -> int:
    """The intra-op threads the user allows this process (at least 1)."""
    return max(1, min(torch.get_num_threads(), usable_cores()))


def worker_threads(cpu_workers: int, threads_per_worker: int | None = None, launched: bool = False) -> int:
    """Intra-op threads for each of ``cpu_workers`` workers on this machine's CPU.

    ``threads_per_worker`` (the option) wins. Spawned workers share this process's budget,
    at least 1 each, so that together they use no more threads than a plain fit would.

    A ``launched`` rank is itself one of the node's ``cpu_workers``, with its own budget. It
    takes ``OMP_NUM_THREADS`` when its launcher set it: torchrun sets it for several
    processes per node, and a Spark task sets it to its ``spark.task.cpus`` (one torchrun per
    task, so this node's worker count is unknown there). Otherwise it keeps its own threads,
    no more than its share of the cores (a later fit, reading what this one set, agrees)."""
    cpu_workers = max(cpu_workers, 1)
    if threads_per_worker is not None:
        return threads_per_worker
    if not launched:
        return max(1, thread_budget() // cpu_workers)
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    return max(1, min(torch.get_num_threads(), usable_cores() // cpu_workers))
