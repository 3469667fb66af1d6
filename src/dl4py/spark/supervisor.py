"""A rank's process, watched by its parent: how it ended reaches the driver even when it
could say nothing itself (SIGKILL, the out-of-memory killer, a crash in native code).

torchrun starts ``train.py``, which calls ``train_task``; there ``supervise`` forks. The
child returns and trains as the rank. The parent, the process torchrun knows, only waits:
it passes torchrun's stop signals on to the child and tells the driver how the child
ended when it ended badly (``RankExited``, on a connection opened before the fork).

A process that has told the driver how its rank ended then waits for the driver to cancel
the Spark job, which ends it (``await_cancellation``): failing instead would make torchrun
print a traceback of its own, and succeeding would send torchrun to its exit barrier.
When the driver could not be told, it ends as the child did, so torchrun reports it.

The fork comes before the rank starts a thread of its own or touches a device (as torch's
forked data-loader workers do). Only on Linux: elsewhere the rank trains in the process
torchrun started, unwatched.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from dl4py.process_guard import die_with_parent

FORWARDED = (signal.SIGTERM, signal.SIGINT)  # torchrun's agent stops its workers with these
# The driver cancels the job at once when a rank's end is its own, within seconds when it
# is an echo (trainer.SETTLE_SECONDS); Spark then kills the tasks. Past this, something is
# wrong with the driver: the rank ends the loud way, which torchrun and Spark report.
CANCELLATION_SECONDS = 60.0


def supervise(on_bad_end) -> bool:
    """Fork. In the child: return True (it is the rank now). In the parent: wait for the
    child; when it did not exit with 0, call ``on_bad_end(pid, exitcode)`` (True: the
    driver has been told, so ``await_cancellation``); then end as the child did; never return.
    Without forking (not Linux): return False. Whichever process trains dies with its
    parent: no rank trains on after its task was cancelled."""
    launcher = os.getppid()  # torchrun's agent
    if not sys.platform.startswith("linux"):
        die_with_parent(launcher)
        return False
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # else what is buffered now would be written twice
    parent = os.getpid()
    child = os.fork()  # before die_with_parent's thread: fork copies only the calling thread
    if child == 0:
        die_with_parent(parent)
        return True
    die_with_parent(launcher)
    _watch(child, on_bad_end)


def _watch(child: int, on_bad_end) -> None:
    stopped = []  # the stop signals torchrun sent: then the task is ending already

    def forward(signum, frame) -> None:
        stopped.append(signum)
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    _, status = os.waitpid(child, 0)  # retried by Python when a forwarded signal interrupts it
    exitcode = os.waitstatus_to_exitcode(status)
    if exitcode != 0 and _told(on_bad_end, child, exitcode) and not stopped:
        await_cancellation()
    if exitcode < 0:  # the same death as the child's, so torchrun reports the same signal
        if -exitcode != signal.SIGKILL:
            signal.signal(-exitcode, signal.SIG_DFL)
        os.kill(os.getpid(), -exitcode)
    os._exit(exitcode if exitcode >= 0 else 128 - exitcode)  # nothing of the rank's to clean up here


def await_cancellation(seconds: float = CANCELLATION_SECONDS) -> None:
    """Wait, at most ``seconds``, for the driver to cancel the job, which ends this process
    (torchrun's SIGTERM, a parent's death signal, the Python worker's SIGHUP). Ending first
    on its own would be worse either way: with an error, torchrun prints its traceback on the
    driver's terminal; with success, torchrun waits for its peers' agents at its exit barrier,
    blocked where no stop signal reaches it, for up to 300 s after its task is gone."""
    for sig in (*FORWARDED, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    time.sleep(seconds)


def _told(on_bad_end, child: int, exitcode: int) -> bool:
    try:
        return bool(on_bad_end(child, exitcode))
    except Exception:  # the driver is gone, say: the exit status still tells torchrun
        return False
