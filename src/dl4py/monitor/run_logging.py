"""What a run config's ``logging`` section switches on, for one run directory.

``metrics.jsonl`` always gets the StatsListener's records; TensorBoard event files
(``logging.tensorboard``), an MLflow run (``logging.mlflow``) and a W&B run
(``logging.wandb``: its files in ``RUN_DIR/wandb``) on request. ``RunLogging``
opens them just before training, so a missing package or an unreachable tracking server
stops the run before it trains; when the run completes it writes ``report.html``
(``logging.report``), gives MLflow the run's files as artifacts and the model as an MLflow
Model (``runs:/<run_id>/model``, ``dl4py.monitor.mlflow_model``) and ends the MLflow run;
``end(exc)`` ends it FAILED, or KILLED when interrupted. The MLflow run's id is kept in
``mlflow.json`` in the run directory, so a resumed run continues the same MLflow run (and
appends to the same ``metrics.jsonl`` and TensorBoard folder); ``wandb.json`` does the same
for the W&B run, finished with exit code 0, 1 (failed) or 255 (interrupted).
"""

from __future__ import annotations

import logging
from pathlib import Path

from dl4py.errors import ConfigError, DL4PyError
from dl4py.eval import Evaluation
from dl4py.io import atomic_write_json
from dl4py.monitor.mlflow import MLflowStatsStorage
from dl4py.monitor.report import write_report
from dl4py.monitor.runs import read_json
from dl4py.monitor.stats import METRICS_FILE, StatsListener
from dl4py.monitor.storage import FileStatsStorage
from dl4py.monitor.tensorboard import TensorBoardStatsStorage
from dl4py.monitor.wandb_storage import EXIT_CODES, WandbStatsStorage
from dl4py.run_dir import MODEL
from dl4py.train.loop import TrainingInterrupted

log = logging.getLogger("dl4py")

MLFLOW_RECORD = "mlflow.json"
WANDB_RECORD = "wandb.json"
TENSORBOARD_DIR = "tensorboard"
ARTIFACTS = ("config.yaml", "model.dl4py", "evaluation.txt", "report.html")  # those the run has


class RunLogging:
    """The storages ``section`` (a LoggingConfig) asks for, for the run in ``run_dir``.
    ``primary``: this process writes the run directory (false on the other ranks of a
    torchrun, which keep a private ``metrics.jsonl`` only)."""

    def __init__(self, section, run_dir: Path, config, resumed: bool, primary: bool = True):
        self.section, self.run_dir = section, Path(run_dir)
        self.primary = primary
        self.tensorboard = self.mlflow = self.wandb = None
        self.storages = [FileStatsStorage(self.run_dir / METRICS_FILE)]
        try:
            if primary and section.tensorboard is not False:
                self.tensorboard = TensorBoardStatsStorage(tensorboard_dir(section, self.run_dir))
                self.storages.append(self.tensorboard)
            if primary and section.mlflow is not None:
                self.mlflow = _open_mlflow(section, self.run_dir, config, resumed)
                self.storages.append(self.mlflow)
            if primary and section.wandb is not None:
                self.wandb = _open_wandb(section, self.run_dir, config, resumed)
                self.storages.append(self.wandb)
        except BaseException:
            self._close("FAILED")
            raise

    def listener(self, score_every: int = 0) -> StatsListener:
        """The run's StatsListener: stats every ``logging.stats_every`` iterations (histograms in
        every ``logging.histogram_every``-th), the score alone every ``score_every``, to every storage."""
        return StatsListener(self.storages, frequency=self.section.stats_every, score_every=score_every,
                             histogram_every=self.section.histogram_every)

    def finish(self) -> None:
        """The run completed: ``report.html`` when asked for, the run's files and its MLflow Model
        to MLflow, and every storage closed (the MLflow run FINISHED)."""
        if self.primary and self.section.report:
            _write_report(self.run_dir)
        if self.mlflow is not None:
            for name in ARTIFACTS:
                if (self.run_dir / name).is_file():
                    self.mlflow.log_artifact(self.run_dir / name)
            if (self.run_dir / MODEL).is_file():
                _log_mlflow_model(self.mlflow, self.run_dir / MODEL)
        self._close("FINISHED")

    def end(self, exc: BaseException) -> None:
        """The run stopped on ``exc``: close the storages, the MLflow run KILLED (an
        interruption) or FAILED. Never raises: the run's own error is the one to tell."""
        try:
            self._close("KILLED" if isinstance(exc, (KeyboardInterrupt, TrainingInterrupted)) else "FAILED")
        except Exception as error:
            log.warning("could not close the run's logging (%s): %s", type(error).__name__, error)

    def _close(self, status: str) -> None:
        try:
            if self.tensorboard is not None:
                self.tensorboard.close()
        finally:
            try:
                if self.mlflow is not None and self.mlflow.status is None:
                    self.mlflow.end(status)
            finally:
                if self.wandb is not None and self.wandb.exit_code is None:
                    self.wandb.end(EXIT_CODES[status])


