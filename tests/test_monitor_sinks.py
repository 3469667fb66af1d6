"""Where a run's stats go besides metrics.jsonl: TensorBoard event files and an MLflow run,
read back with each tool's own reader; the config's ``logging`` section that switches them on."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

import pytest

from dl4py.config import RunConfig
from dl4py.errors import ConfigError, MissingDependencyError

# MLflow's SQL store warns about its own use of SQLAlchemy; nothing dl4py can change.
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")

EPOCHS, BATCHES, STATS_EVERY = 2, 12, 4  # 768 training examples in batches of 64: 12 per epoch
LAYERS = ["0_DenseLayer", "1_OutputLayer"]


def run_config(**logging) -> RunConfig:
    return RunConfig.from_dict({
        "network": {"seed": 3, "updater": {"type": "sgd", "learning_rate": 0.1},
                    "input_type": {"type": "feed_forward", "size": 784},
                    "layers": [{"type": "dense", "n_out": 32, "activation": "relu"}, {"type": "output", "n_out": 10}]},
        "data": {"dataset": "mnist", "seed": 1, "limit_train": 1024, "limit_test": 300, "validation": {"split": 0.25}},
        "training": {"epochs": 1, "batch_size": 64, "backend": "cpu", "score_every": 0},
        "logging": {"stats_every": STATS_EVERY, "histogram_every": 2, "tensorboard": True, "mlflow_experiment": "sinks",
                    **logging},
    })


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One run with TensorBoard and MLflow on, trained one epoch, then resumed for a second:
    both tools must show the two epochs as one run."""
    from conftest import require_mnist

    require_mnist()
    from dl4py.runner import train_run

    tmp = tmp_path_factory.mktemp("sinks")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"  # the SQL store a tracking server uses, in a file
    config = run_config(mlflow=uri)
    with in_folder(tmp):
        train_run(config, output=tmp / "run", progress=False)
        result = train_run(config.with_overrides([f"training.epochs={EPOCHS}"]), output=tmp / "run",
                           resume=True, progress=False)
    records = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    return {"dir": tmp / "run", "uri": uri, "result": result, "records": records, "tmp": tmp}


