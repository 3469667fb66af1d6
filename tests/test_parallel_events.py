"""Spawned parallel training: the coordinating process alone runs the listeners and early
stopping, on the events worker 0 relays, and nothing but it writes the run directory."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dl4py
from dl4py import ArrayDataSetIterator, MultiLayerNetwork
from dl4py.parallel import EarlyStoppingParallelTrainer, ParallelWrapper
from dl4py.train import CheckpointListener, TrainingListener
from dl4py.train.early_stopping import (
    DataSetLossCalculator,
    EarlyStoppingConfiguration,
    InvalidScore,
    LocalFileModelSaver,
    MaxEpochs,
    MaxTime,
)

from toy import mlp, toy  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BATCH, BATCHES, WORKERS = 16, 10, 2  # 5 rounds an epoch
ROUNDS = BATCHES // WORKERS


def _append(path, record) -> None:
    # A file, not a list: with listeners in a worker (before this change) the records
    # must still reach the test, to fail on the process that wrote them.
    with open(path, "a") as f:
        f.write(json.dumps([os.getpid(), *record]) + "\n")


def _read(path) -> list:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


class Recorder(TrainingListener):
    """Every event, with the process that saw it."""

    def __init__(self, path):
        self.path = str(path)

    def on_fit_start(self, model):
        _append(self.path, ["fit_start"])

    def on_epoch_start(self, model, epoch):
        _append(self.path, ["epoch_start", epoch])

    def iteration_done(self, model, iteration, epoch, loss, batch_size):
        _append(self.path, ["iteration", iteration, epoch, float(loss), batch_size])

    def on_epoch_end(self, model, summary):
        _append(self.path, ["epoch_end", summary.to_dict(), model.epoch_count, model.iteration_count])

    def on_fit_end(self, model, interrupted):
        _append(self.path, ["fit_end", interrupted])


class EpochCheckpoints(CheckpointListener):
    """A CheckpointListener writing one file per epoch: ``epoch<N>.dl4py``."""

    def __init__(self, folder):
        super().__init__(Path(folder) / "unused.dl4py")
        self.folder = Path(folder)

    def on_epoch_end(self, model, summary):
        self.path = self.folder / f"epoch{summary.epoch}.dl4py"
        super().on_epoch_end(model, summary)


class RecordingSaver(LocalFileModelSaver):
    """LocalFileModelSaver that notes which process wrote which model, and its score."""

    def save_best(self, model, score):
        _append(self.directory / "saves.jsonl", ["best", model.epoch_count - 1, score])
        super().save_best(model, score)

    def save_latest(self, model, score):
        _append(self.directory / "saves.jsonl", ["latest", model.epoch_count - 1, score])
        super().save_latest(model, score)


class RecordingLoss(DataSetLossCalculator):
    def __init__(self, iterator, log):
        super().__init__(iterator)
        self.log = str(log)

    def calculate_score(self, model):
        score = super().calculate_score(model)
        _append(self.log, ["score", model.epoch_count - 1, score])
        return score


def _same_parameters(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.module.parameters(), b.module.parameters()))


def test_worker_0_relays_its_steps_in_batches_read_at_once(monkeypatch):
    """Per step the relay only keeps the loss tensor: no read of it (a wait on a GPU), no
    message; it sends them every FLUSH_SECONDS, and at the epoch's end."""
    from dl4py.parallel import events
    from dl4py.parallel.messages import EpochEnded, Iterations

    class Clock:  # 10 ms a step
        now = 0.0

        def monotonic(self):
            self.now += 0.01
            return self.now

    class Sent(list):
        put = list.append

    monkeypatch.setattr(events, "time", Clock())
    sent, net = Sent(), MultiLayerNetwork(mlp(), backend="cpu").init()
    relay = events.EventRelay(sent, None, iterations=True, timeout=1.0)
    for i in range(1, 201):
        relay.iteration_done(net, i, 0, torch.tensor(float(i)), BATCH)
    relay.on_epoch_end(net, None)
    batches = [len(m.records) for m in sent if isinstance(m, Iterations)]
    assert len(batches) == 8 and min(batches[:-1]) >= events.FLUSH_SECONDS / 0.01 - 1, batches
    assert [r for m in sent if isinstance(m, Iterations) for r in m.records] == [(i, 0, float(i), BATCH) for i in range(1, 201)]
    assert isinstance(sent[-1], EpochEnded) and _same_parameters(dl4py.load(sent[-1].state), net)


