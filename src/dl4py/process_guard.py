"""Child processes die with their parent: no orphan keeps training or writing files.

Two layers, because either alone has a gap:

- Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG)``): the kernel signals the child
  the moment its parent dies, even by SIGKILL. It survives ``exec``, so a launcher can set
  it and then become another program.
- A watchdog thread that polls ``os.getppid()``: it covers systems without prctl, and a
  parent that died before the request was made (then the child already has a new parent).

Used by the ParallelWrapper's workers (``die_with_parent``, SIGKILL: a worker holds
nothing worth saving) and by ``dl4py sweep``'s experiments (``command_dying_with_parent``,
SIGTERM: ``dl4py train`` then stops after its current step and keeps a checkpoint).

This file imports only the standard library: the sweep runs it as a script, before
``exec``, where importing dl4py (and torch) would cost seconds per experiment.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
POLL_SECONDS = 0.5
ORPHANED_EXIT_CODE = 3  # what an orphaned child exits with, when it is not signalled


def set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel for ``sig`` when the parent dies; False where that is not available.

    The signal comes when the *thread* that started this process ends: start children
    from a thread that lives as long as the process (the main thread)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL, poll: float = POLL_SECONDS,
                    watch_also: int | None = None) -> None:
    """Make this process end when ``parent_pid`` does (call it first thing in the child), and
    when ``watch_also`` does: a grandparent that started this process through a server."""
    set_parent_death_signal(sig)
    if os.getppid() != parent_pid or (watch_also is not None and not running(watch_also)):
        os._exit(ORPHANED_EXIT_CODE)  # gone before the request above
    threading.Thread(target=_watch, args=(parent_pid, poll, watch_also), name="dl4py-parent-watchdog",
                     daemon=True).start()


def _watch(parent_pid: int, poll: float, watch_also: int | None) -> None:
    # An orphan is re-parented (to init or a subreaper), so a changed parent id means the
    # parent is gone. os._exit: no clean-up handler of the dying run may write anything.
    while os.getppid() == parent_pid and (watch_also is None or running(watch_also)):
        time.sleep(poll)
    os._exit(ORPHANED_EXIT_CODE)


def running(pid: int) -> bool:
    """Whether ``pid`` still runs on this machine (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc here: ask the kernel instead
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def command_dying_with_parent(argv: list[str], sig: int = signal.SIGTERM) -> list[str]:
    """``argv`` wrapped so that the process it becomes gets ``sig`` when this process dies.

    The wrapper is this file run as a script (``-I``: it sees no user paths): it asks for
    the signal, checks this process is still its parent, then ``exec``s ``argv``."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-I", os.path.abspath(__file__), str(os.getpid()), str(int(sig)), *argv]


def _launch(parent_pid: int, sig: int, argv: list[str]) -> None:
    set_parent_death_signal(sig)
    if os.getppid() != parent_pid:
        os._exit(ORPHANED_EXIT_CODE)  # the parent died before the request: do not start at all
    os.execv(argv[0], argv)


if __name__ == "__main__":
    _launch(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