@contextmanager
def in_folder(folder):
    """MLflow's default artifact root, ./mlruns, lands in ``folder``; no usage reports sent."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        patch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
        yield


def of_kind(records, kind):
    return [r for r in records if r["kind"] == kind]


def event_accumulator(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})  # 0: keep every point
    events.Reload()
    return events


@pytest.mark.slow
def test_tensorboard_holds_loss_validation_learning_rate_and_update_ratios(run):
    events = event_accumulator(run["dir"] / "tensorboard")
    epochs = of_kind(run["records"], "epoch")  # the first run's epoch, then the resumed run's

    def points(tag):
        return [(e.step, e.value) for e in events.Scalars(tag)]

    assert len(list((run["dir"] / "tensorboard").glob("events.out.tfevents.*"))) == 2  # the run, and its resume
    assert [r["epoch"] for r in epochs] == list(range(EPOCHS))
    assert [r["loss"] for r in epochs[1:]] == run["result"]["history"]["loss"]
    for key, tag in (("loss", "epoch/loss"), ("val_accuracy", "validation/accuracy"),
                     ("learning_rate", "epoch/learning_rate")):
        assert points(tag) == [(r["epoch"], pytest.approx(r[key], rel=1e-6)) for r in epochs], tag
    steps = list(range(STATS_EVERY, EPOCHS * BATCHES + 1, STATS_EVERY))  # 4, 8, ... 24
    assert points("train/learning_rate") == [(step, pytest.approx(0.1)) for step in steps]
    stats = of_kind(run["records"], "stats")
    assert [r["iteration"] for r in stats] == steps
    for layer in LAYERS:
        ratios = points(f"update_ratio/{layer}")
        assert [step for step, _ in ratios] == steps, layer
        assert ratios == [(r["iteration"], pytest.approx(r["layers"][layer]["update_ratio"], rel=1e-6)) for r in stats]
        assert all(0 < ratio < 1 for _, ratio in ratios), layer
    assert [step for step, _ in points("train/score")] == steps
    summary = events.Tensors("model/summary/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "DenseLayer" in summary or "dense" in summary


def test_mlflow_run_has_the_config_params_epoch_metrics_and_the_model(run):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(run["uri"])
    recorded = json.loads((run["dir"] / "mlflow.json").read_text())
    experiment = client.get_experiment_by_name("sinks")
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [recorded["run_id"]]  # the resume continued the same MLflow run
    mlrun = runs[0]
    assert mlrun.info.status == "FINISHED" and mlrun.info.run_name == "run"
    params = mlrun.data.params
    assert params["training.batch_size"] == "64" and params["network.updater.learning_rate"] == "0.1"
    assert params["network.layers.0.n_out"] == "32" and params["data.validation.split"] == "0.25"
    assert params["logging.stats_every"] == str(STATS_EVERY)
    assert params["training.epochs"] == "1"  # MLflow keeps a param's first value; the resume asked for 2

    epochs = of_kind(run["records"], "epoch")
    for key, tag in (("loss", "epoch/loss"), ("val_accuracy", "validation/accuracy"), ("val_loss", "validation/loss")):
        metric = sorted(client.get_metric_history(mlrun.info.run_id, tag), key=lambda m: m.step)
        assert [(m.step, m.value) for m in metric] == [(r["epoch"], pytest.approx(r[key])) for r in epochs], tag
    ratios = client.get_metric_history(mlrun.info.run_id, "update_ratio/0_DenseLayer")
    assert sorted(m.step for m in ratios) == list(range(STATS_EVERY, EPOCHS * BATCHES + 1, STATS_EVERY))
    tests = sorted(client.get_metric_history(mlrun.info.run_id, "test/accuracy"), key=lambda m: m.step)
    assert [m.step for m in tests] == [1, EPOCHS]  # each run's evaluation, after its last epoch
    assert tests[-1].value == pytest.approx(run["result"]["test_accuracy"])

    artifacts = {a.path for a in client.list_artifacts(mlrun.info.run_id)}
    assert {"model.dl4py", "evaluation.txt", "config.yaml", "report.html"} <= artifacts
    stored = Path(urlparse(mlrun.info.artifact_uri).path) / "model.dl4py"  # a local store: a file
    assert stored.read_bytes() == (run["dir"] / "model.dl4py").read_bytes()


def test_the_evaluation_record_has_the_confusion_matrix_and_per_class_scores(run):
    from dl4py.nn.loading import load

    evaluation = of_kind(run["records"], "evaluation")[-1]  # the resumed run's
    matrix = evaluation["confusion_matrix"]
    assert len(matrix) == 10 and sum(map(sum, matrix)) == evaluation["test_examples"] == 300
    assert evaluation["class_labels"] == [str(i) for i in range(10)]
    model = load(run["dir"] / "model.dl4py")
    from dl4py.run_data import make_iterators

    config = RunConfig.from_file(run["dir"] / "config.yaml")
    _, test = make_iterators(config.data, 64, config.network.input_type.example_shape())
    expected = model.evaluate(test)
    assert matrix == expected.confusion_matrix().tolist()
    for i in range(10):
        predicted = sum(row[i] for row in matrix)
        assert evaluation["class_precision"][i] == (None if predicted == 0 else pytest.approx(expected.precision(i)))
        assert evaluation["class_recall"][i] == pytest.approx(expected.recall(i))


def test_an_interrupted_run_ends_its_mlflow_run_killed_and_a_failed_one_failed(run):
    from dl4py.monitor.run_logging import RunLogging
    from dl4py.train.loop import TrainingInterrupted

    config = run_config(mlflow=run["uri"], tensorboard=False, mlflow_experiment="sinks-stopped")
    statuses = {}
    with in_folder(run["tmp"]):
        for name, stop in (("interrupted", TrainingInterrupted("stopped")), ("ctrl-c", KeyboardInterrupt()),
                           ("failed", RuntimeError("out of memory"))):
            (run["tmp"] / name).mkdir()
            sinks = RunLogging(config.logging, run["tmp"] / name, config, resumed=False)
            sinks.end(stop)  # what the runner does when training stops on `stop`
            statuses[name] = sinks.mlflow.client.get_run(sinks.mlflow.run_id).info.status
    assert statuses == {"interrupted": "KILLED", "ctrl-c": "KILLED", "failed": "FAILED"}


def test_the_python_api_ends_an_interrupted_mlflow_run_killed_and_makes_layer_names_valid_keys(run):
    from dl4py.monitor import MLflowStatsStorage

    with in_folder(run["tmp"]):
        storage = MLflowStatsStorage(run["uri"], experiment="sinks-interrupted")
        with pytest.raises(KeyboardInterrupt):
            with storage:
                storage.put_update({"kind": "stats", "iteration": 3, "score": 2.5,
                                    "layers": {"encoder:attn/../x": {"update_ratio": 1e-3}}})
                raise KeyboardInterrupt
    mlrun = storage.client.get_run(storage.run_id)
    assert mlrun.info.status == "KILLED"
    assert mlrun.data.metrics == {"train/score": 2.5, "update_ratio/encoder_attn/_/x": 1e-3}


@pytest.mark.parametrize("package", ["tensorboard", "mlflow"])
def test_a_missing_package_says_what_to_install(tmp_path, monkeypatch, package):
    from dl4py.monitor import MLflowStatsStorage, TensorBoardStatsStorage

    storage = {"tensorboard": lambda: TensorBoardStatsStorage(tmp_path / "tensorboard"),
               "mlflow": lambda: MLflowStatsStorage(str(tmp_path / "mlruns"))}[package]
    monkeypatch.setitem(sys.modules, package, None)  # what `import tensorboard` meets when it is not installed
    with pytest.raises(MissingDependencyError, match=rf'pip install "dl4py\[{package}\]"') as caught:
        storage()
    assert isinstance(caught.value, ImportError)


def test_a_run_asking_for_tensorboard_without_it_stops_before_training(tmp_path, mnist, monkeypatch, capsys):
    from dl4py.cli import main

    monkeypatch.setitem(sys.modules, "tensorboard", None)
    path = tmp_path / "run.yaml"
    path.write_text(run_config().to_yaml())
    assert main(["train", str(path), "--output", str(tmp_path / "run"), "--no-progress"]) == 2
    assert 'pip install "dl4py[tensorboard]"' in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing trained, nothing left behind


def test_logging_histogram_every_chooses_the_stats_records_that_carry_histograms(run):
    # Stats every 4 iterations, histograms in every 2nd of those: iterations 8, 16, 24.
    stats = [r for r in run["records"] if r["kind"] == "stats"]
    assert [r["iteration"] for r in stats if "histograms" in r] == [8, 16, 24]
    assert set(next(r for r in stats if "histograms" in r)["histograms"]) == set(LAYERS)


@pytest.mark.parametrize("logging, where", [
    ({"stats_evry": 5}, "logging.stats_evry"),
    ({"stats_every": -1}, "logging.stats_every"),
    ({"histogram_every": -1}, "logging.histogram_every"),
    ({"tensorboard": 3}, "logging.tensorboard"),
    ({"mlflow": ""}, "logging.mlflow"),
    ({"report": "yes"}, "logging.report"),
])
def test_a_bad_logging_value_is_refused_naming_its_key(logging, where):
    with pytest.raises(ConfigError) as caught:
        run_config(**logging)
    assert caught.value.where == where


def test_a_bad_logging_override_names_its_key():
    with pytest.raises(ConfigError, match="logging.stats_every: must be an integer"):
        run_config().with_overrides(["logging.stats_every=often"])
