"""The console of a ``dl4py`` command: one format for dl4py's lines and for those of the
libraries it drives.

dl4py's own lines are the message alone. MLflow, its database migrations (alembic) and
uvicorn and Optuna would each print in their own format (a date and ``INFO mlflow.store...:``,
``INFO  [alembic.runtime.migration]``, ``INFO:     ``), through handlers of their own.
In a command their loggers hand every record to the command's one handler instead, which
names the library before the message (``mlflow: ...``, ``uvicorn: ...``); the migration
steps a new MLflow store runs (a dozen lines) are kept below warnings. A program that uses
dl4py as a library keeps its own logging set-up: nothing here runs unless a command asked.
"""

from __future__ import annotations

import logging

# Loggers that install their own handlers; alembic, sqlalchemy.engine and huey are MLflow's store's.
ROUTED = ("mlflow", "uvicorn", "uvicorn.error", "uvicorn.access", "alembic", "sqlalchemy.engine", "huey", "optuna")
# Warnings and errors only: the migration steps of a new MLflow store, and Optuna's line per
# trial, which the sweep's own progress line already tells.
QUIET = ("alembic", "sqlalchemy.engine", "huey", "optuna")
OWN = ("dl4py", "root")

_console_configured = False  # a dl4py command set the console up (configure_console_logging)


class ConsoleFormatter(logging.Formatter):
    """The message alone for dl4py's records; another library's with its name first."""

    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        library = record.name.split(".", 1)[0]
        return message if library in OWN else f"{library}: {message}"


def configure_console_logging(stream) -> None:
    """Information and up to ``stream`` in dl4py's format, foreign loggers routed through it.
    Leaves a root logger that already has handlers (an embedding program's, pytest's) as it is."""
    global _console_configured
    handler = logging.StreamHandler(stream)
    handler.setFormatter(ConsoleFormatter("%(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    _console_configured = True
    route_foreign_loggers()


def route_foreign_loggers() -> None:
    """In a command, the libraries' loggers to the command's handler. Called again after
    importing a library that configures its loggers on import (MLflow and Optuna do)."""
    if not _console_configured:
        return
    for name in ROUTED:
        logger = logging.getLogger(name)
        logger.handlers = []  # no format of its own
        logger.propagate = True
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)
