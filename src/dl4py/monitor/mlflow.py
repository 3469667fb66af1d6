"""An MLflow run for a training run: params, metrics, artifacts, against any tracking URI.

    from dl4py.monitor import MLflowStatsStorage, StatsListener

    storage = MLflowStatsStorage("sqlite:///mlflow.db", experiment="lenet",
                                 params={"training": {"batch_size": 64}})
    with storage:                      # ends the MLflow run FINISHED, FAILED or KILLED
        model.fit(train, epochs=2, listeners=[StatsListener(storage)])
        model.save("model.dl4py")
        storage.log_artifact("model.dl4py")
        storage.log_model("model.dl4py")   # an MLflow Model too: runs:/<run_id>/model

Everything goes through an explicit ``MlflowClient`` and the run's id, never MLflow's
global "active run", so it works beside runs a user's own code has open. Needs the
``mlflow`` package: ``pip install "dl4py[mlflow]"``.
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

from dl4py.console_logging import route_foreign_loggers
from dl4py.errors import ConfigError, MissingDependencyError
from dl4py.monitor.scalars import epoch_scalars, evaluation_scalars, update_scalars
from dl4py.monitor.storage import StatsStorage
from dl4py.train.loop import TrainingInterrupted

log = logging.getLogger("dl4py")

FLUSH_SECONDS = 5.0  # per-iteration metrics are sent in batches: one request per few seconds, not per step
_BATCH = 1000  # MLflow's most metrics in one log_batch request
_PARAMS_BATCH = 100  # ... and params
_MAX_KEY = 250  # MLflow's longest key
_MAX_PARAM_VALUE = 6000  # MLflow's longest param value
_UNSAFE = re.compile(r"[^/\w.\- ]")  # MLflow's key characters (without the colon, refused on Windows)

FINISHED, FAILED, KILLED = "FINISHED", "FAILED", "KILLED"


class MLflowStatsStorage(StatsStorage):
    """Logs the StatsListener's records to an MLflow run.

    ``tracking_uri``: any MLflow tracking URI (``sqlite:///mlflow.db``,
    ``http://127.0.0.1:5000``, a folder); None: MLflow's default (``MLFLOW_TRACKING_URI``,
    else ``./mlruns``). The run is created in ``experiment`` (made if missing), named
    ``run_name``; ``params`` (a nested mapping, e.g. a config's ``to_dict()``) is logged
    flattened: ``training.batch_size``, ``network.layers.0.n_out``. ``run_id``: continue that
    run instead of creating one (a resumed training): params already logged are kept, as
    MLflow cannot change them.

    Metrics have the names of ``dl4py.monitor.scalars`` (``train/score``,
    ``update_ratio/<layer>`` against the iteration; ``epoch/loss``, ``validation/accuracy``
    against the epoch, 0-based), keys made safe for MLflow. ``log_artifact`` adds files,
    ``end(status)`` ends the run; ``close()`` ends it FINISHED unless it was ended already."""

    def __init__(self, tracking_uri: str | None = None, experiment: str = "dl4py", run_name: str | None = None,
                 params: dict | None = None, run_id: str | None = None, tags: dict | None = None):
        _require_mlflow()
        from mlflow.tracking import MlflowClient  # optional: mlflow (extra mlflow)

        self.client = MlflowClient(tracking_uri)
        self.tracking_uri = self.client.tracking_uri
        if run_id is None:
            run = self.client.create_run(_experiment_id(self.client, experiment), run_name=run_name,
                                         tags={k: str(v) for k, v in (tags or {}).items()})
            self.run_id = run.info.run_id
        else:
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")  # reopened: it was ended when the run stopped
            for key, value in (tags or {}).items():
                self.client.set_tag(run_id, key, str(value))
        self.experiment_id = self.client.get_run(self.run_id).info.experiment_id
        self._pending: list = []
        self._sent = time.monotonic()
        self.status: str | None = None  # how the run ended; None while it is open
        if params:
            try:
                self.log_params(params)
            except BaseException:  # not left "running" for ever in the MLflow UI
                self.end(FAILED)
                raise

    # ------------------------------------------------------------------ StatsStorage

    def put_static(self, record: dict) -> None:
        model = record.get("model") or {}
        if model.get("summary"):
            self.client.log_text(self.run_id, model["summary"], "model_summary.txt")
        environment = {**(record.get("environment") or {}), "workers": record.get("workers"),
                       "parameters": model.get("parameters")}
        self.client.log_dict(self.run_id, environment, "environment.json")

    def put_update(self, record: dict) -> None:
        self._queue(update_scalars(record), record["iteration"])
        if len(self._pending) >= _BATCH or time.monotonic() - self._sent >= FLUSH_SECONDS:
            self.flush()

    def put_epoch(self, record: dict) -> None:
        self._queue(epoch_scalars(record), record["epoch"])
        self.flush()  # the MLflow UI shows each epoch as it ends

    def put(self, record: dict) -> None:
        """An "evaluation" record's test-set scores (``test/accuracy``, ...), at its epoch;
        other kinds have no place here."""
        if record.get("kind") == "evaluation":
            self._queue(evaluation_scalars(record), record.get("epoch", 0))
            self.flush()

    def close(self) -> None:
        if self.status is None:
            self.end(FINISHED)

    # ------------------------------------------------------------------ the run

    def log_params(self, params: dict) -> None:
        """Log ``params`` flattened (``training.batch_size``). A key the run has already is
        kept as it is: MLflow refuses to change a param (a resumed run with another value logs
        a warning instead)."""
        from mlflow.entities import Param  # optional: mlflow (extra mlflow)

        logged = self.client.get_run(self.run_id).data.params
        new = []
        for key, value in flatten(params).items():
            key, value = metric_key(key), value[:_MAX_PARAM_VALUE]
            if key not in logged:
                new.append(Param(key, value))
            elif logged[key] != value:
                log.warning("MLflow run %s keeps param %s=%s (MLflow params cannot change); this run has %s",
                            self.run_id, key, logged[key], value)
        for start in range(0, len(new), _PARAMS_BATCH):
            self.client.log_batch(self.run_id, params=new[start:start + _PARAMS_BATCH])

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Copy a file (a model, ``evaluation.txt``, ``report.html``) into the run's artifacts."""
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_model(self, model_file: str | Path, name: str = "model", registered_model_name: str | None = None) -> str:
        """Add a saved model (``model.dl4py``) to the run as an MLflow Model (the
        ``python_function`` flavour: ``dl4py.monitor.mlflow_model``) in the folder ``name`` of its
        artifacts; ``registered_model_name``: also a new version of that registered model.
        Returns the model's URI, ``runs:/<run_id>/model``, for ``mlflow.pyfunc.load_model`` and
        ``mlflow models serve -m``."""
        from dl4py.monitor.mlflow_model import log_mlflow_model  # lazy: mlflow.pyfunc is heavy, and only this needs it

        return log_mlflow_model(model_file, self.run_id, self.tracking_uri, name, registered_model_name)

    def flush(self) -> None:
        """Send the metrics queued so far."""
        pending, self._pending, self._sent = self._pending, [], time.monotonic()
        for start in range(0, len(pending), _BATCH):
            self.client.log_batch(self.run_id, metrics=pending[start:start + _BATCH])

    def end(self, status: str = FINISHED) -> None:
        """Send what is queued and end the run: FINISHED, FAILED or KILLED (interrupted)."""
        if status not in (FINISHED, FAILED, KILLED):
            raise ValueError(f"status must be {FINISHED}, {FAILED} or {KILLED}, got {status!r}")
        try:
            self.flush()
        finally:
            self.client.set_terminated(self.run_id, status)
            self.status = status

    def __enter__(self) -> "MLflowStatsStorage":
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if self.status is None:
            self.end(FINISHED if kind is None else KILLED if _interrupted(exc) else FAILED)

    def _queue(self, scalars: list[tuple[str, float]], step: int) -> None:
        from mlflow.entities import Metric  # optional: mlflow (extra mlflow)

        now = int(time.time() * 1000)
        self._pending += [Metric(metric_key(name), value, now, int(step)) for name, value in scalars]


def _require_mlflow() -> None:
    try:
        import mlflow  # optional: mlflow (extra mlflow)
    except ImportError:  # also when sys.modules["mlflow"] is None
        raise MissingDependencyError("MLflow logging", "mlflow", "mlflow") from None
    del mlflow  # only whether it imports was asked
    route_foreign_loggers()  # its import gave its loggers handlers of their own: a command's console has one format


def _experiment_id(client, name: str) -> str:
    """The id of experiment ``name``, created if missing (by whichever of two runs starting
    together gets there first)."""
    from mlflow.exceptions import MlflowException  # optional: mlflow (extra mlflow)

    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        try:
            return client.create_experiment(name)
        except MlflowException:  # created meanwhile by another run
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                raise
    if experiment.lifecycle_stage == "deleted":
        raise ConfigError("logging.mlflow_experiment", f"MLflow experiment {name!r} is deleted; restore it "
                                                       "(mlflow experiments restore) or name another")
    return experiment.experiment_id


def _interrupted(exc) -> bool:
    return isinstance(exc, (KeyboardInterrupt, TrainingInterrupted))


def metric_key(name: str) -> str:
    """``name`` as an MLflow key: characters MLflow refuses become "_", as do empty, "." and
    ".." path parts (MLflow keys are also file paths)."""
    parts = [_UNSAFE.sub("_", part) for part in name.split("/")]
    key = "/".join(part if part not in ("", ".", "..") else "_" for part in parts)
    return key[:_MAX_KEY]


def flatten(params: dict, prefix: str = "") -> dict[str, str]:
    """A nested mapping as MLflow params: ``{"training": {"batch_size": 64}}`` ->
    ``{"training.batch_size": "64"}``; list items by index (``network.layers.0.n_out``), except
    lists of plain values, kept whole (``kernel_size: "[5, 5]"``)."""
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name))
        elif isinstance(value, (list, tuple)) and any(isinstance(v, (dict, list, tuple)) for v in value):
            flat.update(flatten({str(i): v for i, v in enumerate(value)}, name))
        else:
            flat[name] = value if isinstance(value, str) else json.dumps(value)
    return flat
