"""A Weights & Biases run for a training run: the same charts as TensorBoard and MLflow.

    from dl4py.monitor import StatsListener, WandbStatsStorage

    storage = WandbStatsStorage(project="lenet", config={"training": {"batch_size": 64}})
    with storage:                      # finishes the W&B run, exit code 1 when the fit failed
        model.fit(train, epochs=2, listeners=[StatsListener(storage)])

Offline (``mode="offline"``, or ``WANDB_MODE=offline``) the run stays in
``DIR/wandb/offline-run-*`` until ``wandb sync`` uploads it. The storage holds its own run
object (``reinit="create_new"``), never W&B's global ``wandb.run``, so it works beside runs
a user's own code has open. Needs the ``wandb`` package: ``pip install "dl4py[wandb]"``.
"""

from __future__ import annotations

import logging
from pathlib import Path

from dl4py.errors import MissingDependencyError, StorageError
from dl4py.monitor.scalars import LAYER_STATS, epoch_scalars, evaluation_scalars, histograms, update_scalars
from dl4py.monitor.storage import StatsStorage
from dl4py.train.loop import TrainingInterrupted

log = logging.getLogger("dl4py")

MODES = ("online", "offline", "disabled")
ITERATION, EPOCH = "iteration", "epoch"  # the two x axes of the run's charts
# The first part of every scalar name of dl4py.monitor.scalars, by the axis it is charted against.
_PER_ITERATION = ("train", "memory", "histogram", *LAYER_STATS)
_PER_EPOCH = ("epoch", "validation", "test")
MODEL_SUMMARY_FILE = "model_summary.txt"  # in the run's files (W&B's Files tab)
# A run's end (the names MLflow's statuses have) as W&B's exit code: any but 0 marks the run
# failed; 255 is the code wandb itself gives a run stopped by Ctrl-C.
EXIT_CODES = {"FINISHED": 0, "FAILED": 1, "KILLED": 255}


