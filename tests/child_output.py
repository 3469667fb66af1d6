"""A child process's first line of output, read within a bound: a child that prints nothing
fails the test instead of hanging it."""

from __future__ import annotations

import threading


def first_line(process, seconds: float, what: str = "the process") -> str:
    """The first line ``process`` prints on its stdout, or fail after ``seconds``."""
    found = []
    reader = threading.Thread(target=lambda: found.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(seconds)
    if found and found[0]:
        return found[0]
    errors = process.stderr.read() if process.stderr is not None and process.poll() is not None else ""
    raise AssertionError(f"{what} printed nothing within {seconds:g} s{': ' + errors if errors else ''}")
