"""Child processes bounded by a deadline: how the doctor runs what may hang.

Each child leads a process group of its own and gets SIGKILL if this process dies
(``dl4py.process_guard``). ``run_bounded`` returns when every child has exited; when one
fails, the others are killed (a rank whose peer is gone can only wait); at the deadline,
all that are left are killed. Output goes to files, not pipes: a child that fills a pipe
nobody reads blocks, and would look like the very hang this is here to catch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass

from dl4py.process_guard import command_dying_with_parent

POLL_S = 0.05
PEER_FAILED, DEADLINE = "a peer failed", "deadline"


@dataclass(frozen=True)
class Exit:
    returncode: int | None  # None: killed here
    killed: str | None  # why it was killed: PEER_FAILED or DEADLINE
    stdout: str
    stderr: str


def run_bounded(commands: list[list[str]], deadline: float, env: dict | None = None) -> list[Exit]:
    """Run ``commands`` at once until each has exited, one failed, or ``time.monotonic()``
    reaches ``deadline``; how each ended, in order. No child outlives this call."""
    with contextlib.ExitStack() as stack:
        files = [(stack.enter_context(tempfile.TemporaryFile("w+", errors="replace")),
                  stack.enter_context(tempfile.TemporaryFile("w+", errors="replace"))) for _ in commands]
        procs: list[subprocess.Popen] = []
        killed: list[str | None] = [None] * len(commands)
        try:
            for argv, (out, err) in zip(commands, files):
                procs.append(subprocess.Popen(command_dying_with_parent(argv, signal.SIGKILL), stdin=subprocess.DEVNULL,
                                              stdout=out, stderr=err, env=env, start_new_session=True))
            while any(proc.poll() is None for proc in procs):
                failed = any(proc.returncode not in (None, 0) for proc in procs)
                if failed or time.monotonic() >= deadline:
                    for index, proc in enumerate(procs):
                        if proc.poll() is None:
                            _kill(proc)
                            killed[index] = PEER_FAILED if failed else DEADLINE
                    break
                time.sleep(POLL_S)
        finally:  # also on an exception here (Ctrl-C): nothing is left running
            for proc in procs:
                if proc.poll() is None:
                    _kill(proc)
                proc.wait()
        return [Exit(None if why else proc.returncode, why, _read(out), _read(err))
                for proc, why, (out, err) in zip(procs, killed, files)]


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its group: anything it started goes too
    except ProcessLookupError:
        pass


def _read(file) -> str:
    file.seek(0)
    return file.read()
