"""One training run from a RunConfig, recorded in its own directory.

The directory holds ``config.yaml`` (the resolved config), ``environment.json``
(versions, device), ``metrics.jsonl`` (written as training goes), ``checkpoint.dl4py``
(latest state, for ``--resume``), ``model.dl4py`` (the final model),
``evaluation.txt`` and ``result.json``; with the config's ``logging`` section, ``report.html``,
``tensorboard/`` and ``mlflow.json`` (``monitor/run_logging.py``). ``dl4py train`` is a thin
layer over ``train_run``.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch

from dl4py.backend.cuda_environment import environment
from dl4py.config.graph import example_shape
from dl4py.backend import resolve_backend
from dl4py.config.run import DataConfig, RunConfig
from dl4py.config.schema import to_plain
from dl4py.run_data import make_iterators, make_validation
from dl4py.errors import ConfigError, TrainingError
from dl4py.eval import RegressionEvaluation
from dl4py.io import atomic_write_json, atomic_write_text
from dl4py.launchers import choose_launcher, fit_on_spark
from dl4py.memory.auto import auto_batch_size
from dl4py.monitor.environment import environment_record, with_worker_threads
from dl4py.monitor.run_logging import RunLogging, class_fields
from dl4py.nn.loading import load, network_model
from dl4py.nn.model_file import read_meta
from dl4py.parallel import EarlyStoppingParallelTrainer, ParallelWrapper
from dl4py.plan.auto import PlanChoice, agreed_choice, choose
from dl4py.resume import check_resume, resumed_message
from dl4py.run_dir import CHECKPOINT, MODEL, RunRecord, prepare_run_dir, remove_new_run, saved_files
from dl4py.train.compile_choice import compile_record
from dl4py.train.early_stopping import (
    EarlyStoppingConfiguration,
    EarlyStoppingTrainer,
    InvalidScore,
    LocalFileModelSaver,
    MaxEpochs,
    MaxTime,
    ScoreImprovement,
)
from dl4py.train.early_stopping.calculators import calculator_for
from dl4py.train.early_stopping.configuration import ERROR
from dl4py.train.listeners import (
    CheckpointListener,
    PerformanceListener,
    ScoreIterationListener,
)
from dl4py.train.progress import batches_of, console_listeners
from dl4py.train.history import History
from dl4py.train.loop import TrainingInterrupted
from dl4py.train.validation import EpochValidation, validation_record

log = logging.getLogger("dl4py")



def _attach_normalizer(model, data: DataConfig, train, resumed: bool) -> None:
    """``data.normalizer``, fitted on the training data only (one pass), before training. A
    resumed run keeps the checkpoint's, fitted when the run began: refitting could change
    the inputs mid-run, so a config asking for another normalizer is refused."""
    section = data.normalizer
    if resumed:
        saved = None if model.normalizer is None else model.normalizer.settings()
        wanted = None if section is None else section.build().settings()
        if saved != wanted:
            raise ConfigError("data.normalizer", f"is {wanted} but the checkpoint's model was trained with "
                                                 f"{saved}; resume with the run's own config or train into a new "
                                                 "directory")
        return
    if section is not None:
        started = time.perf_counter()
        model.set_normalizer(section.build().fit(train))
        log.info("fitted %s on the training data in %.1f s", model.normalizer, time.perf_counter() - started)


def train_run(
    config: RunConfig,
    output: str | Path | None = None,
    resume: bool = False,
    config_name: str = "run",
    progress: bool | int | str | None = None,
    launcher: str | None = None,
    spark_master: str | None = None,
    on_run_dir=None,
) -> dict:
    """Train as ``config`` says, record everything in the run directory, return ``result.json``'s content.

    The run directory is locked for the whole run (one writer). However the run ends,
    it says so: ``result.json`` has ``status`` completed, interrupted or failed (with the
    reason and what was saved); a run that fails before training starts leaves no
    directory behind that it created. ``launcher``: who starts the ranks of a parallel
    run, ``spawn``, ``torchrun`` or ``spark`` (on ``spark_master``); see ``launchers.py``.
    ``progress``: the console output, as ``fit``'s ``verbose``: 0 (False) none, 1 (True) a
    progress bar, 2 a line per epoch, None or "auto" a bar on a terminal, else lines.
    ``on_run_dir(run_dir)``: called once the run directory is made and locked, before the
    data is read, in the process that writes it (``dl4py train --ui`` shows it there)."""
    launch, config = choose_launcher(launcher, spark_master, config)
    config, choice = _chosen_plan(config, launch, output, resume)
    if launch.rank != 0:
        return _train_beside_rank0(config, output, resume, config_name, launch)
    return _train_run(config, output, resume, config_name, progress, launch, on_run_dir, choice)


def _chosen_plan(config: RunConfig, launch, output, resume: bool) -> tuple[RunConfig, PlanChoice | None]:
    """``workers: auto`` and ``parallelism: auto`` replaced by the planner's choice (plan/auto.py),
    and the choice; a resumed run keeps the one it recorded (its checkpoint is of that plan)."""
    if not config.training.chooses_plan:
        return config, None
    recorded = Path(output) / "config.yaml" if output is not None else None
    if resume and recorded is not None and recorded.is_file():
        training = RunConfig.from_file(recorded).training
        kept = [f"training.workers={training.workers}",
                f"training.parallelism={json.dumps(to_plain(training.parallelism))}"]
        return config.with_overrides(kept), _recorded_choice(Path(output))
    device = resolve_backend(config.training.backend).device

    def make() -> PlanChoice:
        return choose(config, device, launch.name, world=launch.world)

    choice = agreed_choice(make, launch.rank, config.training.timeout) if launch.name == "torchrun" else make()
    log.info("dl4py: the planner chose %s on %d worker(s): %s", choice.plan, choice.workers, choice.why)
    return config.with_overrides(choice.overrides()), choice


def _recorded_choice(run_dir: Path) -> PlanChoice | None:
    """The planner's choice an earlier part of this run recorded in its result.json."""
    try:
        recorded = json.loads((run_dir / "result.json").read_text()).get("plan")
    except (OSError, ValueError):
        return None
    return PlanChoice.from_dict(recorded) if recorded else None


