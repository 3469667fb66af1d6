"""Spark's own log of a failed task, kept off the terminal while a fit runs.

When a rank fails or dies, the fit raises one line naming it and how (``verdict.py``).
Spark logs the same failure its own way: the executor's "Exception in task" (on the
driver's terminal under a local master) and the scheduler's "Lost task", each with a JVM
stack trace and the task's Python traceback, dozens of lines that name the wrong thing
(a peer's "Connection reset"). So for the length of the fit those two loggers are
switched off, and afterwards put back exactly as they were. What they would have said is
in the job's error, which the fit logs at debug level and sums up when no rank explains
the failure. py4j's own logger likewise: when the JVM dies, each of its calls logs the
broken connection with a traceback, and the fit says instead that the JVM died (after
which it stays quiet: every later call can only fail the same way).
``DL4PY_DEBUG=1`` leaves the logging alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re

import py4j

from dl4py.spark.session import jvm_exit

log = logging.getLogger("dl4py")

PY4J_FOLDER = os.path.dirname(py4j.__file__)
TASK_FAILURE_LOGGERS = ("org.apache.spark.executor.Executor", "org.apache.spark.scheduler.TaskSetManager")
# A Python error's last line, as a task's traceback in Spark's job error ends: "ValueError: ...".
_PYTHON_ERROR = re.compile(r"^(?!(?:org|java|scala|py4j)\.)[A-Za-z_][\w.]*(?:Error|Exception|Exit)(?::.*)?$")


@contextlib.contextmanager
def quiet_failure_logs(spark):
    """Spark's task-failure loggers and py4j's switched off inside the block; put back as
    they were after it, unless the JVM died meanwhile."""
    if os.environ.get("DL4PY_DEBUG", "") not in ("", "0"):
        yield
        return
    put_back = [_switch_off_py4j(), _switch_off_task_failures(spark)]
    try:
        yield
    finally:
        if jvm_exit(spark) is None:
            for undo in put_back:
                try:
                    undo()
                except Exception as exc:  # the JVM stopped answering all the same
                    log.debug("could not put Spark's logging back: %r", exc)


def _switch_off_py4j():
    py4j_logger = logging.getLogger("py4j")
    level = py4j_logger.level
    on_root = _Py4jOnRoot()
    py4j_logger.setLevel(logging.CRITICAL)
    logging.getLogger().addFilter(on_root)

    def undo() -> None:
        py4j_logger.setLevel(level)
        logging.getLogger().removeFilter(on_root)
    return undo


class _Py4jOnRoot(logging.Filter):
    """py4j logs some of its connection errors on the root logger (``logging.info``), not
    its own: a filter on the root logger sees only what is logged there directly."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.pathname.startswith(PY4J_FOLDER)


def _switch_off_task_failures(spark):
    """Those loggers OFF (log4j 2, Spark >= 3.3); what puts them back."""
    try:
        log4j = spark.sparkContext._jvm.org.apache.logging.log4j
        context = log4j.LogManager.getContext(False)
        config = context.getConfiguration()
        # A logger without a configuration of its own is given one, and has it taken away after.
        own = {name: config.getLoggerConfig(name).getName() == name for name in TASK_FAILURE_LOGGERS}
        levels = {name: config.getLoggerConfig(name).getLevel() for name in TASK_FAILURE_LOGGERS}
        for name in TASK_FAILURE_LOGGERS:
            log4j.core.config.Configurator.setLevel(name, log4j.Level.OFF)
    except Exception as exc:  # not log4j 2 (Spark before 3.3), or Spark Connect: leave its logging be
        log.debug("could not quiet Spark's task-failure logs: %r", exc)
        return lambda: None

    def undo() -> None:
        for name in TASK_FAILURE_LOGGERS:
            if own[name]:
                log4j.core.config.Configurator.setLevel(name, levels[name])
            else:
                config.removeLogger(name)
        context.updateLoggers()
    return undo


def spark_reason(error: BaseException) -> str:
    """What a Spark job's error says went wrong in a task: the last line of the task's Python
    traceback when it carries one ("ModuleNotFoundError: No module named 'dl4py'"), else
    its first lines."""
    lines = [line.strip() for line in str(error).splitlines()]
    python = [line for line in lines if _PYTHON_ERROR.match(line)]
    if python:
        return python[-1]
    return " ".join(line for line in lines[:3] if line) or type(error).__name__