def tensorboard_dir(section, run_dir: Path) -> Path:
    """``logging.tensorboard``: true means ``RUN_DIR/tensorboard``, a string is a folder."""
    return run_dir / TENSORBOARD_DIR if section.tensorboard is True else Path(section.tensorboard)


def _open_mlflow(section, run_dir: Path, config, resumed: bool):
    """The run's MLflow run: the one ``mlflow.json`` names when resuming against the same
    tracking URI and experiment, else a new one (recorded there)."""
    where = {"tracking_uri": section.mlflow, "experiment": section.mlflow_experiment}
    recorded = read_json(run_dir / MLFLOW_RECORD) if resumed else None
    run_id = recorded.get("run_id") if recorded and all(recorded.get(k) == v for k, v in where.items()) else None
    options = dict(tracking_uri=section.mlflow, experiment=section.mlflow_experiment, run_name=run_dir.name,
                   params=config.to_dict(), tags={"dl4py.run_dir": str(run_dir.resolve())})
    try:
        try:
            storage = MLflowStatsStorage(**options, run_id=run_id)
        except DL4PyError:
            raise
        except Exception as exc:
            if run_id is None:
                raise
            log.warning("cannot continue MLflow run %s (%s); starting a new one", run_id, exc)
            storage = MLflowStatsStorage(**options)
    except DL4PyError:  # a missing package, a deleted experiment: already says what to do
        raise
    except Exception as exc:  # MLflow's own: an unreachable server, a URI it cannot use
        raise ConfigError("logging.mlflow", f"cannot start an MLflow run at {section.mlflow!r}: "
                                            f"{type(exc).__name__}: {exc}") from exc
    atomic_write_json(run_dir / MLFLOW_RECORD, {**where, "experiment_id": storage.experiment_id,
                                                "run_id": storage.run_id})
    return storage


def _open_wandb(section, run_dir: Path, config, resumed: bool) -> WandbStatsStorage:
    """The run's W&B run in project ``logging.wandb``, its files in ``RUN_DIR/wandb``: the one
    ``wandb.json`` names when resuming in the same project, else a new one (recorded there)."""
    recorded = read_json(run_dir / WANDB_RECORD) if resumed else None
    run_id = recorded.get("run_id") if recorded and recorded.get("project") == section.wandb else None
    try:
        storage = WandbStatsStorage(project=section.wandb, name=run_dir.name, config=config.to_dict(),
                                    mode=section.wandb_mode, dir=run_dir, run_id=run_id)
    except DL4PyError:  # a missing package: already says what to do
        raise
    except Exception as exc:  # wandb's own: not logged in, an unreachable server
        raise ConfigError("logging.wandb", f"cannot start a W&B run in project {section.wandb!r}: "
                                           f"{type(exc).__name__}: {exc}") from exc
    atomic_write_json(run_dir / WANDB_RECORD, {"project": section.wandb, "run_id": storage.run_id})
    return storage


def _log_mlflow_model(storage: MLflowStatsStorage, model_file: Path) -> None:
    """The run's model as an MLflow Model, ``runs:/<run_id>/model``, beside the plain file. The
    run has completed and its files are logged: a model MLflow cannot take is a warning, not a
    failed run."""
    try:
        storage.log_model(model_file)
    except Exception as exc:
        log.warning("could not log %s as an MLflow Model (%s: %s); the plain file is among the MLflow run's "
                    "artifacts", model_file, type(exc).__name__, exc)


def _write_report(run_dir: Path) -> None:
    """``report.html``. The run has completed and its results are saved: a report that
    cannot be drawn is a warning, not a failed run."""
    try:
        write_report(run_dir)
    except Exception as exc:
        log.warning("could not write %s (%s: %s)", run_dir / "report.html", type(exc).__name__, exc)


def class_fields(evaluation) -> dict:
    """A classification's per-class figures for ``metrics.jsonl``'s "evaluation" record: the
    confusion matrix (rows actual, columns predicted), class names, and each class's
    precision and recall (null where undefined: never predicted, resp. no examples)."""
    if not isinstance(evaluation, Evaluation) or evaluation.num_examples() == 0:
        return {}
    classes = range(evaluation.num_classes)
    no_precision, no_recall = set(evaluation.excluded("precision")), set(evaluation.excluded("recall"))
    return {
        "confusion_matrix": evaluation.confusion_matrix().tolist(),
        "class_labels": evaluation.labels or [str(i) for i in classes],
        "class_precision": [None if i in no_precision else evaluation.precision(i) for i in classes],
        "class_recall": [None if i in no_recall else evaluation.recall(i) for i in classes],
    }
