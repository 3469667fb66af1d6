"""A queue of experiment processes feeding free device slots.

Each experiment is a process of its own, so a crash (a segfault, the OOM killer, a
CUDA error) takes down that experiment only; it is recorded with its exit code or
signal and the last line it printed. Each process leads its own process group, so the
sweep, not the terminal, decides how it stops: Ctrl-C (or SIGTERM) on the sweep sends
one SIGINT to every experiment's group (``dl4py train`` then stops after the current
step and keeps a checkpoint), waits ``grace`` seconds, then kills what is left.
On Linux an experiment also gets SIGTERM when the sweep dies (``dl4py.process_guard``),
so killing the sweep outright leaves no orphan writing into the sweep folder: the
experiment stops after its current step, keeps a checkpoint and exits, and its parallel
workers die with it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dl4py.process_guard import command_dying_with_parent
from dl4py.sweep.slots import Slot


@dataclass
class Job:
    name: str
    command: Callable[[Slot], list[str]]  # argv for the slot it lands on
    log: Path  # stdout and stderr, together


@dataclass
class Outcome:
    name: str
    status: str  # "completed", "failed" or "interrupted"
    seconds: float
    returncode: int | None = None
    error: str | None = None
    slot: str | None = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class ProcessQueue:
    """Run ``jobs`` on ``slots``, at most one job per slot; ``on_change(event, job_name, outcome)``
    is called when a job starts (``"start"``, outcome None) and when it ends (``"end"``).
    ``succeeded(job_name, returncode)`` decides "completed" against "failed".

    ``more()``, when given, is asked for a further job each time a slot is free and ``jobs``
    is used up (a search that picks the next point from the results so far); its first None
    ends the asking. ``watch(queue)`` is called after every poll, and may ``stop`` a job."""

    def __init__(self, jobs: list[Job], slots: list[Slot], on_change: Callable, env: dict | None = None,
                 succeeded: Callable[[str, int], bool] | None = None, grace: float = 30.0, poll: float = 0.1,
                 more: Callable[[], Job | None] | None = None, watch: Callable[[ProcessQueue], None] | None = None):
        self.pending = list(jobs)
        self.slots, self.on_change, self.grace, self.poll = slots, on_change, grace, poll
        self.more, self.watch = more, watch
        self.env = dict(os.environ if env is None else env)
        self.succeeded = succeeded or (lambda name, code: code == 0)
        self.running: dict[str, tuple[subprocess.Popen, Slot, float]] = {}
        self.logs: dict[str, Path] = {}
        self.stopping: dict[str, tuple[str, float]] = {}  # job -> (its status once ended, when to kill it)
        self.interrupted = False

    def run(self) -> None:
        """Until every job has ended, or Ctrl-C / SIGTERM (then ``self.interrupted`` is set)."""
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # `kill` stops it like Ctrl-C
        try:
            while self.pending or self.running or self.more is not None:
                self._fill()
                time.sleep(self.poll)
                self._reap()
                if self.watch is not None:
                    self.watch(self)
                self._kill_overdue()
        except KeyboardInterrupt:
            self.interrupted = True
            self._stop()
        finally:
            self._kill_all()  # nothing outlives the sweep, even on an unexpected error
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    def _fill(self) -> None:
        busy = {slot for _, slot, _ in self.running.values()}
        for slot in self.slots:
            if slot in busy:
                continue
            job = self._next_job()
            if job is None:
                return
            job.log.parent.mkdir(parents=True, exist_ok=True)
            with open(job.log, "wb") as log:
                proc = subprocess.Popen(
                    command_dying_with_parent(job.command(slot)), stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT, env=slot.environ(self.env), start_new_session=True,
                )
            self.running[job.name] = (proc, slot, time.perf_counter())
            self.logs[job.name] = job.log
            self.on_change("start", job.name, None)

    def _reap(self, status_if_failed: str = "failed") -> None:
        for name, (proc, slot, started) in list(self.running.items()):
            code = proc.poll()
            if code is None:
                continue
            del self.running[name]
            ok = self.succeeded(name, code)
            stopped = self.stopping.pop(name, None)
            if not ok and stopped is not None:  # ended as asked; a job done before the signal stays completed
                outcome = Outcome(name, stopped[0], time.perf_counter() - started, code, None, slot.name)
                self.on_change("end", name, outcome)
                continue
            outcome = Outcome(
                name, "completed" if ok else status_if_failed, time.perf_counter() - started, code,
                None if ok else describe_failure(code, self.logs[name]), slot.name,
            )
            self.on_change("end", name, outcome)

    def stop(self, name: str, status: str) -> None:
        """Ask one running job to stop as Ctrl-C would (``dl4py train`` keeps a checkpoint and
        writes its result.json); it ends with ``status``, or is killed after ``grace`` seconds."""
        if name not in self.running or name in self.stopping:
            return
        self.stopping[name] = (status, time.monotonic() + self.grace)
        _signal_group(self.running[name][0], signal.SIGINT)

    def _next_job(self) -> Job | None:
        if self.pending:
            return self.pending.pop(0)
        job = self.more() if self.more is not None else None
        if job is None:
            self.more = None
        return job

    def _kill_overdue(self) -> None:
        now = time.monotonic()
        for name, (_, deadline) in list(self.stopping.items()):
            if name in self.running and now > deadline:
                _signal_group(self.running[name][0], signal.SIGKILL)

    def _stop(self) -> None:
        self._signal_all(signal.SIGINT)
        deadline = time.monotonic() + self.grace
        try:
            while self.running and time.monotonic() < deadline:
                time.sleep(self.poll)
                self._reap("interrupted")
        except KeyboardInterrupt:  # a second Ctrl-C: stop waiting
            pass
        self._kill_all()
        self._reap("interrupted")

    def _signal_all(self, sig: int) -> None:
        for proc, _, _ in self.running.values():
            _signal_group(proc, sig)

    def _kill_all(self) -> None:
        if not self.running:
            return
        self._signal_all(signal.SIGKILL)
        for proc, _, _ in self.running.values():
            proc.wait()
        self._reap("interrupted")


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the whole group: parallel workers of the experiment too
    except (ProcessLookupError, PermissionError):
        pass


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def describe_failure(code: int, log: Path) -> str:
    """``dl4py train``'s own error line if it printed one, else the exit code or signal and the last line."""
    last, error = last_lines(log)
    if error:
        return error
    if code < 0:
        try:
            how = f"killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"killed by signal {-code}"
    else:
        how = f"exit code {code}"
    return f"{how}: {last}" if last else how


def last_lines(log: Path, tail: int = 16384) -> tuple[str, str | None]:
    """(the last non-empty line, the message of the last ``... error: ...`` line) of a log."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail))
            lines = [line.strip() for line in f.read().decode("utf-8", "replace").splitlines() if line.strip()]
    except OSError:
        return "", None
    error = next((line.split(" error: ", 1)[1] for line in reversed(lines)
                  if line.startswith("dl4py ") and " error: " in line), None)
    return (lines[-1] if lines else ""), error