def _train_beside_rank0(config: RunConfig, output, resume: bool, config_name: str, launch) -> dict:
    """A torchrun rank other than 0 trains as every rank does, in a private folder removed
    afterwards: rank 0 alone writes the run directory. Resuming, it starts from rank 0's
    checkpoint, so the run directory must be on a file system every node reads."""
    with tempfile.TemporaryDirectory(prefix=f"dl4py-rank{launch.rank}-") as tmp:
        private = Path(tmp) / "run"
        if resume:
            if output is None or not (Path(output) / CHECKPOINT).is_file():
                raise ConfigError("--resume", f"rank {launch.rank} cannot read {Path(output or '.') / CHECKPOINT}: "
                                              "under torchrun, resume with the run directory on a file system "
                                              "every node reads")
            private.mkdir()
            for name in (CHECKPOINT, "config.yaml"):
                if (Path(output) / name).is_file():
                    shutil.copy2(Path(output) / name, private / name)
        return _train_run(config, private, resume, config_name, False, launch)


def _train_run(config: RunConfig, output, resume: bool, config_name: str, progress, launch,
               on_run_dir=None, choice: PlanChoice | None = None) -> dict:
    started = time.perf_counter()
    run_dir, lock, created = prepare_run_dir(output, resume, config_name)
    record = RunRecord(run_dir, config, started)
    record.plan_choice = choice
    try:
        if on_run_dir is not None:
            on_run_dir(run_dir)
        return _train_locked(config, run_dir, resume, progress, record, launch)
    except TrainingInterrupted as exc:
        _end_logging(record, exc)
        raise  # its result.json is written where it was caught
    except BaseException as exc:
        _end_logging(record, exc)
        if record.training_started:
            record.failed(exc, {"launcher": launch.name, **_known_fields(record)})
        elif not resume:
            remove_new_run(run_dir, created)
        raise
    finally:
        lock.release()


class _RunData(NamedTuple):
    """The run's iterators: ``validation`` and ``test`` are None where the config has none."""

    train: object
    validation: object
    test: object


def _train_locked(config: RunConfig, run_dir: Path, resume: bool, progress, record: RunRecord, launch) -> dict:
    environment().update_from_config(config.environment)  # the config names what it sets
    model = _run_model(config, run_dir, resume)
    config, data = _run_data(config, model, run_dir, resume)
    if resume:
        log.info("%s", resumed_message(run_dir, model, read_meta(run_dir / CHECKPOINT), batches_of(data.train)))
    atomic_write_text(run_dir / "config.yaml", config.to_yaml())
    atomic_write_json(run_dir / "environment.json", environment_record(model))
    record.config, record.model = config, model

    epochs_left = max(config.training.epochs - model.epoch_count, 0)
    # metrics.jsonl, and TensorBoard and MLflow when asked for: opened last, just before training
    record.logging = RunLogging(config.logging, run_dir, config, resume, primary=launch.rank == 0)
    stats = record.logging.listener(score_every=config.training.score_every)
    listeners = _run_listeners(record, stats, data.train, epochs_left, progress)

    result = {"status": "running", "run_dir": str(run_dir), "launcher": launch.name}
    record.training_started = True
    try:
        summaries, stopping = _fit_run(record, data, listeners, epochs_left, launch)
    except TrainingInterrupted as exc:
        _record_interruption(exc, record, result)
        raise
    return _complete_run(record, data, summaries, stopping, stats, result)