class WandbStatsStorage(StatsStorage):
    """Logs the StatsListener's records to a W&B run.

    ``project``, ``name`` (the run's display name), ``config`` (a nested mapping, e.g. a run
    config's ``to_dict()``: the run's config), ``mode`` ("online", "offline", "disabled";
    None: wandb's default, ``WANDB_MODE`` else online), ``dir`` (where ``wandb/`` goes; None:
    ``WANDB_DIR`` else the current folder), ``run_id``: continue that run (a resumed training).

    Metrics have the names of ``dl4py.monitor.scalars``. Per-iteration ones (``train/score``,
    ``update_ratio/<layer>``, ...) chart against ``iteration``; per-epoch ones
    (``epoch/loss``, ``validation/accuracy``, an evaluation's ``test/accuracy``) against
    ``epoch``, counted from 1 as a person reads it: the first epoch's point is at epoch 1, as
    in the console's "epoch 1/2" (``metrics.jsonl``, TensorBoard and MLflow keep History's
    0-based index there). The model's parameters, layers, the environment and the number of
    workers go into the run's config under ``dl4py``, the model summary into the run's files
    (``model_summary.txt``). The histograms a "stats" record carries are W&B histograms
    (``histogram/parameters/<layer>``, ``histogram/gradients/<layer>``,
    ``histogram/updates/<layer>``), against ``iteration`` too.

    wandb's banners are silenced and it does not capture the console (dl4py logs the run's
    address instead). ``close()`` finishes the run (exit code 0) unless ``end`` did already;
    ``end(exit_code)`` and the ``with`` block finish it 1 (failed) or 255 (interrupted)."""

    def __init__(self, project: str | None = None, name: str | None = None, config: dict | None = None,
                 mode: str | None = None, dir: str | Path | None = None, run_id: str | None = None):
        if mode is not None and mode not in MODES:
            raise ValueError(f"WandbStatsStorage: mode must be one of {', '.join(MODES)} or None, got {mode!r}")
        wandb = self._wandb = _wandb()
        self.dir = None if dir is None else Path(dir)
        if self.dir is not None:
            try:  # wandb would write to a temporary folder instead of one that does not exist
                self.dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:  # a file where the folder should be, no permission
                raise StorageError("write W&B runs to", self.dir, exc) from exc
        # silent: no banners or per-run footers in the user's console; console "off": wandb does
        # not wrap sys.stdout and sys.stderr, so dl4py's progress bar and logs stay as they are.
        settings = wandb.Settings(silent=True, console="off", reinit="create_new")
        self.run = wandb.init(project=project, name=name, config=config, mode=mode,
                              dir=None if self.dir is None else str(self.dir), id=run_id,
                              resume="allow" if run_id else None, allow_val_change=bool(run_id),
                              settings=settings)
        self.run_id = self.run.id
        self.exit_code: int | None = None  # how the run ended; None while it is open
        try:
            self._define_axes()
        except BaseException:
            self.end(EXIT_CODES["FAILED"])
            raise
        _announce(self.run)

    def _define_axes(self) -> None:
        """Each scalar against its own step, not W&B's ``_step`` (one per log call): charts of
        a resumed run go on from where it stopped."""
        self.run.define_metric(ITERATION)
        self.run.define_metric(EPOCH)
        for prefix in _PER_ITERATION:
            self.run.define_metric(f"{prefix}/*", step_metric=ITERATION)
        for prefix in _PER_EPOCH:
            self.run.define_metric(f"{prefix}/*", step_metric=EPOCH)

    # ------------------------------------------------------------------ StatsStorage

    def put_static(self, record: dict) -> None:
        model = record.get("model") or {}
        facts = {"parameters": model.get("parameters"), "layers": model.get("layers"),
                 "workers": record.get("workers"), "environment": record.get("environment") or {}}
        # allow_val_change: a resumed run, or a second fit, may run elsewhere (another device, more workers)
        self.run.config.update({"dl4py": facts}, allow_val_change=True)
        if model.get("summary") and self.run.settings.mode != "disabled":  # a disabled run has no files
            # A file in run.dir is the run's file: uploaded with the run, shown in its Files tab.
            (Path(self.run.dir) / MODEL_SUMMARY_FILE).write_text(model["summary"] + "\n", encoding="utf-8")

    def put_update(self, record: dict) -> None:
        values = dict(update_scalars(record))
        values.update((tag, self._histogram(histogram)) for tag, histogram in histograms(record))
        self._log(values, ITERATION, record["iteration"])

    def put_epoch(self, record: dict) -> None:
        self._log(dict(epoch_scalars(record)), EPOCH, record["epoch"] + 1)  # History's 0-based index, read from 1

    def put(self, record: dict) -> None:
        """An "evaluation" record's test-set scores at its ``epoch``: the number of epochs
        trained, so the point sits on the last epoch's; other kinds have no place here."""
        if record.get("kind") == "evaluation":
            self._log(dict(evaluation_scalars(record)), EPOCH, record.get("epoch", 0))

    def _log(self, values: dict, axis: str, step: int) -> None:
        if values:
            self.run.log({axis: int(step), **values})

    def _histogram(self, histogram: dict):
        """A collector's histogram (equal bins from ``min`` to ``max``) as W&B's: its counts
        and the bins' edges."""
        low, high, counts = histogram["min"], histogram["max"], histogram["counts"]
        edges = [low + (high - low) * i / len(counts) for i in range(len(counts) + 1)]
        return self._wandb.Histogram(np_histogram=(counts, edges))

    def close(self) -> None:
        if self.exit_code is None:
            self.end(0)

    # ------------------------------------------------------------------ the run

    def end(self, exit_code: int = 0) -> None:
        """Finish the run: 0 finished, any other code failed (1; 255 interrupted). wandb's
        service process stays for the next run, and stops when Python exits (or at
        ``wandb.teardown()``)."""
        self.exit_code = exit_code
        self.run.finish(exit_code=exit_code)

    def __enter__(self) -> "WandbStatsStorage":
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if self.exit_code is None:
            self.end(exit_code_of(exc))

    def __repr__(self) -> str:
        return f"WandbStatsStorage(project={self.run.project!r}, run_id={self.run_id!r})"


def exit_code_of(exc: BaseException | None) -> int:
    """The W&B exit code of a run that stopped on ``exc`` (None: it completed)."""
    if exc is None:
        return EXIT_CODES["FINISHED"]
    return EXIT_CODES["KILLED" if isinstance(exc, (KeyboardInterrupt, TrainingInterrupted)) else "FAILED"]


def _wandb():
    """The wandb module, or an error naming what to install."""
    try:
        import wandb  # optional: wandb (extra wandb)
    except ImportError:  # also when sys.modules["wandb"] is None
        raise MissingDependencyError("W&B logging", "wandb", "wandb") from None
    return wandb


def _announce(run) -> None:
    """One log line in place of wandb's silenced banner: where the run is."""
    if run.settings.mode == "offline":
        log.info("W&B run %s is offline; upload it with: wandb sync %s", run.id, Path(run.dir).parent)
    elif run.url:
        log.info("W&B run %s: %s", run.id, run.url)
