"""A pytest plugin the gpu-tests step loads (``-p gpu_steps.failure_lines``): each failing
test's reason, in one line, printed as soon as the test is over. pytest prints its
tracebacks only at the end, and a step killed at its budget never gets there: this way the
result file says why each failure failed, whatever happens after it."""

from __future__ import annotations

import pytest

PREFIX = "gpu-check-reason:"
REASON_CHARS = 300

_config = None
_pending: list[str] = []


def pytest_configure(config) -> None:
    global _config
    _config = config


def pytest_runtest_logreport(report) -> None:
    if report.failed:
        _pending.append(f"{PREFIX} {report.nodeid} ({report.when}): {reason(report.longreprtext)}")


@pytest.hookimpl(trylast=True)  # after the verbose line "...::test_x[cuda] FAILED [ 40%]" is whole
def pytest_runtest_logfinish(nodeid, location) -> None:
    terminal = _config.pluginmanager.get_plugin("terminalreporter") if _config else None
    for line in _pending:
        if terminal is not None:
            terminal.write_line(line, flush=True)  # starts on a line of its own
        else:
            print(line, flush=True)
    _pending.clear()


def reason(longrepr: str) -> str:
    """The exception's own line: pytest marks it with "E"; the first such line is the message."""
    lines = [line.strip() for line in longrepr.splitlines() if line.strip()]
    marked = [line[1:].strip() for line in lines if line.startswith("E ")]
    return (marked[0] if marked else lines[-1] if lines else "no reason printed")[:REASON_CHARS]
