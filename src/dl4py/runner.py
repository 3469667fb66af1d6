"""One training run from a RunConfig, recorded in its own directory.

The directory holds ``config.yaml`` (the resolved config), ``environment.json``
(versions, device), ``metrics.jsonl`` (written as training goes), ``checkpoint.dl4py``
(latest state, for ``--resume``), ``model.dl4py`` (the final model),
``evaluation.txt`` and ``result.json``. ``dl4py train`` is a thin layer over ``train_run``.
"""

from __future__ import annotations

import logging
import platform
import sys
import time
from datetime import datetime
from pathlib import Path

import torch

from dl4py.backend.cuda_environment import environment
from dl4py.config.run import DataConfig, RunConfig
from dl4py.errors import ConfigError
from dl4py.io import atomic_write_json, atomic_write_text
from dl4py.nn.network import MultiLayerNetwork
from dl4py.nn.serialization import load
from dl4py.train.listeners import (
    CheckpointListener,
    MetricsLogger,
    PerformanceListener,
    ProgressBar,
    ScoreIterationListener,
)
from dl4py.train.loop import TrainingInterrupted

log = logging.getLogger("dl4py")

CHECKPOINT = "checkpoint.dl4py"
MODEL = "model.dl4py"


def make_iterators(data: DataConfig, batch_size: int, input_shape: tuple[int, ...]):
    """Training and test iterators for the data section (test is None when there is none)."""
    from dl4py.data import CsvDataSetIterator, MnistDataSetIterator

    if data.dataset == "mnist":
        train = MnistDataSetIterator(
            batch_size, train=True, seed=data.seed, shuffle=data.shuffle, limit=data.limit_train
        )
        test = MnistDataSetIterator(batch_size, train=False, seed=data.seed, shuffle=False, limit=data.limit_test)
    else:
        def csv(path, limit, shuffle):
            return CsvDataSetIterator(
                path, batch_size, label_index=data.label_index, num_classes=data.num_classes,
                skip_lines=data.skip_lines, shuffle=shuffle, seed=data.seed, limit=limit,
            )

        train = csv(data.train_path, data.limit_train, data.shuffle)
        test = csv(data.test_path, data.limit_test, False) if data.test_path else None
    if tuple(train.input_shape()) != tuple(input_shape):
        raise ConfigError(
            "network.input_type",
            f"gives examples of shape {list(input_shape)} but the {data.dataset} data has "
            f"{list(train.input_shape())}",
        )
    return train, test


def new_run_dir(config_name: str, root: Path = Path("runs")) -> Path:
    """A fresh directory; exclusive creation, so two runs never share one."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    root.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        path = root / (f"{config_name}-{stamp}" + (f"-{n}" if n > 1 else ""))
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"cannot create a new run directory under {root}")


def environment_record(model) -> dict:
    device = model.backend.device
    record = {
        "dl4py": __import__("dl4py").__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_threads": torch.get_num_threads(),
        "backend": model.backend.name,
        "backend_reason": model.backend.reason,
        "device": str(device),
        "precision": model.precision.name,
        "cuda": torch.version.cuda,
        "environment": environment().to_dict(),
    }
    if device.type == "cuda":
        record["device_name"] = torch.cuda.get_device_name(device)
    return record


def train_run(
    config: RunConfig,
    output: str | Path | None = None,
    resume: bool = False,
    config_name: str = "run",
    progress: bool | None = None,
) -> dict:
    """Train as ``config`` says, record everything in the run directory, return ``result.json``'s content."""
    started = time.perf_counter()
    run_dir = _prepare_run_dir(output, resume, config_name)
    environment().update_from_config(config.environment)  # the config names what it sets
    network = config.network
    model = MultiLayerNetwork(network, backend=config.training.backend, precision=config.training.precision)
    checkpoint = run_dir / CHECKPOINT
    if resume:
        saved = RunConfig.from_file(run_dir / "config.yaml")
        if saved.network != network:
            raise ConfigError(
                "network", f"differs from the network of the run being resumed in {run_dir}; resume with its config.yaml"
            )
        model = load(checkpoint, backend=config.training.backend, precision=config.training.precision)
        log.info("resuming %s at epoch %d, iteration %d", run_dir, model.epoch_count, model.iteration_count)
    model.init()
    auto = config.training.batch_size == "auto"
    train, test = make_iterators(config.data, 1 if auto else config.training.batch_size,
                                 network.input_type.example_shape())
    if auto:
        config = _resolve_batch_size(config, model, train, run_dir if resume else None)
        for iterator in filter(None, (train, test)):
            iterator.batch_size = config.training.batch_size  # the data read once, batched as chosen
    atomic_write_text(run_dir / "config.yaml", config.to_yaml())
    atomic_write_json(run_dir / "environment.json", environment_record(model))

    epochs_left = max(config.training.epochs - model.epoch_count, 0)
    metrics = MetricsLogger(run_dir / "metrics.jsonl", every=config.training.score_every)
    listeners = [metrics, PerformanceListener(report=False), CheckpointListener(checkpoint)]
    if config.training.score_every:
        listeners.append(ScoreIterationListener(config.training.score_every))
    if progress if progress is not None else sys.stderr.isatty():
        listeners.append(ProgressBar(epochs_left, len(train)))

    result = {"status": "running", "run_dir": str(run_dir)}
    stopping = None
    try:
        if config.training.early_stopping is None:
            summaries = _fit(model, config.training, train, epochs_left, listeners)
        else:
            summaries = []
            stopping = _fit_early_stopping(model, config, train, test, run_dir, listeners)
            result["early_stopping"] = stopping.to_dict()
    except TrainingInterrupted:
        result.update(_result_fields(config, model, [], None, started), status="interrupted")
        atomic_write_json(run_dir / "result.json", result)
        raise
    if stopping is not None and stopping.best_model_epoch >= 0:
        # The run's model is the best one (the last is the checkpoint), where the run trained.
        model = stopping.best_model(backend=model.backend)
    evaluation = model.evaluate(test) if test is not None else None
    model.save(run_dir / MODEL)
    if evaluation is not None:
        atomic_write_text(run_dir / "evaluation.txt", evaluation.stats())
        metrics.write({"kind": "evaluation", "epoch": model.epoch_count, **_eval_fields(evaluation)})
    result.update(_result_fields(config, model, summaries, evaluation, started), status="completed")
    atomic_write_json(run_dir / "result.json", result)
    return result


