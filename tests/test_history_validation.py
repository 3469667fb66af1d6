"""Validation during training and the History fit returns; the loop's epoch bookkeeping."""

from __future__ import annotations

import json

import pytest
import torch

from dl4py import (
    ArrayDataSetIterator,
    DenseLayer,
    InputType,
    MnistDataSetIterator,
    MultiLayerNetwork,
    NetworkConfig,
    OutputLayer,
    Sgd,
)
from dl4py.errors import ConfigError, DataError
from dl4py.train import TrainingListener
from dl4py.train.early_stopping import (
    ClassificationScoreCalculator,
    EarlyStoppingConfiguration,
    EarlyStoppingTrainer,
    InMemoryModelSaver,
    MaxEpochs,
)
from dl4py.train.validation import split_validation


def mlp(seed: int = 3) -> NetworkConfig:
    return NetworkConfig(seed=seed, updater=Sgd(learning_rate=0.1), input_type=InputType.feed_forward(784),
                         layers=[DenseLayer(n_out=32, activation="relu"), OutputLayer(n_out=10)])


@pytest.fixture
def slices(mnist):
    train = MnistDataSetIterator(64, train=True, seed=1, limit=1500)
    validation = MnistDataSetIterator(200, train=False, seed=1, shuffle=False, limit=500)  # batches 200, 200, 100
    return train, validation


def test_validation_fills_the_history_one_value_per_epoch(slices):
    train, validation = slices
    model = MultiLayerNetwork(mlp(), backend="cpu").init()
    history = model.fit(train, epochs=3, validation=validation, metrics=["accuracy", "f1"])
    assert history.epoch == [0, 1, 2] and len(history) == 3
    for key in ("loss", "val_loss", "val_accuracy", "val_f1", "seconds", "samples_per_second", "learning_rate"):
        assert len(history.history[key]) == 3, key
    assert history.history["learning_rate"] == [0.1, 0.1, 0.1]
    assert history.history["loss"] == [s.mean_loss for s in history]  # the epochs' own mean losses
    # The values are the model's own scores on that data after each epoch: the last one now.
    evaluation = model.evaluate(validation)
    assert history.history["val_accuracy"][-1] == pytest.approx(evaluation.accuracy(), abs=1e-12)
    assert history.history["val_f1"][-1] == pytest.approx(evaluation.f1(), abs=1e-12)
    assert history.history["val_loss"][-1] == pytest.approx(model.score(validation), rel=1e-9)
    assert history.history["val_accuracy"][-1] > 0.75
    assert history.history["loss"][2] < history.history["loss"][0]


def test_validation_split_is_held_out_by_seed_and_scored_each_epoch(slices):
    train, _ = slices
    kept, held = split_validation(train, 0.2)
    assert (kept.total_examples(), held.total_examples()) == (1200, 300)
    rows = {tuple(r.tolist()) for r in train.features.flatten(1)[:, 300:310]}
    seen = [{tuple(r.tolist()) for r in it.features.flatten(1)[:, 300:310]} for it in (kept, held)]
    assert seen[0] | seen[1] == rows and len(seen[0]) + len(seen[1]) >= len(rows)  # all of train, split
    again_kept, again_held = split_validation(train, 0.2)
    assert torch.equal(again_held.features, held.features)  # deterministic by seed
    _, other_held = split_validation(train, 0.2, seed=99)
    assert not torch.equal(other_held.features, held.features)
    # Not the last rows (Keras' choice): data sorted by class would hold out one class.
    assert not torch.equal(held.features, train.features[-300:])

    model = MultiLayerNetwork(mlp(), backend="cpu").init()
    history = model.fit(train, epochs=2, validation_split=0.2)
    assert len(history.history["val_accuracy"]) == 2
    assert sum(s.examples for s in history) == 2 * 1200  # trained on the rest only
    with pytest.raises(ConfigError, match="validation_split"):
        model.fit(train, validation_split=1.5)
    with pytest.raises(ConfigError, match="not both"):
        model.fit(train, validation_split=0.1, validation=held)


