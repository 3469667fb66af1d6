"""One console format for a dl4py command: the libraries it drives (MLflow and its store's
migrations, uvicorn) print through dl4py's handler, each line named by its library, instead of
in formats of their own. Each case runs in a fresh Python, as a command does, since logging
set-up is process-wide and MLflow configures its loggers when first imported."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest

# MLflow's own line format ("2026/11/27 12:00:00 INFO mlflow.store.db.utils: ..."), alembic's
# ("INFO  [alembic.runtime.migration] ..."), uvicorn's ("INFO:     Started server process").
FOREIGN_FORMATS = re.compile(r"^(\d{4}/\d\d/\d\d \d\d:\d\d:\d\d |INFO  \[|INFO: +|WARNING: +)", re.MULTILINE)


def console_of(code: str, tmp_path) -> str:
    """stderr of ``code`` run after the console set-up of a dl4py command."""
    prelude = "import sys\nfrom dl4py.console_logging import configure_console_logging\n" \
              "configure_console_logging(sys.stderr)\n"
    done = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stderr


@pytest.mark.slow  # importing MLflow and creating its store take seconds
@pytest.mark.timeout(150)
def test_mlflow_and_its_store_migrations_print_in_dl4py_format(tmp_path):
    pytest.importorskip("mlflow")
    stderr = console_of("""
        import logging
        from dl4py.monitor import MLflowStatsStorage
        storage = MLflowStatsStorage("sqlite:///store.db", experiment="console")  # a new store: migrations run
        logging.getLogger("mlflow.tracking.test").info("a line of MLflow's")
        storage.close()
    """, tmp_path)
    assert "mlflow: a line of MLflow's" in stderr.splitlines()
    assert not FOREIGN_FORMATS.search(stderr), stderr
    assert "alembic" not in stderr  # the migration steps stay below warnings


@pytest.mark.timeout(150)
def test_uvicorn_lines_of_dl4py_serve_come_through_dl4py_format(tmp_path):
    pytest.importorskip("uvicorn")
    pytest.importorskip("starlette")
    stderr = console_of("""
        from dl4py import DenseLayer, InputType, MultiLayerNetwork, NetworkConfig, OutputLayer
        from dl4py.serve import PredictionServer
        model = MultiLayerNetwork(NetworkConfig(layers=[DenseLayer(n_out=3), OutputLayer(n_out=2)],
                                                input_type=InputType.feed_forward(4)))
        server = PredictionServer(model, port=0, log_level="info").start()
        server.stop()
    """, tmp_path)
    lines = stderr.splitlines()
    assert any(line.startswith("uvicorn: Started server process") for line in lines), stderr
    assert not FOREIGN_FORMATS.search(stderr), stderr


def test_dl4py_lines_stay_the_message_alone(tmp_path):
    stderr = console_of("""
        import logging
        logging.getLogger("dl4py").info("epoch 1 of 2")
        logging.getLogger("dl4py.train").warning("a warning")
    """, tmp_path)
    assert stderr.splitlines() == ["epoch 1 of 2", "a warning"]


def test_optuna_keeps_to_warnings_in_dl4py_format(tmp_path):
    pytest.importorskip("optuna")
    stderr = console_of("""
        import logging
        from dl4py.sweep.optuna_search import import_optuna
        optuna = import_optuna()
        optuna.create_study().optimize(lambda trial: trial.suggest_float("x", 0, 1), n_trials=2)  # INFO per trial
        logging.getLogger("optuna.study").warning("a warning of Optuna's")
    """, tmp_path)
    assert stderr.splitlines() == ["optuna: a warning of Optuna's"], stderr
