"""DL4J's UIServer in the process (``UIServer.get_instance()``, ``attach``, ``detach``, ``stop``)
and ``dl4py train --ui``: an attached InMemoryStatsStorage answers /api/poll as a run folder
does (offsets are record indices, the same bounds), the page draws it in real Chromium, a
stopped server leaves no thread or port behind, and a training started with --ui serves its
page while it trains and ends when training does."""

from __future__ import annotations

import json
import math
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from dl4py import DenseLayer, InputType, MultiLayerNetwork, NetworkConfig, OutputLayer
from dl4py.cli import main
from dl4py.monitor import FileStatsStorage, InMemoryStatsStorage, StatsListener, StatsStorage, UIServer
from dl4py.monitor.bounded import MAX_LINE_BYTES, SERIES_POINTS
from dl4py.monitor.runs import MAX_READ_BYTES

import test_monitor_ui
from test_monitor_ui import CHART_POINTS, Page

CSV_CONFIG = """\
network:
  seed: 3
  updater: {{type: sgd, learning_rate: 0.1}}
  input_type: {{type: feed_forward, size: 4}}
  layers:
    - {{type: dense, n_out: 8, activation: relu}}
    - {{type: output, n_out: 2, activation: softmax, loss: negativeloglikelihood}}
data: {{dataset: csv, train_path: {train}, test_path: {test}, num_classes: 2}}
training: {{epochs: {epochs}, batch_size: 32, score_every: 0, backend: cpu}}
logging: {{stats_every: 5, report: false}}
"""


