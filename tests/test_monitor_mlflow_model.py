"""A run's model as an MLflow Model: loaded back with MLflow's own ``pyfunc.load_model``, its
signature, a registered version, and ``mlflow models serve`` answering HTTP requests, all
against a real MLflow on SQLite; predictions compared with ``model.output``."""

from __future__ import annotations

import gc
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from dl4py.config import RunConfig
from dl4py.errors import DataError
from dl4py.nn.loading import load
from test_monitor_sinks import in_folder  # MLflow's ./mlruns in a test's folder, no usage reports

# MLflow's SQL store warns about its own use of SQLAlchemy; nothing dl4py can change.
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")
mlflow = pytest.importorskip("mlflow")

FEATURES, CLASSES = 4, 3
TOLERANCE = 1e-6  # docs/monitoring.md: the MLflow Model answers model.output's probabilities


def write_csv(path, rows: int, seed: int) -> None:
    generator = np.random.default_rng(seed)
    features = generator.normal(size=(rows, FEATURES)) * 3 + 5  # far from 0 and 1: the normalizer matters
    labels = generator.integers(0, CLASSES, size=rows)
    path.write_text("".join(",".join(f"{v:.4f}" for v in row) + f",{label}\n" for row, label in zip(features, labels)))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One short run through the run-config path with ``logging.mlflow`` on SQLite."""
    from dl4py.runner import train_run

    tmp = tmp_path_factory.mktemp("mlflow-model")
    write_csv(tmp / "train.csv", 96, seed=1)
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    config = RunConfig.from_dict({
        "network": {"seed": 3, "updater": {"type": "sgd", "learning_rate": 0.1},
                    "input_type": {"type": "feed_forward", "size": FEATURES},
                    "layers": [{"type": "dense", "n_out": 8, "activation": "relu"},
                               {"type": "output", "n_out": CLASSES}]},
        "data": {"dataset": "csv", "train_path": str(tmp / "train.csv"), "num_classes": CLASSES,
                 "normalizer": "standardize"},
        "training": {"epochs": 1, "batch_size": 32, "backend": "cpu", "score_every": 0},
        "logging": {"mlflow": uri, "mlflow_experiment": "mlflow-model", "report": False},
    })
    with in_folder(tmp):
        train_run(config, output=tmp / "run", progress=False)
    run_id = json.loads((tmp / "run" / "mlflow.json").read_text())["run_id"]
    return {"dir": tmp / "run", "uri": uri, "run_id": run_id, "tmp": tmp}



@pytest.fixture(autouse=True)
def mlflow_pool_threads_ended():
    """MLflow's artifact repositories (one per download) each start a thread pool, whose idle
    threads end when the repository is garbage: collected here, so that conftest's check for
    threads left running sees only threads dl4py would have left."""
    before = set(threading.enumerate())
    yield
    gc.collect()
    for thread in set(threading.enumerate()) - before:
        if thread.name.startswith("Mlflow") and "ArtifactRepository" in thread.name:
            thread.join(timeout=10)


@pytest.fixture
def tracking(run, monkeypatch):
    """MLflow's own functions (pyfunc.load_model) read runs:/ and models:/ URIs against the run's store."""
    monkeypatch.chdir(run["tmp"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", run["uri"])
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    return run


def rows(count: int = 5) -> np.ndarray:
    return (np.random.default_rng(7).normal(size=(count, FEATURES)) * 3 + 5).astype(np.float32)


def expected(run, features) -> np.ndarray:
    return load(run["dir"] / "model.dl4py").output(features).numpy()


@pytest.mark.slow  # a run, then MLflow reads every installed package's metadata: ~30 s on 2 cores
def test_mlflow_loads_the_run_model_and_predicts_its_probabilities(tracking):
    model = mlflow.pyfunc.load_model(f"runs:/{tracking['run_id']}/model")
    features = rows()
    predicted = model.predict(features)
    assert predicted.shape == (len(features), CLASSES)
    np.testing.assert_allclose(predicted, expected(tracking, features), rtol=0, atol=TOLERANCE)
    np.testing.assert_allclose(predicted.sum(axis=1), 1, atol=1e-5)  # probabilities, not class indices

    artifacts = {a.path for a in mlflow.MlflowClient(tracking["uri"]).list_artifacts(tracking["run_id"])}
    assert {"model", "model.dl4py", "config.yaml"} <= artifacts  # the plain files are kept


@pytest.mark.slow  # a run, then MLflow reads every installed package's metadata: ~30 s on 2 cores
def test_the_signature_names_the_input_and_output_shapes_and_the_requirements_are_pinned(tracking):
    import dl4py

    info = mlflow.models.get_model_info(f"runs:/{tracking['run_id']}/model")
    (inputs,), (outputs,) = info.signature.inputs.inputs, info.signature.outputs.inputs
    assert (inputs.type, inputs.shape) == (np.dtype(np.float32), (-1, FEATURES))
    assert (outputs.type, outputs.shape) == (np.dtype(np.float32), (-1, CLASSES))
    assert info.run_id == tracking["run_id"]
    folder = mlflow.artifacts.download_artifacts(f"runs:/{tracking['run_id']}/model", dst_path=str(tracking["tmp"] / "dl"))
    requirements = open(os.path.join(folder, "requirements.txt")).read().split()
    assert f"dl4py=={dl4py.__version__}" in requirements
    assert any(r.startswith("torch==") and "+" not in r for r in requirements)
    example = np.array(json.load(open(os.path.join(folder, "input_example.json"))))
    assert example.shape == (1, FEATURES)


@pytest.mark.slow  # a run, then MLflow reads every installed package's metadata: ~30 s on 2 cores
def test_a_registered_version_loads_by_its_name(tracking):
    from dl4py.monitor import MLflowStatsStorage

    with MLflowStatsStorage(tracking["uri"], experiment="mlflow-model-registry") as storage:
        uri = storage.log_model(tracking["dir"] / "model.dl4py", registered_model_name="dl4py-csv")
        storage.log_model(tracking["dir"] / "model.dl4py", registered_model_name="dl4py-csv")  # version 2
    assert uri == f"runs:/{storage.run_id}/model"
    versions = mlflow.MlflowClient(tracking["uri"]).search_model_versions("name = 'dl4py-csv'")
    assert sorted(int(v.version) for v in versions) == [1, 2] and {v.run_id for v in versions} == {storage.run_id}
    features = rows(3)
    predicted = mlflow.pyfunc.load_model("models:/dl4py-csv/1").predict(features)
    np.testing.assert_allclose(predicted, expected(tracking, features), rtol=0, atol=TOLERANCE)


def test_a_plain_torch_module_file_is_refused_naming_it(tmp_path):
    import torch

    from dl4py.monitor.mlflow_model import save_mlflow_model
    from dl4py.nn import TorchModel

    module = torch.nn.Linear(FEATURES, CLASSES)
    TorchModel(module, torch.nn.CrossEntropyLoss(), torch.optim.SGD(module.parameters(), lr=0.1)).save(
        tmp_path / "plain.dl4py")
    with pytest.raises(DataError, match=r"plain\.dl4py holds a plain torch module"):
        save_mlflow_model(tmp_path / "plain.dl4py", tmp_path / "mlflow-model")


def test_a_completed_run_whose_model_mlflow_cannot_take_warns_and_keeps_the_plain_file(tmp_path, caplog):
    import torch

    from dl4py.monitor.run_logging import RunLogging
    from dl4py.nn import TorchModel

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = RunConfig.from_dict({
        "network": {"input_type": {"type": "feed_forward", "size": FEATURES}, "layers": [{"type": "output", "n_out": 2}]},
        "logging": {"mlflow": uri, "mlflow_experiment": "mlflow-model-refused", "report": False},
    })
    module = torch.nn.Linear(FEATURES, 2)
    with in_folder(tmp_path):
        sinks = RunLogging(config.logging, tmp_path / "run", config, resumed=False)
        TorchModel(module, torch.nn.CrossEntropyLoss(), torch.optim.SGD(module.parameters(), lr=0.1)).save(
            tmp_path / "run" / "model.dl4py")  # a model file dl4py.load cannot rebuild alone
        with caplog.at_level("WARNING", logger="dl4py"):
            sinks.finish()
    assert "could not log" in caplog.text and "plain torch module" in caplog.text
    client = mlflow.MlflowClient(uri)
    assert client.get_run(sinks.mlflow.run_id).info.status == "FINISHED"
    assert {a.path for a in client.list_artifacts(sinks.mlflow.run_id)} >= {"model.dl4py"}


def test_without_mlflow_the_model_module_says_what_to_install(monkeypatch):
    from dl4py.errors import MissingDependencyError

    monkeypatch.delitem(sys.modules, "dl4py.monitor.mlflow_model", raising=False)
    monkeypatch.setitem(sys.modules, "mlflow", None)  # what an environment without it gives
    with pytest.raises(MissingDependencyError, match=r'an MLflow Model needs the \'mlflow\' package: pip install "dl4py\[mlflow\]"'):
        importlib.import_module("dl4py.monitor.mlflow_model")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


@pytest.mark.soak  # make test's budget (DEVELOPERS.md): make soak runs it; the pyfunc model's tests stay
@pytest.mark.timeout(240)  # a server that starts torch and MLflow: over a minute on a busy 2-core machine
def test_mlflow_models_serve_answers_with_the_model_probabilities(tracking):
    port = free_port()
    command = [sys.executable, "-m", "mlflow", "models", "serve", "-m", f"runs:/{tracking['run_id']}/model",
               "--env-manager", "local", "-h", "127.0.0.1", "-p", str(port)]
    log_file = open(tracking["tmp"] / "serve.log", "wb")
    server = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        features = rows(4)
        deadline = time.monotonic() + 200
        while True:
            assert server.poll() is None, (tracking["tmp"] / "serve.log").read_text()[-3000:]
            try:
                answer = post(f"http://127.0.0.1:{port}/invocations", {"inputs": features.tolist()})
                break
            except urllib.error.HTTPError as error:  # it answered: no retry
                pytest.fail(f"{error}: {error.read().decode(errors='replace')}")
            except (urllib.error.URLError, ConnectionError):  # not listening yet
                assert time.monotonic() < deadline, (tracking["tmp"] / "serve.log").read_text()[-3000:]
                time.sleep(0.5)
        np.testing.assert_allclose(np.array(answer["predictions"]), expected(tracking, features), rtol=0,
                                   atol=TOLERANCE)
    finally:
        try:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=20)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log_file.close()
