"""``dl4py ui RUN`` started before the run's folder exists (the docs' ``dl4py train ... --output
runs/x & dl4py ui runs/x``): the server starts, says it waits, shows the run as pending, and shows
its epochs once training writes them. ``dl4py report`` of a missing folder stays an error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from dl4py import DenseLayer, InputType, MultiLayerNetwork, NetworkConfig, OutputLayer
from dl4py.cli import main
from dl4py.monitor import FileStatsStorage, StatsListener
from dl4py.monitor.server import UIServer

def _finished_run(tmp_path: Path) -> Path:
    """A small run directory: a real two-epoch fit's statistics."""
    folder = tmp_path / "source"
    net = MultiLayerNetwork(NetworkConfig(layers=[DenseLayer(n_out=4), OutputLayer(n_out=2)],
                                          input_type=InputType.feed_forward(3), seed=1)).init()
    x = np.random.default_rng(0).random((32, 3)).astype("float32")
    folder.mkdir()
    net.fit(x, (x[:, 0] > 0.5).astype("int64"), epochs=2, verbose=0,
            listeners=[StatsListener(FileStatsStorage(folder / "metrics.jsonl"))])
    return folder


def test_the_ui_waits_for_a_run_that_has_not_started(tmp_path):
    target = tmp_path / "runs" / "lenet"  # neither it nor runs/ exist yet
    server = UIServer([target], "127.0.0.1", 0)
    try:
        before = server.poll("")
        assert [run["status"] for run in before["runs"]] == ["pending"]
        source = _finished_run(tmp_path)
        shutil.copytree(source, target)
        after = server.poll("")
        assert after["runs"][0]["status"] != "pending"
        assert "loss" in json.dumps(after["metrics"][0])  # its records, read from the folder that appeared
    finally:
        server.server_close()


def test_report_of_a_missing_folder_is_still_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nothing")]) == 2
    assert "no such run directory or sweep folder" in capsys.readouterr().err