def test_listeners_run_in_the_coordinator_on_worker_0s_events(tmp_path):
    x, y = toy(BATCH * BATCHES)
    net = MultiLayerNetwork(mlp(), backend="cpu")
    events = tmp_path / "events.jsonl"
    summaries = ParallelWrapper(net, workers=WORKERS, averaging_frequency=2).fit(
        ArrayDataSetIterator(x, y, batch_size=BATCH, shuffle=True, seed=3), epochs=2,
        listeners=[Recorder(events), EpochCheckpoints(tmp_path)])

    seen = _read(events)
    assert {pid for pid, *_ in seen} == {os.getpid()}, "an event was seen outside the coordinating process"
    kinds = [record[1] for record in seen]
    epoch_events = ["epoch_start", *["iteration"] * ROUNDS, "epoch_end"]
    assert kinds == ["fit_start", *epoch_events, *epoch_events, "fit_end"]
    # One event a round, in the model's units: every worker's batches, the round's examples.
    iterations = [record[2:] for record in seen if record[1] == "iteration"]
    assert [(i, e) for i, e, _, _ in iterations] == [
        (epoch * BATCHES + (r + 1) * WORKERS, epoch) for epoch in range(2) for r in range(ROUNDS)]
    assert all(n == BATCH * WORKERS and torch.isfinite(torch.tensor(loss)) for _, _, loss, n in iterations)
    ends = [record[2:] for record in seen if record[1] == "epoch_end"]
    assert [summary for summary, _, _ in ends] == [s.to_dict() for s in summaries]
    assert [(s["epoch"], s["batches"], s["examples"], s["completed"]) for s, _, _ in ends] == [
        (0, BATCHES, BATCH * BATCHES, True), (1, BATCHES, BATCH * BATCHES, True)]
    assert [(epochs, its) for _, epochs, its in ends] == [(1, BATCHES), (2, 2 * BATCHES)]  # the model had the epoch's state
    assert seen[-1][2] is False

    last = dl4py.load(tmp_path / "epoch1.dl4py")  # written at the last epoch's end: the averaged model
    assert (last.epoch_count, last.iteration_count) == (2, 2 * BATCHES)
    assert _same_parameters(last, net)
    first = dl4py.load(tmp_path / "epoch0.dl4py")
    assert (first.epoch_count, first.iteration_count) == (1, BATCHES) and not _same_parameters(first, last)


def test_early_stopping_scores_and_saves_in_the_coordinator(tmp_path):
    x, y = toy(BATCH * BATCHES)
    validation = ArrayDataSetIterator(*toy(64, seed=7), batch_size=64, shuffle=False)
    log = tmp_path / "scores.jsonl"
    config = EarlyStoppingConfiguration(
        score_calculator=RecordingLoss(validation, log), epoch_conditions=[MaxEpochs(3)],
        # MaxTime: should the decision not reach the workers, the test fails instead of hanging.
        iteration_conditions=[InvalidScore(), MaxTime(60)], model_saver=RecordingSaver(tmp_path),
        save_last_model=True)
    trainer = EarlyStoppingParallelTrainer(
        config, MultiLayerNetwork(mlp(), backend="cpu"), ArrayDataSetIterator(x, y, batch_size=BATCH, seed=3),
        listeners=[EpochCheckpoints(tmp_path)], workers=WORKERS, averaging_frequency=2)
    result = trainer.fit()

    scored, saves = _read(log), _read(tmp_path / "saves.jsonl")
    assert {pid for pid, *_ in scored + saves} == {os.getpid()}, "scored or saved outside the coordinating process"
    assert (result.termination_reason, result.termination_details) == ("EpochTerminationCondition", "MaxEpochs(3)")
    assert result.total_epochs == 3 and sorted(result.score_vs_epoch) == [0, 1, 2]
    # Each epoch's score is that of the averaged model its checkpoint holds.
    for epoch, score in result.score_vs_epoch.items():
        assert DataSetLossCalculator(validation).calculate_score(dl4py.load(tmp_path / f"epoch{epoch}.dl4py")) == score
    best = min(result.score_vs_epoch, key=result.score_vs_epoch.get)
    assert (result.best_model_epoch, result.best_model_score) == (best, result.score_vs_epoch[best])
    assert _same_parameters(dl4py.load(tmp_path / "bestModel.dl4py"), dl4py.load(tmp_path / f"epoch{best}.dl4py"))
    assert _same_parameters(dl4py.load(tmp_path / "latestModel.dl4py"), dl4py.load(tmp_path / "epoch2.dl4py"))
    assert [s[1:3] for s in saves if s[1] == "latest"] == [["latest", 0], ["latest", 1], ["latest", 2]]


