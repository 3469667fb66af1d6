"""What each rank tells the driver about itself, beside rank 0's training events.

A rank's process tree under TorchDistributor, top down: Spark's Python worker (the task)
-> ``torch_run_process_wrapper`` -> torchrun's agent -> the rank's parent (``train.py``,
which only watches: ``supervisor.py``) -> the rank's process, which trains.

Rank -> driver, on the rank's own connection (``events.DriverLine``), in this order:

- ``RankStarted``: where the rank runs: host, device, and its processes (``TaskProcesses``);
- rank 0 only: its training events (``parallel/messages.py``), as a spawned worker 0 sends them;
- its last word: ``RankFinished`` (it trained to the end) or ``RankFailed`` (its error, and
  whether that error is its own or only the echo of another rank's end).

Rank's parent -> driver, on a connection of its own: ``RankExited`` when the rank's process
ended badly (killed by a signal, an exit code), which the process itself could not say.

The driver's ``EventServer`` adds ``RankLost`` when a rank's connection ends without a last
word: its process died, and with it what it would have said. ``verdict.py`` names the cause.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, replace

from dl4py.process_guard import running

# RankFailed.kind, in the order a cause is looked for: the rank's own error (a bug; a problem
# with the data or settings) first; its Spark task ending under it; a stop it was asked for;
# last, a peer that went away, which only echoes another rank's end.
ERROR, USER_ERROR, TASK_GONE, STOPPED, LOST_PEER = "error", "user error", "task gone", "stopped", "lost peer"


@dataclass(frozen=True)
class TaskProcesses:
    """A rank's process and the processes above it on ``host`` (None: not found)."""

    rank: int
    host: str
    device: str  # as WorkerError names it: "cpu on HOST", "cuda:0 on HOST"
    pid: int
    parent_pid: int | None = None  # the rank's parent, which torchrun started
    torchrun_pid: int | None = None
    worker_pid: int | None = None  # Spark's Python worker, which runs the task
    pid_space: str = ""  # where these pids mean these processes (``pid_space()``)

    @classmethod
    def above(cls, rank: int, device: str) -> "TaskProcesses":
        """Those of the process torchrun started (this one), read from ``/proc``; ``pid``
        is this process's until the rank's own is known (``of_rank``)."""
        torchrun = os.getppid()
        wrapper = _parent(torchrun)
        started_by_spark = wrapper is not None and b"torch_run_process_wrapper" in _cmdline(wrapper)
        host = socket.gethostname()
        return cls(rank, host, f"{device} on {host}", os.getpid(), None, torchrun,
                   _parent(wrapper) if started_by_spark else None, pid_space())

    def of_rank(self, pid: int) -> "TaskProcesses":
        """The same processes, with ``pid`` the rank's own, started by this one."""
        return replace(self, pid=pid, parent_pid=self.pid)

    def named(self) -> list[tuple[str, int]]:
        """(what, pid), outermost first: when one ends, the ones below it are ended for it."""
        found = [("Spark task's Python worker", self.worker_pid), ("torchrun", self.torchrun_pid),
                 ("parent process", self.parent_pid), ("process", self.pid)]
        return [(what, pid) for what, pid in found if pid is not None]

    def gone(self) -> tuple[tuple[str, int], ...]:
        """Those that no longer run (seen from where their pids mean them; elsewhere: none)."""
        if not self.pid_space or self.pid_space != pid_space():
            return ()
        return tuple((what, pid) for what, pid in self.named() if not running(pid))


@dataclass(frozen=True)
class RankStarted:
    processes: TaskProcesses


@dataclass(frozen=True)
class RankFinished:
    rank: int


@dataclass(frozen=True)
class RankFailed:
    rank: int
    device: str
    detail: str  # the message alone for a problem with the data or settings, else the traceback
    kind: str  # ERROR, USER_ERROR, TASK_GONE, STOPPED or LOST_PEER


@dataclass(frozen=True)
class RankExited:
    rank: int
    pid: int
    exitcode: int  # as multiprocessing's: -N for signal N


@dataclass(frozen=True)
class RankLost:
    """Added by the driver: the connection of the rank of ``processes`` ended without a last
    word; ``gone``: which of them no longer ran at that moment."""

    processes: TaskProcesses
    gone: tuple = ()


def ended_above(gone) -> str | None:
    """When Spark's side of a task is among ``gone`` (its Python worker, torchrun), the
    outermost: the rank was only ended for it, by torchrun or by a parent's death signal."""
    for what, pid in gone:
        if what in ("Spark task's Python worker", "torchrun"):
            return f"its {what} (pid {pid}) died, which ended the rank"
    return None


def pid_space() -> str:
    """This machine's boot and this process's pid namespace: two processes that share it see
    the same process behind a pid (a host name alone does not say so: containers)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return f"{boot.read().strip()} {os.readlink('/proc/self/ns/pid')}"
    except OSError:  # no /proc: the host name is all there is
        return socket.gethostname()


def _parent(pid: int | None) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return int(stat.read().rsplit(b")", 1)[-1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read()
    except OSError:
        return b""
