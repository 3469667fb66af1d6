"""One epoch, one number (issue 32): every message a person reads counts epochs from 1, the
numbers a program reads (History, metrics.jsonl, best_model_epoch) from 0.

Each test trains a tiny MLP for real, a few batches of 16 on the CPU, and reads the same
epoch (the second, 0-based index 1) in the console's line, an early-stopping log line, the
Ctrl-C message, a data error and the ``--resume`` message.
"""

from __future__ import annotations

import json
import re

import pytest
import yaml
from torch.utils.data import DataLoader, TensorDataset

import dl4py.runner
from dl4py import ArrayDataSetIterator, DataError, MultiLayerNetwork, RunConfig
from dl4py.errors import WorkerError
from dl4py.parallel import ParallelWrapper
from dl4py.resume import resumed_message
from dl4py.runner import train_run
from dl4py.train import TrainingInterrupted
from dl4py.train.early_stopping import EarlyStoppingConfiguration, EarlyStoppingTrainer, MaxEpochs, ScoreCalculator
from dl4py.train.numbering import batch_location, epoch_name, round_name, stop_point

from test_resume_exact import CtrlCAt  # a real Ctrl-C (SIGINT to this process) after an iteration
from toy import mlp, toy  # noqa: E402

BATCH, BATCHES = 16, 4  # 64 rows: four batches an epoch
CONSOLE_LINE = re.compile(r"epoch (\d+)/(\d+): loss ")


def console_epochs(err: str) -> list[int]:
    """The epoch numbers of the console's lines (``verbose=2``) in ``err``."""
    return [int(m.group(1)) for line in err.splitlines() if (m := CONSOLE_LINE.match(line))]


class Scripted(ScoreCalculator):
    """One scripted score per evaluation."""

    def __init__(self, scores):
        self.scores, self.minimize_score = list(scores), True

    def calculate_score(self, model):
        return self.scores.pop(0)


def test_the_words_for_epochs_batches_rounds_and_stops():
    assert (epoch_name(0), batch_location(1, 3), round_name(0)) == ("epoch 1", "epoch 2, batch 4", "round 1")
    # A stopped model's counters: the last batch trained, an epoch's end, nothing trained.
    assert stop_point(1, 2) == "epoch 2, batch 2" == batch_location(1, 1)
    assert (stop_point(2, 0), stop_point(0, 0)) == ("the end of epoch 2", "the start of epoch 1")


def test_the_console_and_early_stopping_count_from_1_and_the_result_from_0(capsys, caplog):
    x, y = toy(BATCH * BATCHES)
    config = EarlyStoppingConfiguration(score_calculator=Scripted([5.0, 4.0, 4.5]), epoch_conditions=[MaxEpochs(3)])
    with caplog.at_level("INFO", logger="dl4py"):
        result = EarlyStoppingTrainer(config, MultiLayerNetwork(mlp()), ArrayDataSetIterator(x, y, BATCH)).fit(
            verbose=2)
    assert console_epochs(capsys.readouterr().err) == [1, 2, 3]
    scored = [m.groups() for m in map(re.compile(r"epoch (\d+): score ([\d.]+) \(best ([\d.]+) at epoch (\d+)\)").match,
                                       caplog.messages) if m]
    assert scored == [("1", "5.000000", "5.000000", "1"), ("2", "4.000000", "4.000000", "2"),
                      ("3", "4.500000", "4.000000", "2")]
    # What a program reads stays DL4J's and Keras' 0-based index of the same epoch.
    assert result.best_model_epoch == 1 and list(result.score_vs_epoch) == [0, 1, 2]
    assert result.history.epoch == [0, 1, 2]


@pytest.mark.parametrize("bad, where", [
    ("label", "epoch 2, batch 3: label 7 is outside the output layer's 3 classes"),  # checked as read
    ("features", "epoch 2, batch 1: features have shape [16, 4]"),  # the epoch's first batch, checked at its step
])
def test_a_data_error_in_the_second_epoch_says_epoch_2(capsys, bad, where):
    x, y = toy(BATCH * BATCHES)
    passes = []

    def batches():
        """The data of each epoch; the second has a bad batch."""
        passes.append(len(passes))
        for index in range(BATCHES):
            features, labels = x[index * BATCH:(index + 1) * BATCH], y[index * BATCH:(index + 1) * BATCH].clone()
            if len(passes) == 2 and bad == "label" and index == 2:
                labels[5] = 7
            if len(passes) == 2 and bad == "features" and index == 0:
                features = features[:, :4]
            yield features, labels

    model = MultiLayerNetwork(mlp(), backend="cpu")
    with pytest.raises(DataError, match=re.escape(where)):
        model.fit(batches, epochs=2, verbose=2)
    assert console_epochs(capsys.readouterr().err) == [1]  # the epoch before the one that failed
    assert model.epoch_count == 1


