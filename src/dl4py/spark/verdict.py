"""The driver's one line when a Spark fit fails: which rank ended first, and how.

From what the ranks said of themselves (``reports.py``), most telling first:

1. a rank's own error (``RankFailed``, ERROR or USER_ERROR), as a spawned worker's report;
2. a rank that died: its connection ended without a last word (``RankLost``), or it was
   stopped because its Spark task ended under it (TASK_GONE). Named by what ended first:
   its Spark task's Python worker or torchrun (looked at on the rank's machine when that
   is the driver's), else its own process, with the signal or exit code its parent saw
   (``RankExited``);
3. a rank asked to stop (STOPPED: the message names who asked);
4. a rank that only lost its peers (LOST_PEER).

Within one of these the first to arrive is the cause; the other ranks "stopped as well",
and their tracebacks go to the debug log, never to the terminal.
"""

from __future__ import annotations

import logging

from dl4py.errors import WorkerError
from dl4py.parallel.processes import exit_description
from dl4py.spark.reports import (ERROR, LOST_PEER, STOPPED, TASK_GONE, USER_ERROR, RankExited, RankFailed,
                                 RankFinished, RankLost, RankStarted, ended_above)

log = logging.getLogger("dl4py")

DIED = "died"
ORDER = {ERROR: 0, USER_ERROR: 0, DIED: 1, TASK_GONE: 1, STOPPED: 2, LOST_PEER: 3}


class RankOutcomes:
    """What the driver has heard of how its ranks ended, in the order it heard it."""

    def __init__(self):
        self.ends: dict[int, RankFailed | RankLost] = {}  # each rank's first word on its end
        self.exits: dict[int, RankExited] = {}

    def take(self, message) -> bool:
        """Keep ``message`` when it is a rank's word on itself; False for anything else."""
        if isinstance(message, RankFailed):
            self.ends.setdefault(message.rank, message)
        elif isinstance(message, RankLost):
            self.ends.setdefault(message.processes.rank, message)
        elif isinstance(message, RankExited):
            self.exits[message.rank] = message
        elif not isinstance(message, (RankStarted, RankFinished)):
            return False
        return True

    def cause_known(self) -> bool:
        """A rank failed or died of its own: stop the others, nothing better will come."""
        return any(_kind(end) in (ERROR, USER_ERROR, DIED, TASK_GONE) for end in self.ends.values())

    def error(self) -> WorkerError | None:
        """The root cause, as one line (a bug of dl4py's own keeps its traceback)."""
        if not self.ends:
            return None
        arrival = {rank: index for index, rank in enumerate(self.ends)}
        rank = min(self.ends, key=lambda r: (ORDER[_kind(self.ends[r])], arrival[r]))
        for other, end in self.ends.items():
            if other != rank and isinstance(end, RankFailed):
                log.debug("Spark rank %d stopped after rank %d (%s): %s", other, rank, end.kind, end.detail)
        end = self.ends[rank]
        if isinstance(end, RankLost):
            device, detail = end.processes.device, _lost(end, self.exits.get(rank))
        else:
            device, detail = end.device, _failed(end)
        others = sorted(r for r in self.ends if r != rank)
        if others:
            detail += f" (then worker{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} stopped as well)"
        return WorkerError(rank, device, detail)


def _kind(end: RankFailed | RankLost) -> str:
    return DIED if isinstance(end, RankLost) else end.kind


def _lost(lost: RankLost, exited: RankExited | None) -> str:
    above = ended_above(lost.gone)
    if above is not None:
        return above
    pid = lost.processes.pid
    if exited is None:
        return f"its process (pid {pid}) ended without reporting an error"
    if exited.exitcode < 0:
        return f"its process (pid {pid}) {exit_description(exited.exitcode)}"
    return f"its process (pid {pid}) exited with code {exited.exitcode} without reporting an error"


def _failed(failed: RankFailed) -> str:
    if failed.kind == ERROR:
        return f"raised an exception:\n{failed.detail}"
    if failed.kind == LOST_PEER:
        last = failed.detail.strip().splitlines()[-1] if failed.detail.strip() else "its connection failed"
        return f"lost a peer, which went away without a report of its own (look at the executors' logs): {last}"
    return failed.detail
