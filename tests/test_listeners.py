"""Listeners: progress bar with ETA, performance, metrics file."""

from __future__ import annotations

import io
import json

import pytest
import torch

from dl4py import DenseLayer, InputType, MultiLayerNetwork, NetworkConfig, OutputLayer, Sgd
from dl4py.train import MetricsLogger, PerformanceListener, ProgressBar, ScoreIterationListener


def tiny_net():
    return MultiLayerNetwork(NetworkConfig(
        layers=[DenseLayer(n_out=8, activation="relu"), OutputLayer(n_out=3)],
        input_type=InputType.feed_forward(5), updater=Sgd(0.1), seed=1,
    ))


DATA = (torch.rand(100, 5), torch.randint(0, 3, (100,)))


def test_progress_bar_shows_batches_loss_validation_speed_and_eta():
    stream = io.StringIO()
    net = tiny_net()
    net.fit(DATA, epochs=2, batch_size=10, validation=DATA,
            listeners=[ProgressBar(2, 10, stream=stream, interval=0.0)])  # and no second one of verbose's
    lines = stream.getvalue().split("\n")
    assert len(lines) == 3 and lines[-1] == ""  # one finished line per epoch
    shown = [line.rsplit("\r", 1)[-1] for line in lines[:-1]]  # what stays on screen
    assert shown[0].startswith("epoch 1/2 100%|") and shown[1].startswith("epoch 2/2 100%|"), shown
    for line in shown:  # elapsed<ETA, speed, the epoch's loss and the validation scores
        assert "| 10/10 [" in line and "<00:00, " in line and " samples/s, loss " in line, line
        assert ", val_loss " in line and ", val_accuracy " in line, line
    assert "val_accuracy" in lines[1].split("\r")[2]  # epoch 1's scores, shown while epoch 2 runs


def test_performance_listener_measures_throughput():
    perf = PerformanceListener(frequency=5, report=False)
    tiny_net().fit(DATA, epochs=1, batch_size=10, listeners=[perf])
    assert perf.samples_per_second > 0
    assert perf.samples_per_second / perf.batches_per_second == pytest.approx(10)  # batch size


def test_metrics_logger_writes_iterations_and_epochs(tmp_path):
    path = tmp_path / "metrics.jsonl"
    logger = MetricsLogger(path, every=4)
    tiny_net().fit(DATA, epochs=2, batch_size=10, listeners=[logger])
    logger.write({"kind": "note", "value": 1})
    records = [json.loads(line) for line in path.read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    assert kinds.count("iteration") == 5  # iterations 4, 8, 12, 16, 20
    assert kinds.count("epoch") == 2 and kinds[-1] == "note"
    assert all(r["time"] >= 0 for r in records)
    epoch = next(r for r in records if r["kind"] == "epoch")
    assert epoch["examples"] == 100 and epoch["batches"] == 10 and epoch["samples_per_second"] > 0


def test_listeners_count_iterations_that_move_by_more_than_one(tmp_path):
    """A parallel fit calls once a round, for every worker's batches: with two workers and 9
    batches, iterations 2, 4, 6, 8, 9. "Every 3" is then each multiple of 3 passed."""
    net, stream = tiny_net().init(), io.StringIO()
    score, metrics = ScoreIterationListener(3), MetricsLogger(tmp_path / "metrics.jsonl", every=3)
    bar, speed = ProgressBar(1, 9, stream=stream, interval=3600), PerformanceListener(frequency=4, report=False)
    listeners = [score, metrics, bar, speed]
    for listener in listeners:
        listener.on_epoch_start(net, 0)
    for iteration in (2, 4, 6, 8, 9):
        for listener in listeners:
            listener.iteration_done(net, iteration, 0, torch.tensor(0.5), 10 * (iteration % 2 or 2))
    metrics.on_fit_end(net, False)
    bar.on_fit_end(net, False)
    assert [i for i, _ in score.history] == [4, 6, 9]
    assert [json.loads(line)["iteration"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [4, 6, 9]
    assert "| 9/9 [" in stream.getvalue()  # drawn at the end of the epoch, whatever the interval
    assert speed.samples_per_second / speed.batches_per_second == pytest.approx(10)