def _run_model(config: RunConfig, run_dir: Path, resume: bool):
    """The config's network, or on a resume the run's checkpoint, initialized for this run."""
    model = network_model(config.network, backend=config.training.backend, precision=config.training.precision)
    if resume:
        model = load(run_dir / CHECKPOINT, backend=config.training.backend, precision=config.training.precision)
        check_resume(config, model, run_dir)
    model.init()
    model.set_accumulate_batches(config.training.accumulate_batches)  # a setting of the run, not of the file
    return model


def _run_data(config: RunConfig, model, run_dir: Path, resume: bool) -> tuple[RunConfig, _RunData]:
    """The run's data, batched, split and normalized, and the config with ``batch_size: auto``
    resolved to the number chosen."""
    auto = config.training.batch_size == "auto"
    train, test = make_iterators(config.data, 1 if auto else config.training.batch_size,
                                 example_shape(config.network))
    if auto:
        config = _resolve_batch_size(config, model, train, run_dir if resume else None)
        for iterator in filter(None, (train, test)):
            iterator.batch_size = config.training.batch_size  # the data read once, batched as chosen
    train, validation = make_validation(config.data, train, config.training.batch_size)
    _attach_normalizer(model, config.data, train, resume)  # on the training part only
    return config, _RunData(train, validation, test)


def _run_listeners(record: RunRecord, stats, train, epochs_left: int, progress) -> list:
    """The listeners of the run's fit: ``stats`` (metrics.jsonl and the loggers), the speed
    meter, the checkpoint, the score lines and the console's."""
    config, model = record.config, record.model
    listeners = [stats, PerformanceListener(report=False), CheckpointListener(record.run_dir / CHECKPOINT)]
    if config.training.score_every:
        listeners.append(ScoreIterationListener(config.training.score_every))
    # The run's own epoch numbers: resumed with 1 of 2 epochs done, the bar says "epoch 2/2".
    section = config.training.early_stopping
    to_train = epochs_left if section is None else section.max_epochs or config.training.epochs
    listeners += console_listeners("auto" if progress is None else progress, model.epoch_count + to_train,
                                   batches_of(train))
    return listeners


def _fit_run(record: RunRecord, data: _RunData, listeners: list, epochs_left: int, launch):
    """``(summaries, stopping)``: the epochs' summaries, and early stopping's result where the
    config asks for it (else None), which the record keeps for ``result.json``."""
    config, model = record.config, record.model
    if config.training.early_stopping is None:
        return _fit(model, config.training, data.train, epochs_left, listeners, data.validation, launch,
                    record.run_dir), None
    stopping = _fit_early_stopping(model, config, data.train, data.validation, data.test, record.run_dir, listeners)
    record.early_stopping = {**stopping.to_dict(),
                             "score_set": "validation" if data.validation is not None else "test"}
    return stopping.history or [], stopping


def _record_interruption(exc: TrainingInterrupted, record: RunRecord, result: dict) -> None:
    """``result.json`` of a run stopped between updates: status interrupted, what it saved."""
    exc.run_dir = record.run_dir  # for the command that continues it
    result.update(result_fields(record.config, record.model, [], None, record.started), status="interrupted",
                  saved=saved_files(record.run_dir))
    if record.plan_choice is not None:  # a resume trains by the same choice
        result["plan"] = record.plan_choice.to_dict()
    atomic_write_json(record.run_dir / "result.json", result)