def test_early_stopping_on_the_validation_set_picks_its_best_epoch_from_those_values(slices):
    train, validation = slices
    model = MultiLayerNetwork(mlp(), backend="cpu").init()
    config = EarlyStoppingConfiguration(score_calculator=ClassificationScoreCalculator("accuracy", validation),
                                        epoch_conditions=[MaxEpochs(4)], model_saver=InMemoryModelSaver())
    result = EarlyStoppingTrainer(config, model, train).fit()
    assert len(result.history) == result.total_epochs == 4
    assert sum(s.examples for s in result.history) == 4 * 1500
    scores = [result.score_vs_epoch[e] for e in sorted(result.score_vs_epoch)]
    assert result.best_model_epoch == max(range(4), key=lambda e: (scores[e], -e))
    # The same scores the History of a plain fit on that validation data records.
    again = MultiLayerNetwork(mlp(), backend="cpu").init()
    history = again.fit(MnistDataSetIterator(64, train=True, seed=1, limit=1500), epochs=4, validation=validation)
    assert history.history["val_accuracy"] == pytest.approx(scores, abs=1e-12)


class _FailAt(TrainingListener):
    def __init__(self, iteration):
        self.iteration = iteration

    def iteration_done(self, model, iteration, epoch, loss, batch_size):
        if iteration == self.iteration:
            raise RuntimeError("a listener failed")


class _Count(TrainingListener):
    def __init__(self):
        self.batches = 0

    def iteration_done(self, model, iteration, epoch, loss, batch_size):
        self.batches += 1


def _arrays(n=96, batch=16):
    generator = torch.Generator().manual_seed(0)
    return ArrayDataSetIterator(torch.rand(n, 784, generator=generator), torch.arange(n) % 10, batch, seed=1)


def test_after_an_exception_mid_epoch_the_next_fit_trains_every_batch():
    model = MultiLayerNetwork(mlp(), backend="cpu").init()
    with pytest.raises(RuntimeError, match="a listener failed"):
        model.fit(_arrays(), epochs=1, listeners=[_FailAt(3)])
    count = _Count()
    history = model.fit(_arrays(n=64), epochs=1, listeners=[count])  # another iterator
    assert count.batches == 4 and history[0].batches == 4 and model.epoch_count == 1


class _Empty(ArrayDataSetIterator):
    def __iter__(self):
        self._take_epoch()
        return iter(())


def test_an_epoch_of_no_batches_is_an_error_not_a_finished_epoch():
    model = MultiLayerNetwork(mlp(), backend="cpu").init()
    empty = _Empty(torch.rand(32, 784), torch.arange(32) % 10, 16)
    with pytest.raises(DataError, match="no batches in epoch 1"):
        model.fit(empty, epochs=1)
    assert model.epoch_count == 0


def test_a_resume_position_beyond_the_data_is_an_error():
    model = MultiLayerNetwork(mlp(), backend="cpu").init()
    model.training_state.stop_at(10)  # as a checkpoint taken after batch 10 leaves it
    with pytest.raises(DataError, match="stopped after batch 10 of epoch 1, but this data has only 6"):
        model.fit(_arrays(), epochs=1)
    assert model.batch_in_epoch == 10  # nothing trained: the position to resume from is kept
    model.training_state.stop_at(6)  # stopped after the epoch's last batch: the epoch completes
    assert model.fit(_arrays(), epochs=1)[0].batches == 0 and model.epoch_count == 1


def test_metrics_jsonl_epoch_records_have_the_history_keys_and_time_goes_on_across_runs(tmp_path, slices):
    from dl4py.train import MetricsLogger

    train, validation = slices
    path = tmp_path / "metrics.jsonl"
    model = MultiLayerNetwork(mlp(), backend="cpu").init()
    history = model.fit(train, epochs=1, validation=validation, listeners=[MetricsLogger(path, every=0)])
    first = [json.loads(line) for line in path.read_text().splitlines()]
    assert first[0]["kind"] == "epoch"
    for key in history.history:
        assert first[0][key] == history.history[key][0], key
    model.fit(train, epochs=1, listeners=[MetricsLogger(path, every=0)])  # a resumed run's new logger
    second = [json.loads(line) for line in path.read_text().splitlines()][1]
    assert second["epoch"] == 1 and second["time"] > first[0]["time"]
    assert second["time"] == pytest.approx(first[0]["time"] + second["seconds"], abs=0.5)


