"""The processes a test started, seen with psutil: to check that none is left behind.

``started_processes()`` is this process's living descendants, less multiprocessing's helpers
(the forkserver and resource tracker a pool or ``run_ranks`` keeps for the whole session);
compare it before and after. ``living(pids)`` is those of ``pids`` still running after a few
seconds' grace, for processes that are no longer this one's descendants (a killed parent's).
"""

from __future__ import annotations

import psutil

SESSION_HELPERS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")
GRACE_S = 5.0


def started_processes() -> set[int]:
    found = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if _running(child) and not any(helper in " ".join(child.cmdline()) for helper in SESSION_HELPERS):
                found.add(child.pid)
        except psutil.NoSuchProcess:
            continue
    return found


def living(pids) -> list[int]:
    processes = []
    for pid in pids:
        try:
            processes.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(processes, timeout=GRACE_S)
    return [p.pid for p in alive if _running(p)]


def _running(process: psutil.Process) -> bool:
    """A zombie (dead, not yet reaped by its parent) counts as gone."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