def _complete_run(record: RunRecord, data: _RunData, summaries: list, stopping, stats, result: dict) -> dict:
    """The trained run's model (with early stopping, the best one) saved and scored, and
    ``result.json`` written: status completed."""
    model, run_dir = record.model, record.run_dir
    trained = {"epochs": model.epoch_count, "iterations": model.iteration_count}
    if stopping is not None:
        result["early_stopping"] = record.early_stopping
        model = _early_stopping_model(stopping, model)  # the best one may be an earlier epoch's
        record.model = model
    evaluation = _save_and_evaluate(model, data.test, run_dir, stats)
    if data.validation is not None:  # the run's model on the held-out data (what a sweep ranks by)
        # Without early stopping that model is the last epoch's, scored already.
        last = summaries[-1].validation if stopping is None and summaries else None
        scores = last if last is not None else validation_record(model, data.validation)
        result.update({k: _json_number(v) for k, v in scores.items()})
    result.update(result_fields(record.config, model, summaries, evaluation, record.started), **trained,
                  history=History(summaries).to_dict(), status="completed")
    if record.plan_choice is not None:  # the planner's prediction beside what the run measured
        result["plan"] = record.plan_choice.with_measured(result["train_samples_per_second"])
    atomic_write_json(run_dir / "result.json", result)
    record.logging.finish()  # report.html, MLflow's artifacts and the end of its run
    return result


def _save_and_evaluate(model, test, run_dir: Path, stats):
    """``model.dl4py`` written, and the model's evaluation on the test data (None without it),
    recorded in ``evaluation.txt`` and the metrics."""
    evaluation = model.evaluate(test) if test is not None else None
    model.save(run_dir / MODEL)
    if evaluation is not None:
        atomic_write_text(run_dir / "evaluation.txt", evaluation.stats())
        stats.write({"kind": "evaluation", "epoch": model.epoch_count, **_eval_fields(evaluation),
                     **class_fields(evaluation)})
    return evaluation


def _end_logging(record: RunRecord, exc: BaseException) -> None:
    """A run stopped on ``exc``: its TensorBoard and MLflow storages closed, MLflow told how."""
    if record.logging is not None:
        record.logging.end(exc)


def _known_fields(record: RunRecord) -> dict:
    """What a failed run's result can still say of its training."""
    if record.model is None:
        return {}
    try:
        return result_fields(record.config, record.model, [], None, record.started)
    except Exception:  # the record of a failure must not fail on a broken model
        return {}


def _early_stopping_model(stopping, model):
    """The run's model after early stopping: the best one (the last is the checkpoint),
    where the run trained. Training that ended in an error, or on a NaN loss before any
    epoch was scored, has no model worth evaluating: a TrainingError says why."""
    if stopping.best_model_epoch >= 0:
        return stopping.best_model(backend=model.backend)
    if stopping.termination_reason == ERROR:
        raise TrainingError(f"early stopping ended in an error: {stopping.termination_details}")
    last = None if model.last_score is None else float(model.last_score)
    if last is not None and not math.isfinite(last):
        raise TrainingError(f"training stopped ({stopping.termination_details}) with a loss of {last} before any "
                            f"epoch was scored, so there is no best model; {_nan_remedy(model)}")
    return model


def _nan_remedy(model) -> str:
    return f"lower the learning rate or check the data (precision '{model.precision.name}')"


def _resolve_batch_size(config: RunConfig, model, train, resumed_dir: Path | None = None) -> RunConfig:
    """``batch_size: auto`` becomes the largest batch that fits the model's device beside the
    training data (``train``). The run records the number it chose, and a resumed run keeps it:
    free memory may differ now, and a checkpoint taken mid-epoch counts batches of the recorded size."""
    if resumed_dir is not None:
        recorded = RunConfig.from_file(resumed_dir / "config.yaml").training.batch_size
        return config.with_overrides([f"training.batch_size={recorded}"])
    features, labels = getattr(train, "features", None), getattr(train, "labels", None)
    if isinstance(features, torch.Tensor) and isinstance(labels, torch.Tensor):
        example_bytes = features[:1].element_size() * features[:1].numel() + labels[:1].element_size()
    else:  # decoded as it goes (images): float32 features and an int64 label per example
        example_bytes = 4 * math.prod(train.input_shape()) + 8
    batch, _ = auto_batch_size(config, model.backend.device, train.total_examples(), example_bytes,
                               workers=config.training.workers)
    return config.with_overrides([f"training.batch_size={batch}"])


def _fit(model, training, train, epochs: int, listeners: list, validation, launch, run_dir: Path):
    if training.workers == 1 and launch.name != "spark":
        return model.fit(train, epochs=epochs, listeners=listeners, validation=validation, verbose=0)
    if epochs == 0:
        return []
    options = training.parallel_options()  # validated, and handed on as it is
    if launch.name == "spark":  # this process is the driver: Spark tasks are the ranks
        return fit_on_spark(launch, model, options, train, epochs, _parallel_listeners(listeners), validation,
                            use_gpu=training.backend == "gpu")
    wrapper = ParallelWrapper(model, options=options)
    history = wrapper.fit(train, epochs=epochs, listeners=_parallel_listeners(listeners), validation=validation,
                          verbose=0)
    _record_worker_threads(run_dir, training.workers, wrapper.last_threads)
    return history


