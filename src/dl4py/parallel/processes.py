"""The ParallelWrapper's worker processes: reading their messages, telling a lost peer from
a cause, and stopping them all, with nothing left behind and no Ctrl-C ending them.
(The pool that keeps them from one fit to the next is ``pool.py``.)"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import threading
import time

import torch.multiprocessing as mp

GRACE_SECONDS = 3.0
# What a worker imports before its first step, loaded once into the process the workers are
# forked from: torch, dl4py's worker, and torch._dynamo (torch.optim imports it when the first
# optimizer is made). A spawned worker spent seconds on these at every pool start.
WORKER_PRELOAD = ["dl4py.parallel.pool_worker", "torch._dynamo"]
# Signs in a worker's traceback that it failed only because a peer went away.
LOST_PEER_SIGNS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
                   "DistNetworkError", "NCCL communicator was aborted", "Socket Timeout")


def received(q, timeout: float, most: int) -> list:
    """What is waiting in ``q``: up to ``most`` messages, waiting ``timeout`` s for the first."""
    found = []
    try:
        found.append(q.get(timeout=timeout))
        while len(found) < most:
            found.append(q.get_nowait())
    except Exception:  # queue.Empty, or a queue torn down with its process
        pass
    return found


def is_lost_peer(trace: str) -> bool:
    return any(sign in trace for sign in LOST_PEER_SIGNS)


def also_stopped(rank: int, failures) -> str:
    """The line a root cause's report ends with when other workers failed after it."""
    others = sorted(r for r in failures if r != rank)
    if not others:
        return ""
    return f"\n(then worker{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} stopped as well)"


def stop_all(procs, patience: float) -> None:
    """Give the workers ``patience`` seconds to exit, then kill what still runs; nothing is
    left behind. (A worker never ends on SIGTERM, which a process group's stop sends it too:
    it only asks its fit to stop. So killing is the only way; they hold nothing that needs
    saving.)"""
    deadline = time.monotonic() + patience
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=GRACE_SECONDS)


@contextlib.contextmanager
def children_ignore_stop_signals():
    """Workers are born ignoring SIGINT and SIGTERM: an ignored signal stays ignored across
    exec, and Python installs its KeyboardInterrupt handler only over the default. Without
    this, a Ctrl-C while a worker still imports torch (seconds) would kill it before it can
    install its own handler (which turns either into a request to stop its fit). The signals are blocked here meanwhile, so one sent to this
    process in that window waits for the handler rather than being lost."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stop_signals = {signal.SIGINT, signal.SIGTERM}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in stop_signals}
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def exit_description(exitcode: int, starting: bool = False) -> str:
    """How a worker ended; ``starting``: before it ran any of dl4py's code, which in a
    spawned process means while importing the main script again."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        how = f"was killed by {name}"
    else:
        how = f"exited with code {exitcode}"
    if starting:
        return (f"{how} while starting, before it ran any of dl4py's code: its own error is printed above (a "
                'script that trains at its top level needs `if __name__ == "__main__":` around that code)')
    return how if exitcode < 0 else f"{how} without reporting an error"


def worker_context():
    """``(context, forker_pid)``: how workers are started, and the process they are forked
    from (it is their parent). On Linux a forkserver that has imported what a worker needs
    (``WORKER_PRELOAD``), started once per coordinator: a fresh worker is a fork of it, ready
    in a fraction of a second. Each worker still imports the main script (as a spawned one
    does), so a script that reaches ``fit`` from its top level is caught the same way. The
    forkserver ignores stop signals, as workers do, and ends when the coordinator does.
    Elsewhere, or with ``DL4PY_WORKER_START=spawn``: spawn, the coordinator as the parent."""
    if not sys.platform.startswith("linux") or os.environ.get("DL4PY_WORKER_START", "").lower() == "spawn":
        return mp.get_context("spawn"), os.getpid()
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(WORKER_PRELOAD)
    with children_ignore_stop_signals():
        multiprocessing.forkserver.ensure_running()
    forker = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    if forker is None:  # a Python that keeps it elsewhere: the workers' parent is unknown, so spawn
        return mp.get_context("spawn"), os.getpid()
    return ctx, forker

