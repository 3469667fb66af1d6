"""A run's stats as a Weights & Biases run: real wandb in offline mode (nothing reaches the
network), read back from the run's own ``.wandb`` file; the config's ``logging.wandb``.

The tests that start a W&B run are slow: wandb's first run in a process imports its launch and
public-API modules, over 10 s on a 2-core machine."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path

import pytest

from descendants import living, started_processes
from dl4py import ArrayDataSetIterator, MultiLayerNetwork
from dl4py.config import RunConfig
from dl4py.errors import ConfigError, MissingDependencyError
from dl4py.monitor import InMemoryStatsStorage, StatsListener, WandbStatsStorage
from toy import mlp, toy

LAYERS = ["0_DenseLayer", "1_OutputLayer"]
EPOCHS, BATCHES, STATS_EVERY = 2, 4, 2  # 256 toy examples in batches of 64
FILE_CLOSE_S = 30.0  # the longest wait for wandb's service to close a finished run's file

# Asked without importing wandb: collecting the suite should not cost wandb's import.
needs_wandb = pytest.mark.skipif(find_spec("wandb") is None, reason="needs wandb: pip install \"dl4py[wandb]\"")


def starts_wandb(test):
    """A test that starts W&B runs: slow, a timeout, skipped without wandb."""
    return needs_wandb(pytest.mark.slow(pytest.mark.timeout(300)(test)))


@pytest.fixture(scope="module")
def offline_wandb(tmp_path_factory):
    """wandb offline and silent, its folders in tmp; its service process started once for the
    module (it sets WANDB_SERVICE, which the leak check would see appear in the first test) and
    stopped at the end, leaving no process behind. Gives the processes that service is."""
    import wandb  # optional: wandb (extra wandb); the tests using this fixture skip without it

    home = tmp_path_factory.mktemp("wandb_home")
    before = started_processes()
    with pytest.MonkeyPatch.context() as patch:
        for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
            patch.setenv(name, str(home))
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("WANDB_SILENT", "true")
        wandb.setup()
        try:
            yield started_processes() - before
        finally:
            wandb.teardown()
    assert not living(started_processes() - before), "wandb left a process running"


def read_offline_run(folder: Path) -> dict:
    """The records of the finished offline run in ``folder`` (``dir``/wandb/offline-run-*): its
    history rows (without wandb's own ``_`` keys), config, step metrics and exit code. wandb's
    service writes the file's last block as it closes the run's stream, just after ``finish``
    returns: read until the exit record is there."""
    deadline = time.monotonic() + FILE_CLOSE_S
    run = _read_run_file(next(folder.glob("run-*.wandb")))
    while run["exit_code"] is None and time.monotonic() < deadline:
        time.sleep(0.1)
        run = _read_run_file(next(folder.glob("run-*.wandb")))
    return run


def _read_run_file(path: Path) -> dict:
    """The records of a ``.wandb`` file, as ``read_offline_run`` gives them. A ``.wandb`` file
    is LevelDB's log format (32 KiB blocks of chunks with a 7-byte header) of wandb's
    ``Record`` protobufs, after a 7-byte file header; wandb has no Python reader of its own."""
    from wandb.proto import wandb_internal_pb2  # optional: wandb (extra wandb)

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a .wandb file this reader knows"
    run = {"history": [], "config": {}, "metrics": {}, "exit_code": None}
    position, pending = 7, b""
    while position + 7 <= len(data):
        left_in_block = 32768 - position % 32768
        if left_in_block < 7:  # a block's tail too short for a header is padding
            position += left_in_block
            continue
        _, length, chunk_type = struct.unpack("<IHB", data[position:position + 7])
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if chunk_type in (1, 4):  # a whole record, or a record's last chunk
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            _add_record(run, record)
    return run


def _add_record(run: dict, record) -> None:
    kind = record.WhichOneof("record_type")
    if kind == "history":
        row: dict = {}
        for item in record.history.item:  # a value's path: one key, or a logged object's fields
            *outer, last = [item.key] if item.key else item.nested_key
            place = row
            for key in outer:
                place = place.setdefault(key, {})
            place[last] = json.loads(item.value_json)
        run["history"].append({k: v for k, v in row.items() if not k.startswith("_")})
    elif kind in ("run", "config"):
        updates = record.run.config.update if kind == "run" else record.config.update
        run["config"].update({item.key: json.loads(item.value_json) for item in updates})
        if kind == "run":
            run["run_id"], run["project"], run["name"] = record.run.run_id, record.run.project, record.run.display_name
    elif kind == "metric":
        run["metrics"][record.metric.name or record.metric.glob_name] = record.metric.step_metric
    elif kind == "exit":
        run["exit_code"] = record.exit.exit_code


def offline_runs(wandb_dir: Path) -> list[Path]:
    return sorted(wandb_dir.glob("offline-run-*"))


def points(run: dict, name: str, axis: str) -> list[tuple]:
    return [(row[axis], row[name]) for row in run["history"] if name in row]


@starts_wandb
def test_a_fit_logs_score_update_ratios_and_epochs_against_their_own_steps(tmp_path, offline_wandb):
    x, y = toy()
    model = MultiLayerNetwork(mlp())
    model.init()
    memory = InMemoryStatsStorage()
    storage = WandbStatsStorage(project="toy", name="first", config={"training": {"batch_size": 64}},
                                mode="offline", dir=tmp_path)
    with storage:
        listener = StatsListener([storage, memory], frequency=STATS_EVERY, histogram_every=2)
        model.fit(ArrayDataSetIterator(x, y, batch_size=64), epochs=EPOCHS, listeners=[listener],
                  validation=ArrayDataSetIterator(x[:64], y[:64], batch_size=64))
        listener.write({"kind": "evaluation", "epoch": model.epoch_count, "test_accuracy": 0.75})
    assert started_processes() <= offline_wandb  # the run's own helpers (system metrics) stopped with it

    [folder] = offline_runs(tmp_path / "wandb")
    run = read_offline_run(folder)
    assert (run["project"], run["name"], run["run_id"], run["exit_code"]) == ("toy", "first", storage.run_id, 0)

    stats, epochs = memory.updates, memory.epochs
    steps = list(range(STATS_EVERY, EPOCHS * BATCHES + 1, STATS_EVERY))
    assert [r["iteration"] for r in stats] == steps
    assert points(run, "train/score", "iteration") == [(r["iteration"], pytest.approx(r["score"])) for r in stats]
    for layer in LAYERS:
        assert points(run, f"update_ratio/{layer}", "iteration") == [
            (r["iteration"], pytest.approx(r["layers"][layer]["update_ratio"])) for r in stats], layer
    with_histograms = [r for r in stats if "histograms" in r]
    assert [r["iteration"] for r in with_histograms] == [4, 8]  # every second stats record
    for kind in ("parameters", "gradients", "updates"):
        logged = points(run, f"histogram/{kind}/0_DenseLayer", "iteration")
        expected = [r["histograms"]["0_DenseLayer"][kind] for r in with_histograms]
        assert [(step, h["_type"], h["values"]) for step, h in logged] == [
            (r["iteration"], "histogram", e["counts"]) for r, e in zip(with_histograms, expected)], kind
        for (_, h), e in zip(logged, expected):
            assert len(h["bins"]) == len(e["counts"]) + 1
            assert (h["bins"][0], h["bins"][-1]) == (pytest.approx(e["min"]), pytest.approx(e["max"]))
    # Epochs are read from 1: History's epoch 0 is the chart's epoch 1.
    assert [r["epoch"] for r in epochs] == [0, 1]
    for key, name in (("loss", "epoch/loss"), ("val_loss", "validation/loss"), ("learning_rate", "epoch/learning_rate")):
        assert points(run, name, "epoch") == [(r["epoch"] + 1, pytest.approx(r[key])) for r in epochs], name
    assert points(run, "test/accuracy", "epoch") == [(EPOCHS, 0.75)]  # on the last epoch's point

    assert run["metrics"]["train/*"] == run["metrics"]["update_ratio/*"] == run["metrics"]["histogram/*"] == "iteration"
    assert run["metrics"]["epoch/*"] == run["metrics"]["validation/*"] == run["metrics"]["test/*"] == "epoch"
    assert run["config"]["training"] == {"batch_size": 64}
    static = run["config"]["dl4py"]
    assert (static["parameters"], static["layers"], static["workers"]) == (model.num_params(), LAYERS, 1)
    assert static["environment"]["backend"] == "cpu"
    assert (folder / "files" / "model_summary.txt").read_text() == model.summary() + "\n"


@starts_wandb
@pytest.mark.parametrize("stop, exit_code", [(RuntimeError("out of memory"), 1), (KeyboardInterrupt(), 255)])
def test_a_failed_fit_finishes_the_run_failed_and_an_interrupted_one_with_wandbs_ctrl_c_code(
        tmp_path, offline_wandb, stop, exit_code):
    with pytest.raises(type(stop)):
        with WandbStatsStorage(project="toy", mode="offline", dir=tmp_path) as storage:
            storage.put_update({"kind": "stats", "iteration": 3, "score": 2.5})
            raise stop
    assert storage.exit_code == exit_code
    [folder] = offline_runs(tmp_path / "wandb")
    run = read_offline_run(folder)
    assert run["exit_code"] == exit_code
    assert points(run, "train/score", "iteration") == [(3, 2.5)]
    assert started_processes() <= offline_wandb


@starts_wandb
def test_a_disabled_run_takes_every_record_and_writes_nothing(tmp_path, offline_wandb):
    storage = WandbStatsStorage(project="toy", mode="disabled", dir=tmp_path)
    storage.put_any({"kind": "static", "model": {"summary": "a model", "parameters": 3, "layers": []}})
    storage.put_any({"kind": "stats", "iteration": 1, "score": 2.0})
    storage.put_any({"kind": "epoch", "epoch": 0, "loss": 2.0})
    storage.close()
    assert storage.exit_code == 0 and not any(tmp_path.iterdir())


QUIET_RUN = """
from dl4py.monitor import WandbStatsStorage

storage = WandbStatsStorage(project="toy", mode="offline", dir=".")
storage.put_epoch({"kind": "epoch", "epoch": 0, "loss": 1.5})
print("dl4py's own line")
storage.close()
"""


@starts_wandb
def test_wandb_prints_nothing_to_the_console_and_does_not_capture_it(tmp_path, offline_wandb):
    # A fresh process: wandb reads WANDB_SILENT once per process, and this module's is set.
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_SILENT", "WANDB_SERVICE")}
    before = started_processes()
    shown = subprocess.run([sys.executable, "-c", QUIET_RUN], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=240)
    assert (shown.returncode, shown.stdout, shown.stderr) == (0, "dl4py's own line\n", "")
    [folder] = offline_runs(tmp_path / "wandb")
    assert read_offline_run(folder)["exit_code"] == 0
    assert not (folder / "files" / "output.log").exists()  # wandb's copy of a captured console
    assert not living(started_processes() - before)  # its service stopped with it


def run_config(**logging) -> RunConfig:
    return RunConfig.from_dict({
        "network": {"seed": 3, "updater": {"type": "sgd", "learning_rate": 0.1},
                    "input_type": {"type": "feed_forward", "size": 784},
                    "layers": [{"type": "dense", "n_out": 16, "activation": "relu"}, {"type": "output", "n_out": 10}]},
        "data": {"dataset": "mnist", "seed": 1, "limit_train": 256, "limit_test": 100},
        "training": {"epochs": 1, "batch_size": 64, "backend": "cpu", "score_every": 0},
        "logging": {"stats_every": 2, "report": False, **logging},
    })


@starts_wandb
def test_dl4py_train_with_logging_wandb_records_and_resumes_one_run(tmp_path, mnist, offline_wandb):
    from dl4py.cli import main

    path = tmp_path / "run.yaml"
    path.write_text(run_config(wandb="mnist-runs", wandb_mode="offline").to_yaml())
    run_dir = tmp_path / "run"
    assert main(["train", str(path), "--output", str(run_dir), "--no-progress"]) == 0
    assert main(["train", str(path), "--output", str(run_dir), "--resume", "--no-progress",
                 "--set", f"training.epochs={EPOCHS}"]) == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    recorded = json.loads((run_dir / "wandb.json").read_text())
    first, resumed = (read_offline_run(folder) for folder in offline_runs(run_dir / "wandb"))
    assert first["run_id"] == resumed["run_id"] == recorded["run_id"]  # the resume continues the same run
    assert recorded["project"] == first["project"] == "mnist-runs" and first["name"] == "run"
    assert first["exit_code"] == resumed["exit_code"] == 0
    assert first["config"]["training"]["batch_size"] == 64 and first["config"]["logging"]["wandb"] == "mnist-runs"

    epochs = [r for r in records if r["kind"] == "epoch"]
    logged = points(first, "epoch/loss", "epoch") + points(resumed, "epoch/loss", "epoch")
    assert logged == [(r["epoch"] + 1, pytest.approx(r["loss"])) for r in epochs] and len(logged) == EPOCHS
    evaluations = [r for r in records if r["kind"] == "evaluation"]
    assert points(resumed, "test/accuracy", "epoch") == [(EPOCHS, pytest.approx(evaluations[-1]["test_accuracy"]))]
    iterations = [r["iteration"] for r in records if r["kind"] == "stats"]
    assert [step for step, _ in points(first, "train/score", "iteration") + points(resumed, "train/score", "iteration")] \
        == iterations and iterations[-1] == EPOCHS * 4  # 256 examples in batches of 64
    assert started_processes() <= offline_wandb


@starts_wandb
def test_a_run_that_fails_finishes_its_wandb_run_failed(tmp_path, offline_wandb):
    from dl4py.monitor.run_logging import RunLogging

    config = run_config(wandb="toy", wandb_mode="offline")
    sinks = RunLogging(config.logging, tmp_path, config, resumed=False)
    sinks.end(RuntimeError("out of memory"))  # what the runner does when training fails
    [folder] = offline_runs(tmp_path / "wandb")
    assert read_offline_run(folder)["exit_code"] == 1


def test_a_missing_wandb_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` meets when it is not installed
    with pytest.raises(MissingDependencyError, match=r'^W&B logging needs the \'wandb\' package: '
                                                     r'pip install "dl4py\[wandb\]"$') as caught:
        WandbStatsStorage(project="toy", mode="offline", dir=tmp_path)
    assert isinstance(caught.value, ImportError)


def test_a_run_asking_for_wandb_without_it_stops_before_training(tmp_path, mnist, monkeypatch, capsys):
    from dl4py.cli import main

    monkeypatch.setitem(sys.modules, "wandb", None)
    path = tmp_path / "run.yaml"
    path.write_text(run_config(wandb="toy").to_yaml())
    assert main(["train", str(path), "--output", str(tmp_path / "run"), "--no-progress"]) == 2
    assert 'pip install "dl4py[wandb]"' in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing trained, nothing left behind


@pytest.mark.parametrize("logging, where", [({"wandb": " "}, "logging.wandb"),
                                            ({"wandb_mode": "offine"}, "logging.wandb_mode")])
def test_a_bad_wandb_setting_is_refused_naming_its_key(logging, where):
    with pytest.raises(ConfigError) as caught:
        run_config(**logging)
    assert caught.value.where == where


def test_a_bad_mode_is_refused_before_wandb_starts(tmp_path):
    with pytest.raises(ValueError, match="mode must be one of online, offline, disabled"):
        WandbStatsStorage(project="toy", mode="offine", dir=tmp_path)
    assert not (tmp_path / "wandb").exists()