def fitted_storage(epochs: int = 2, batch_size: int = 8) -> InMemoryStatsStorage:
    """An InMemoryStatsStorage holding a real fit's records: static, stats every iteration, epochs."""
    storage = InMemoryStatsStorage()
    net = MultiLayerNetwork(NetworkConfig(layers=[DenseLayer(n_out=4), OutputLayer(n_out=2)],
                                          input_type=InputType.feed_forward(3), seed=1)).init()
    x = np.random.default_rng(0).random((32, 3)).astype("float32")
    net.fit(x, (x[:, 0] > 0.5).astype("int64"), epochs=epochs, batch_size=batch_size, verbose=0,
            listeners=[StatsListener(storage, frequency=1)])
    return storage


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def port_is_free(port: int) -> bool:
    """Whether a server could listen on ``port`` now (as servers do, with SO_REUSEADDR: the
    connections the old one closed may wait out TCP's TIME_WAIT there)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
            probe.listen()
        except OSError:
            return False
    return True


def ui_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("dl4py-ui")]


browser = test_monitor_ui.browser  # the fixture: real Chromium, or a skip saying how to get it


@pytest.fixture
def server():
    """A UIServer showing nothing yet, serving on a free port; stopped whatever the test did."""
    server = UIServer.empty(0).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.timeout(60)
def test_an_attached_in_memory_storage_is_polled_as_its_records(server):
    storage = fitted_storage()
    server.attach(storage)
    data = get_json(server.url + "api/poll?offsets=0")
    assert data["title"] == "dl4py ui: in-memory 1"
    assert [(run["name"], run["status"]) for run in data["runs"]] == [("in-memory 1", "in memory")]
    chunk = data["metrics"][0]
    assert chunk["records"] == json.loads(json.dumps(storage.records))  # each one, in order
    assert [r["kind"] for r in chunk["records"]] == ["static"] + ["stats"] * 4 + ["epoch"] + ["stats"] * 4 + ["epoch"]
    assert chunk["offset"] == len(storage.records) == 11 and not chunk["more"] and not chunk["reset"]
    assert chunk["seen"] == {"stats": 8, "epoch": 2, "iteration": 0}
    # The next poll gets what was added since, from the offset the page holds: a record index.
    StatsListener(storage).write({"kind": "evaluation", "epoch": 2, "test_loss": math.nan})
    later = get_json(server.url + "api/poll?offsets=11")["metrics"][0]
    assert later["records"] == [{**storage.records[-1], "test_loss": None}]  # NaN: null for the browser
    assert later["offset"] == 12
    storage.records.clear()  # emptied: the page starts over
    assert get_json(server.url + "api/poll?offsets=12")["metrics"][0]["reset"]


@pytest.mark.timeout(60)
def test_an_in_memory_run_is_bounded_as_a_metrics_file_is(server):
    storage = InMemoryStatsStorage()
    padding = "x" * 1000
    storage.records.append({"time": 0.0, "kind": "static", "model": {"summary": "a small model"}})
    storage.records.extend({"time": float(i), "kind": "stats", "iteration": i, "score": 1.0, "pad": padding}
                           for i in range(6000))
    storage.records.append({"time": 6000.0, "kind": "evaluation", "text": "huge" * MAX_LINE_BYTES})
    server.attach(storage, name="long")
    first = get_json(server.url + "api/poll?offsets=0")["metrics"][0]
    assert first["more"] and 0 < first["offset"] < len(storage.records)  # about MAX_READ_BYTES of records
    assert first["offset"] * len(padding) >= MAX_READ_BYTES * 0.9
    assert len(first["records"]) <= SERIES_POINTS + 1 and first["seen"]["stats"] == first["offset"] - 1
    assert first["records"][0]["kind"] == "static"
    assert first["records"][-1]["iteration"] == first["offset"] - 2  # the last one read is kept
    second = get_json(server.url + f"api/poll?offsets={first['offset']}")["metrics"][0]
    assert not second["more"] and second["offset"] == len(storage.records)
    assert second["records"][-1]["iteration"] == 5999 and len(second["records"]) <= SERIES_POINTS
    assert second["notes"] == ["records in memory: line 6002 (4.0 MiB) over the 1.0 MiB a record may be: skipped"]


@pytest.mark.timeout(60)
def test_a_file_storage_and_a_run_directory_attach_and_detach(server, tmp_path):
    file_storage = FileStatsStorage(tmp_path / "lenet" / "stats.jsonl")  # not metrics.jsonl: read where it writes
    file_storage.put({"kind": "epoch", "epoch": 0, "loss": 0.5})
    memory = InMemoryStatsStorage()
    waiting = tmp_path / "later"  # training has not made it yet
    server.attach(file_storage)
    server.attach(memory)
    server.attach(str(waiting))
    server.attach(memory)  # again: nothing changes
    data = get_json(server.url + "api/poll")
    assert [(run["name"], run["status"]) for run in data["runs"]] == [
        ("stats", "running"), ("in-memory 1", "pending"), ("later", "pending")]
    assert data["metrics"][0]["records"][0]["loss"] == 0.5
    assert len({run["key"] for run in data["runs"]}) == 3
    assert server.detach(memory) and not server.detach(memory) and not server.is_attached(memory)
    assert server.detach(waiting)  # a path names what was attached as a string
    assert [run["name"] for run in get_json(server.url + "api/poll")["runs"]] == ["stats"]
    with pytest.raises(TypeError, match="InMemoryStatsStorage, a FileStatsStorage or a run directory"):
        server.attach(StatsStorage())


@pytest.mark.timeout(60)
def test_get_instance_is_one_server_and_stop_leaves_no_thread_or_port_behind():
    ui = UIServer.get_instance()
    try:
        assert UIServer.get_instance() is ui
        port = ui.server_address[1]
        assert ui.url == f"http://127.0.0.1:{port}/"
        storage = fitted_storage(epochs=1)
        ui.attach(storage)
        assert get_json(ui.url + "api/poll")["runs"][0]["name"] == "in-memory 1"
        ui.detach(storage)
        assert get_json(ui.url + "api/poll")["runs"] == []
        idle = socket.create_connection(("127.0.0.1", port))  # a browser's connection opened ahead, unused
        try:
            ui.stop()
        finally:
            idle.close()
        assert ui_threads() == [] and port_is_free(port)
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(ui.url, timeout=5)
        again = UIServer.get_instance()
        assert again is not ui
        again.stop()
        ui.stop()  # a second stop does nothing
    finally:
        ui.stop()
    assert ui_threads() == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_page_draws_the_attached_run_and_follows_detach_and_attach(server, browser):
    # 11 records, and 13 of another shape: read from the first's offset, the second's would add
    # 1 epoch and 1 score point to the first's instead of being drawn alone.
    first, second = fitted_storage(epochs=2), fitted_storage(epochs=4, batch_size=16)
    server.attach(first)
    with Page(browser, server.url) as tab:
        page = tab.page
        page.wait_for_function("DL4PY.charts.score && DL4PY.charts.update_ratio")
        assert page.evaluate(CHART_POINTS, "score") == {"in-memory 1": 8}
        assert page.evaluate(CHART_POINTS, "epoch_loss") == {"in-memory 1": 2}
        assert set(page.evaluate(CHART_POINTS, "update_ratio")) == {"0_DenseLayer", "1_OutputLayer"}
        assert "Total parameters" in page.text_content("#model-summary")  # from the static record
        # Another storage takes the first's place: the page drops the first's points, starts the new afresh.
        server.detach(first)
        server.attach(second)
        page.wait_for_function("() => DL4PY.charts.epoch_loss.data.datasets.some(d => d.label === 'in-memory 2')",
                               timeout=30_000)
        page.wait_for_function("() => DL4PY.charts.epoch_loss.data.datasets[0].data.length === 4", timeout=30_000)
        assert page.evaluate(CHART_POINTS, "epoch_loss") == {"in-memory 2": 4}
        assert page.evaluate(CHART_POINTS, "score") == {"in-memory 2": 8}
        losses = page.evaluate("() => DL4PY.charts.epoch_loss.data.datasets[0].data.map(p => p.y)")
        assert losses == pytest.approx([r["loss"] for r in second.epochs])
        assert page.eval_on_selector_all("#runs-body tr", "rows => rows.map(r => r.cells[1].textContent)") == \
            ["in memory"]
        assert tab.errors == []


def _csv_config(tmp_path: Path, epochs: int) -> Path:
    rng = np.random.default_rng(0)
    for name, rows in (("train.csv", 256), ("test.csv", 64)):
        x = rng.random((rows, 4))
        np.savetxt(tmp_path / name, np.column_stack([x, x[:, 0] > 0.5]), delimiter=",", fmt="%.4f")
    config = tmp_path / "csv.yaml"
    config.write_text(CSV_CONFIG.format(train=tmp_path / "train.csv", test=tmp_path / "test.csv", epochs=epochs))
    return config


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
    process.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_train_with_ui_serves_the_run_while_it_trains_and_ends_with_it(tmp_path):
    run = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "dl4py", "train", str(_csv_config(tmp_path, epochs=10)), "--output", str(run),
         "--no-progress", "--ui", "--ui-port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stderr.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
        assert match and "stops when training ends" in line, line + process.stderr.read()
        url = match.group(0)
        first = get_json(url + "api/poll")
        assert [r["name"] for r in first["runs"]] == ["run"]
        assert first["runs"][0]["status"] in ("starting", "running"), first  # it answers while the run trains
        seen = []
        while True:  # as a page does; the server stops after the poll that follows the run's end
            try:
                seen.append(get_json(url + "api/poll")["runs"][0]["status"])
            except (urllib.error.URLError, ConnectionError):
                break
            threading.Event().wait(0.2)
        assert process.wait(timeout=60) == 0, process.stderr.read()
        assert seen[-1] == "completed", seen  # the page saw the run's end before the server stopped
        result = json.loads(process.stdout.read().strip().splitlines()[-1])  # stdout: the result's line alone
        assert result["run_dir"] == str(run) and result["epochs"] == 10
        assert port_is_free(int(match.group(1)))
    finally:
        _stop(process)
        process.stdout.close()
        process.stderr.close()


@pytest.mark.soak  # make test's budget: --ui without --ui-keep stays there
@pytest.mark.timeout(180)
def test_train_with_ui_keep_serves_on_until_ctrl_c(tmp_path):
    process = subprocess.Popen(
        [sys.executable, "-m", "dl4py", "train", str(_csv_config(tmp_path, epochs=2)), "--output",
         str(tmp_path / "run"), "--no-progress", "--ui", "--ui-port", "0", "--ui-keep"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = re.search(r"http://127\.0\.0\.1:\d+/", process.stderr.readline()).group(0)
        for line in process.stderr:
            if "serves on" in line:
                break
        assert get_json(url + "api/poll")["runs"][0]["status"] == "completed"
        assert process.poll() is None
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
    finally:
        _stop(process)
        process.stdout.close()
        process.stderr.close()


def test_ui_port_and_ui_keep_need_ui(tmp_path, capsys):
    config, run = _csv_config(tmp_path, epochs=1), str(tmp_path / "run")
    assert main(["train", str(config), "--output", run, "--ui-port", "0"]) == 2
    assert capsys.readouterr().err.strip() == ("dl4py train: error: --ui-port: applies with --ui only "
                                               "(dl4py train CONFIG --ui ...)")
    assert main(["train", str(config), "--output", run, "--ui-keep"]) == 2
    assert "--ui-keep: applies with --ui only" in capsys.readouterr().err