# Installed in every Python process of the run below (the spawned workers too): notes each
# write to a file or directory under DL4PY_TEST_WATCH, with the writing process.
AUDIT_HOOK = """\
import os, sys
_watch, _fd = os.environ["DL4PY_TEST_WATCH"], os.open(os.environ["DL4PY_TEST_WRITES"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
def _note(path):
    if isinstance(path, (str, bytes, os.PathLike)) and os.path.abspath(os.fsdecode(path)).startswith(_watch):
        os.write(_fd, f"{os.getpid()} {os.fsdecode(path)}\\n".encode())
def _hook(event, args):
    if event == "open" and (args[1] is None and args[2] & (os.O_WRONLY | os.O_RDWR) or args[1] and set(args[1]) & set("wax+")):
        _note(args[0])
    elif event in ("os.rename", "os.remove", "os.mkdir", "os.rmdir"):
        _note(args[1] if event == "os.rename" else args[0])
sys.addaudithook(_hook)
"""
CONFIG = """\
network:
  seed: 1
  updater: {type: sgd, learning_rate: 0.05}
  input_type: {type: convolutional_flat, height: 28, width: 28, channels: 1}
  layers:
    - {type: dense, n_out: 16, activation: relu}
    - {type: output, n_out: 10, activation: softmax, loss: negativeloglikelihood}
data: {dataset: mnist, seed: 1, limit_train: 640, limit_test: 128}
training:
  epochs: 2
  batch_size: 64
  backend: cpu
  score_every: 1
"""
RUN_FILES = {"config.yaml", "environment.json", "metrics.jsonl", "checkpoint.dl4py", "model.dl4py",
             "evaluation.txt", "result.json"}


@pytest.mark.slow
@pytest.mark.parametrize("early_stopping", [False, True], ids=["plain", "early-stopping"])
def test_dl4py_train_with_workers_writes_its_run_directory_from_the_coordinator_only(tmp_path, mnist, early_stopping):
    hooks, out, writes = tmp_path / "hooks", tmp_path / "run", tmp_path / "writes.txt"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(AUDIT_HOOK)
    config = tmp_path / "mlp.yaml"
    config.write_text(CONFIG + ("  early_stopping: {max_epochs: 2}\n" if early_stopping else ""))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hooks), str(ROOT / "src")]), "OMP_NUM_THREADS": "1",
           "DL4PY_TEST_WATCH": str(out), "DL4PY_TEST_WRITES": str(writes)}
    proc = subprocess.run([sys.executable, "-m", "dl4py", "train", str(config), "--workers", "2", "--output", str(out),
                           "--no-progress", "--set", "training.report_score_after_averaging=true"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Worker 0's log records, shown by this process: a round's iterations are its two batches.
    averaged = re.findall(r"^\[worker 0\] epoch (\d), round (\d), iteration (\d+): averaged score", proc.stderr, re.M)
    assert averaged == [(str(e + 1), str(r), str(10 * e + 2 * r)) for e in range(2) for r in range(1, 6)], proc.stderr[-3000:]

    writers = {int(line.split(" ", 1)[0]) for line in writes.read_text().splitlines()}
    assert writers == {proc_pid(writes, out / "config.yaml")}, "the run directory was written by more than one process"
    expected = RUN_FILES | ({"bestModel.dl4py"} if early_stopping else set())
    assert expected <= {p.name for p in out.iterdir()}
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    iterations = [m["iteration"] for m in metrics if m["kind"] == "iteration"]
    assert iterations == list(range(2, 21, 2))  # one record a round, counting both workers' batches
    assert [m["iteration"] for m in metrics if m["kind"] == "epoch"] == [10, 20]
    result = json.loads((out / "result.json").read_text())
    assert result["status"] == "completed" and (result["epochs"], result["iterations"]) == (2, 20)
    if early_stopping:
        assert sorted(result["early_stopping"]["score_vs_epoch"]) == ["0", "1"]


def proc_pid(writes: Path, first: Path) -> int:
    """The process that wrote ``first`` (the resolved config: the coordinator writes it)."""
    return next(int(pid) for pid, path in (line.split(" ", 1) for line in writes.read_text().splitlines())
                if path == str(first))