def _record_worker_threads(run_dir: Path, workers: int, threads: dict[int, int]) -> None:
    """``environment.json``, written before training, completed with the intra-op threads
    the parallel fit's workers reported (none: a fit that reported nothing)."""
    if threads:
        path = run_dir / "environment.json"
        atomic_write_json(path, with_worker_threads(json.loads(path.read_text()), workers, threads))


def _parallel_listeners(listeners: list) -> list:
    """The listeners for a parallel fit. This process runs them on worker 0's relayed events,
    with the model holding worker 0's averaged state at each epoch's end; the speed meter is
    left out, as it would time the relay's batches of events rather than the training."""
    return [l for l in listeners if not isinstance(l, PerformanceListener)]


def _fit_early_stopping(model, config: RunConfig, train, validation, test, run_dir: Path, listeners: list):
    """Early stopping as ``training.early_stopping`` says, scored on the validation data when
    the run holds some out (else on the test set, as DL4J's examples do)."""
    section, training = config.training.early_stopping, config.training
    held_out = validation if validation is not None else test
    if held_out is None:
        raise ConfigError("training.early_stopping", "needs held-out data: set data.validation (or data.test_path)")
    calculator = calculator_for(section.metric, held_out, model)  # also refuses accuracy for a regression
    if validation is not None:  # the history shows the validation score of every epoch too
        listeners = [EpochValidation(validation), *listeners]
    epoch_conditions = [MaxEpochs(section.max_epochs or training.epochs)]
    if section.patience is not None:
        epoch_conditions.append(ScoreImprovement(section.patience, section.min_delta))
    iteration_conditions = [InvalidScore()]
    if section.max_minutes is not None:
        iteration_conditions.append(MaxTime(section.max_minutes * 60))
    es_config = EarlyStoppingConfiguration(
        score_calculator=calculator, epoch_conditions=epoch_conditions,
        iteration_conditions=iteration_conditions, model_saver=LocalFileModelSaver(run_dir),
        evaluate_every_n_epochs=section.evaluate_every_n_epochs,
    )
    if training.workers == 1:
        return EarlyStoppingTrainer(es_config, model, train, listeners=listeners).fit(verbose=0)
    trainer = EarlyStoppingParallelTrainer(es_config, model, train, listeners=_parallel_listeners(listeners),
                                           options=training.parallel_options())
    stopping = trainer.fit(verbose=0)
    _record_worker_threads(run_dir, training.workers, trainer.wrapper.last_threads)
    return stopping


def _eval_fields(evaluation) -> dict:
    if isinstance(evaluation, RegressionEvaluation):
        # Column averages, as DL4J's averageRSquared...; test_accuracy stays, null, for
        # readers (the CLI, sweeps) that ask every run for it.
        return {
            "test_accuracy": None,
            "test_r2": _json_number(evaluation.r_squared()),
            "test_mse": _json_number(evaluation.mean_squared_error()),
            "test_mae": _json_number(evaluation.mean_absolute_error()),
            "test_rmse": _json_number(evaluation.root_mean_squared_error()),
            "test_examples": evaluation.num_examples(),
        }
    return {
        "test_accuracy": evaluation.accuracy(),
        "test_precision": evaluation.precision(),
        "test_recall": evaluation.recall(),
        "test_f1": evaluation.f1(),
        "test_examples": evaluation.num_examples(),
    }


def _json_number(value: float | None) -> float | None:
    """NaN and inf (R² of a constant target, a diverged model) as null: result.json stays strict JSON."""
    return value if value is not None and math.isfinite(value) else None


def result_fields(config: RunConfig, model, summaries, evaluation, started: float) -> dict:
    examples = sum(s.examples for s in summaries)
    seconds = sum(s.seconds for s in summaries)
    fields = {
        "epochs": model.epoch_count,
        "iterations": model.iteration_count,
        "final_score": None if model.last_score is None else float(model.last_score),
        "train_samples_per_second": examples / seconds if seconds > 0 else None,
        "wall_seconds": time.perf_counter() - started,
        "backend": model.backend.name,
        "device": str(model.backend.device),
        "workers": config.training.workers,
        "precision": model.precision.name,
        "batch_size": config.training.batch_size,
        "compile": compile_record(model),  # compile: auto's choice and why (train/compile_choice.py)
        "epoch_summaries": [s.to_dict() for s in summaries],
    }
    if evaluation is not None:
        fields.update(_eval_fields(evaluation))
    else:
        fields["test_accuracy"] = None
    return fields