def _run_config(tmp_path, **training) -> str:
    import yaml

    config = {
        "network": {"seed": 3, "updater": {"type": "sgd", "learning_rate": 0.1},
                    "input_type": {"type": "feed_forward", "size": 784},
                    "layers": [{"type": "dense", "n_out": 32, "activation": "relu"}, {"type": "output", "n_out": 10}]},
        "data": {"dataset": "mnist", "seed": 1, "limit_train": 1200, "limit_test": 300, "validation": {"split": 0.25}},
        "training": {"epochs": 3, "batch_size": 64, "backend": "cpu", "score_every": 0, **training},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_a_run_with_early_stopping_ranks_on_validation_and_tests_once(tmp_path, mnist, capsys):
    from dl4py.cli import main

    out = tmp_path / "run"
    config = _run_config(tmp_path, early_stopping={"metric": "accuracy", "max_epochs": 3})
    assert main(["train", config, "--output", str(out), "--no-progress"]) == 0
    result = json.loads((out / "result.json").read_text())
    stopping, history = result["early_stopping"], result["history"]
    assert stopping["score_set"] == "validation"
    assert result["epochs"] == 3 and result["train_samples_per_second"] > 0  # all epochs trained, counted
    assert history["epoch"] == [0, 1, 2] and len(history["val_accuracy"]) == 3
    scores = [stopping["score_vs_epoch"][str(e)] for e in range(3)]
    assert scores == pytest.approx(history["val_accuracy"], abs=1e-12)  # the same held-out numbers
    assert stopping["best_model_epoch"] == max(range(3), key=lambda e: (scores[e], -e))
    assert result["val_accuracy"] == pytest.approx(max(scores), abs=1e-12)  # the best model's, kept
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if r["kind"] not in ("static", "stats")]  # the StatsListener's own
    assert [r["kind"] for r in records] == ["epoch", "epoch", "epoch", "evaluation"]  # the test set once
    assert [r["val_accuracy"] for r in records[:3]] == history["val_accuracy"]
    assert all("test_accuracy" not in r for r in records[:3])
    assert result["test_examples"] == 300


def test_a_parallel_run_scores_each_averaged_epoch_on_validation(tmp_path, mnist):
    from dl4py.runner import train_run
    from dl4py.config import RunConfig

    result = train_run(RunConfig.from_file(_run_config(tmp_path, epochs=2, workers=2)), output=tmp_path / "run")
    history = result["history"]
    assert history["epoch"] == [0, 1] and all(0 < v <= 1 for v in history["val_accuracy"])
    assert history["learning_rate"] == [0.1, 0.1]
    assert result["val_accuracy"] == pytest.approx(history["val_accuracy"][-1], abs=1e-12)


def test_a_sweep_ranks_on_the_validation_score_when_the_config_holds_some_out(tmp_path):
    import yaml

    from dl4py.sweep.runner import make_plan

    config = _run_config(tmp_path)
    assert make_plan(config, {"training.batch_size": [32, 64]}, None, None, 0, []).metric == "val_accuracy"
    plain = yaml.safe_load(open(config))
    del plain["data"]["validation"]
    path = tmp_path / "plain.yaml"
    path.write_text(yaml.safe_dump(plain))
    assert make_plan(str(path), {"training.batch_size": [32, 64]}, None, None, 0, []).metric == "test_accuracy"
    assert make_plan(config, {"training.batch_size": [32]}, None, None, 0, [], "test_f1").metric == "test_f1"
    regression = yaml.safe_load(open(config))
    regression["network"]["layers"][-1] = {"type": "output", "n_out": 1, "activation": "identity", "loss": "mse"}
    path.write_text(yaml.safe_dump(regression))
    assert make_plan(str(path), {"training.batch_size": [32]}, None, None, 0, []).metric == "val_r_squared"


class _NoLength(ArrayDataSetIterator):
    def __len__(self):
        raise NotImplementedError  # DataSetIterator's own, for a user's iterator that has none


def test_an_iterator_without_a_length_trains_and_resumes():
    model = MultiLayerNetwork(mlp(), backend="cpu").init()
    data = _NoLength(torch.rand(64, 784), torch.arange(64) % 10, 16)
    assert model.fit(data, epochs=1)[0].batches == 4
    model.training_state.stop_at(2)
    assert model.fit(data, epochs=1)[0].batches == 2


def test_validation_data_is_checked_before_any_training_and_takes_the_same_columns():
    import pandas as pd

    model = MultiLayerNetwork(mlp(), backend="cpu").init()
    x, y = torch.rand(64, 784), torch.arange(64) % 10
    with pytest.raises(DataError, match="label 10 is outside the output layer's 10 classes"):
        model.fit((x, y), validation=(x, y + 1))
    assert model.iteration_count == 0
    frame = pd.DataFrame(x.numpy())
    frame["digit"] = y.numpy()
    history = model.fit(frame, label="digit", validation=frame.iloc[:32], epochs=1)
    assert len(history.history["val_accuracy"]) == 1