@pytest.mark.timeout(120)
def test_a_parallel_data_error_names_the_epoch_and_the_round_of_the_whole_epoch():
    x, y = toy(BATCH * 8)
    y[6 * BATCH + 3] = 7  # the 7th batch: after a resume at batch 4, worker 0's in the epoch's 4th round
    model = MultiLayerNetwork(mlp(), backend="cpu")
    model.fit(ArrayDataSetIterator(x[:BATCH * BATCHES], y[:BATCH * BATCHES], BATCH), epochs=1, verbose=0)
    model.training_state.stop_at(4)  # as a checkpoint of the second epoch, two rounds in, leaves it
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)
    with ParallelWrapper(model, workers=2) as wrapper:
        with pytest.raises(WorkerError, match=re.escape("worker 0, epoch 2, round 4: label 7 is outside")):
            wrapper.fit(loader, epochs=1, verbose=0)


def _run_config(tmp_path):
    x, y = toy(BATCH * BATCHES)
    rows = [",".join(f"{v:.6f}" for v in features) + f",{label}" for features, label in zip(x.tolist(), y.tolist())]
    (tmp_path / "toy.csv").write_text("\n".join(rows) + "\n")
    return RunConfig.from_dict(yaml.safe_load(f"""
network:
  seed: 5
  updater: {{type: sgd, learning_rate: 0.1}}
  input_type: {{type: feed_forward, size: 5}}
  layers:
    - {{type: dense, n_out: 12, activation: tanh}}
    - {{type: output, n_out: 3, activation: softmax, loss: negativeloglikelihood}}
data: {{dataset: csv, train_path: {tmp_path / 'toy.csv'}, num_classes: 3, seed: 3}}
training: {{epochs: 2, batch_size: {BATCH}, backend: cpu, score_every: 0}}
"""))


def test_ctrl_c_and_resume_name_the_epoch_the_console_names(tmp_path, monkeypatch, capsys, caplog):
    config, out = _run_config(tmp_path), tmp_path / "run"
    shown = dl4py.runner.console_listeners
    stop_at = BATCHES + 2  # the second batch of the second epoch
    monkeypatch.setattr("dl4py.runner.console_listeners", lambda *args: [*shown(*args), CtrlCAt(stop_at)])
    with pytest.raises(TrainingInterrupted) as stopped:
        train_run(config, out, progress=2)
    monkeypatch.undo()
    assert str(stopped.value) == (f"training stopped by Ctrl-C after iteration {stop_at} (epoch 2, batch 2); "
                                  "the model is consistent")
    assert console_epochs(capsys.readouterr().err) == [1]

    with caplog.at_level("INFO", logger="dl4py"):
        train_run(config, out, resume=True, progress=2)
    resumed = [m for m in caplog.messages if m.startswith("resuming ")]
    assert len(resumed) == 1 and resumed[0].startswith(
        f"resuming {out} in epoch 2 after batch 2 of {BATCHES} (iteration {stop_at}); "), resumed
    assert console_epochs(capsys.readouterr().err) == [2]  # the same epoch, finished by the resumed run
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records if r["kind"] == "epoch"] == [0, 1]  # a program's numbers: from 0
    assert json.loads((out / "result.json").read_text())["epochs"] == 2  # a count of epochs trained


def test_a_resume_at_an_epoch_boundary_names_the_epoch_done():
    x, y = toy(BATCH * BATCHES)
    model = MultiLayerNetwork(mlp(), backend="cpu")
    meta = {"precision": "float", "has_updater": True}
    assert resumed_message("runs/mlp", model.init(), meta, BATCHES).startswith(
        "resuming runs/mlp at the start of epoch 1 (iteration 0); ")
    model.fit(ArrayDataSetIterator(x, y, BATCH), epochs=1, verbose=0)
    assert resumed_message("runs/mlp", model, meta, BATCHES).startswith(
        f"resuming runs/mlp after epoch 1 (iteration {BATCHES}); ")