def _resolve_batch_size(config: RunConfig, model, train, resumed_dir: Path | None = None) -> RunConfig:
    """``batch_size: auto`` becomes the largest batch that fits the model's device beside the
    training data (``train``). The run records the number it chose, and a resumed run keeps it:
    free memory may differ now, and a checkpoint taken mid-epoch counts batches of the recorded size."""
    if resumed_dir is not None:
        recorded = RunConfig.from_file(resumed_dir / "config.yaml").training.batch_size
        return config.with_overrides([f"training.batch_size={recorded}"])
    from dl4py.memory.auto import auto_batch_size

    example_bytes = train.features[:1].element_size() * train.features[:1].numel() + train.labels[:1].element_size()
    batch, _ = auto_batch_size(config, model.backend.device, train.total_examples(), example_bytes,
                               workers=config.training.workers)
    return config.with_overrides([f"training.batch_size={batch}"])


def _fit(model, training, train, epochs: int, listeners: list):
    if training.workers == 1:
        return model.fit(train, epochs=epochs, listeners=listeners)
    if epochs == 0:
        return []
    from dl4py.parallel import ParallelWrapper

    options, worker_listeners = _parallel_options(training, listeners)
    return ParallelWrapper(model, **options).fit(train, epochs=epochs, listeners=worker_listeners)


def _parallel_options(training, listeners: list) -> tuple[dict, list]:
    """ParallelWrapper options from ``training``, and the listeners worker 0 runs: they see
    its replica, averaged at each epoch's end (the in-process speed meter stays behind)."""
    options = dict(
        workers=training.workers, prefetch_buffer=training.prefetch_buffer,
        averaging_frequency=training.averaging_frequency,
        report_score_after_averaging=training.report_score_after_averaging,
        training_mode=training.training_mode,
    )
    return options, [l for l in listeners if not isinstance(l, PerformanceListener)]


def _fit_early_stopping(model, config: RunConfig, train, test, run_dir: Path, listeners: list):
    from dl4py.parallel import EarlyStoppingParallelTrainer
    from dl4py.train.early_stopping import (
        ClassificationScoreCalculator,
        DataSetLossCalculator,
        EarlyStoppingConfiguration,
        EarlyStoppingTrainer,
        InvalidScore,
        LocalFileModelSaver,
        MaxEpochs,
        MaxTime,
        ScoreImprovement,
    )

    section, training = config.training.early_stopping, config.training
    if test is None:
        raise ConfigError("training.early_stopping", "needs held-out data: set data.test_path")
    calculator = (DataSetLossCalculator(test) if section.metric == "loss"
                  else ClassificationScoreCalculator(section.metric, test))
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
        return EarlyStoppingTrainer(es_config, model, train, listeners=listeners).fit()
    options, worker_listeners = _parallel_options(training, listeners)
    return EarlyStoppingParallelTrainer(es_config, model, train, listeners=worker_listeners, **options).fit()


def _prepare_run_dir(output, resume: bool, config_name: str) -> Path:
    if output is None:
        if resume:
            raise ConfigError("--resume", "needs --output: the run directory to continue")
        return new_run_dir(config_name)
    run_dir = Path(output)
    if resume:
        if not (run_dir / CHECKPOINT).exists():
            raise ConfigError("--resume", f"{run_dir} holds no {CHECKPOINT} to resume from")
        return run_dir
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError(
            "--output", f"{run_dir} already holds files; choose another directory or pass --resume to continue it"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def _eval_fields(evaluation) -> dict:
    return {
        "test_accuracy": evaluation.accuracy(),
        "test_precision": evaluation.precision(),
        "test_recall": evaluation.recall(),
        "test_f1": evaluation.f1(),
        "test_examples": evaluation.num_examples(),
    }


def _result_fields(config: RunConfig, model, summaries, evaluation, started: float) -> dict:
    examples = sum(s.examples for s in summaries)
    seconds = sum(s.seconds for s in summaries)
    fields = {
        "epochs": model.epoch_count,
        "iterations": model.iteration_count,
        "final_score": None if model._last_score is None else float(model._last_score),
        "train_samples_per_second": examples / seconds if seconds > 0 else None,
        "wall_seconds": time.perf_counter() - started,
        "backend": model.backend.name,
        "device": str(model.backend.device),
        "workers": config.training.workers,
        "precision": model.precision.name,
        "batch_size": config.training.batch_size,
        "epoch_summaries": [s.to_dict() for s in summaries],
    }
    if evaluation is not None:
        fields.update(_eval_fields(evaluation))
    else:
        fields["test_accuracy"] = None
    return fields
