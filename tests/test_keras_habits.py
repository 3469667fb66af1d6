"""A Keras user's habits in dl4py's training API (issue 32): ``fit(x, y, ...)``, ``callbacks=``,
History's ``accuracy`` beside ``val_accuracy``, and Keras 3's ``EarlyStopping`` and
``ModelCheckpoint`` on dl4py's early-stopping machinery.

Keras is not installed here: its semantics are those keras.io documents, and where the test
needs Keras' own rule for when EarlyStopping stops, ``keras_stop`` below writes it out as
Keras 3's ``EarlyStopping.on_epoch_end`` reads (a wait counter raised every watched epoch,
reset by an improvement that also beats the baseline; a stop once it reaches the patience).
"""

from __future__ import annotations

import hashlib
import math
import random

import numpy as np
import pytest
import torch

import dl4py
from dl4py import (
    Adam,
    ArrayDataSetIterator,
    DenseLayer,
    EarlyStopping,
    InputType,
    ModelCheckpoint,
    MultiLayerNetwork,
    NetworkConfig,
    OutputLayer,
    TorchModel,
)
from dl4py.errors import ConfigError, DataError
from dl4py.nn.model_file import read_meta
from dl4py.train import TrainingListener
from dl4py.train.epoch import EpochSummary


def binary_task(n: int = 600, seed: int = 0):
    """20 features, two classes split by a random hyperplane: separable, so accuracy can rise."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 20)).astype("float32")
    return x, (x @ rng.normal(size=20) > 0).astype("int64")


def classifier(seed: int = 1, lr: float = 0.01, precision=None) -> MultiLayerNetwork:
    return MultiLayerNetwork(NetworkConfig(
        layers=[DenseLayer(n_out=16, activation="relu"), OutputLayer(n_out=2)],
        input_type=InputType.feed_forward(20), updater=Adam(lr), seed=seed), precision=precision)


class Scripted(TrainingListener):
    """Replaces the monitored value of each epoch's record with the next scripted one (put it
    before the callbacks): the stopping and saving rules meet the exact sequence asked for."""

    def __init__(self, key: str, values):
        self.key, self.values = key, list(values)

    def on_epoch_end(self, model, summary):
        summary.validation[self.key] = self.values[summary.epoch]


class Snapshots(TrainingListener):
    """The module's parameters and buffers at each epoch's end, by epoch, and the stepped
    parameters (the float32 masters of a 16-bit model)."""

    def __init__(self):
        self.states, self.stepped = {}, {}

    def on_epoch_end(self, model, summary):
        self.states[summary.epoch] = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
        self.stepped[summary.epoch] = {k: v.detach().clone() for k, v in model.stepped_module.state_dict().items()}


def same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- the side-by-side task, as a Keras user writes it ----------------------------------------

def test_the_keras_side_by_side_task_runs_unchanged_and_history_has_keras_keys(tmp_path, monkeypatch):
    X, y = binary_task()
    model = classifier()
    monkeypatch.chdir(tmp_path)  # the script's relative "best.dl4py"
    # From here on, Keras' call shape and key names exactly (only the import line differs).
    history = model.fit(X, y, epochs=3, batch_size=32, validation_split=0.1,
                        callbacks=[EarlyStopping(monitor="val_loss", patience=2, restore_best_weights=True),
                                   ModelCheckpoint("best.dl4py", monitor="val_loss", save_best_only=True)])
    accuracy, val_accuracy = history.history["accuracy"], history.history["val_accuracy"]
    loss, val_loss = history.history["loss"], history.history["val_loss"]

    assert history.epoch == [0, 1, 2]
    assert all(len(values) == 3 for values in (accuracy, val_accuracy, loss, val_loss))
    assert all(0 <= a <= 1 for a in accuracy + val_accuracy)
    assert accuracy[-1] > 0.85 and val_accuracy[-1] > 0.8  # chance is 0.5
    assert accuracy[-1] > accuracy[0] and loss[-1] < loss[0]
    assert list(history.history)[:2] == ["loss", "accuracy"]
    assert history[0].batches == math.ceil(540 / 32)  # 10% held out, batches of 32
    best = dl4py.load(tmp_path / "best.dl4py")
    assert best.evaluate((X, y)).accuracy() > 0.8
    # predict follows scikit-learn (class indices); predict_proba gives Keras' probabilities.
    classes, probabilities = model.predict(X[:5]), model.predict_proba(X[:5])
    assert classes.dtype == np.int64 and classes.shape == (5,)
    assert probabilities.shape == (5, 2) and np.allclose(probabilities.sum(axis=1), 1, atol=1e-6)
    assert (probabilities.argmax(axis=1) == classes).all()


# ---- fit's first arguments: Keras', DL4J's and dl4py's own forms ------------------------------

def test_fit_x_y_trains_exactly_as_the_pair_does():
    X, y = binary_task(200)
    apart, paired = classifier(), classifier()
    first = apart.fit(X, y, epochs=2, verbose=0)
    second = paired.fit((X, y), epochs=2, verbose=0)
    assert first.history["loss"] == second.history["loss"]
    assert same_state(apart.module.state_dict(), paired.module.state_dict())
    torch_apart = classifier().fit(torch.from_numpy(X), torch.from_numpy(y), verbose=0)  # tensors too
    assert torch_apart.history["loss"] == first.history["loss"][:1]


def test_a_graph_of_two_inputs_fits_keras_style_as_with_the_pair():
    """Keras' ``fit([x1, x2], y)`` for a graph's several inputs: the same training as the pair
    ``fit(([x1, x2], y))`` the graph took before, and validation_split works on it."""
    from dl4py import ComputationGraph, GraphConfig

    X, y = binary_task(200)
    config = GraphConfig.from_dict({
        "inputs": {"a": {"type": "feed_forward", "size": 12}, "b": {"type": "feed_forward", "size": 8}},
        "vertices": {"both": {"vertex": {"type": "merge"}, "inputs": ["a", "b"]},
                     "hidden": {"inputs": ["both"], "layer": {"type": "dense", "n_out": 8, "activation": "relu"}},
                     "out": {"inputs": ["hidden"], "layer": {"type": "output", "n_out": 2, "loss": "mcxent"}}},
        "outputs": ["out"], "seed": 3, "updater": {"type": "adam", "learning_rate": 0.01}})
    apart, paired = ComputationGraph(config), ComputationGraph(config)
    first = apart.fit([X[:, :12], X[:, 12:]], y, 20, 2, verbose=0)
    second = paired.fit(([X[:, :12], X[:, 12:]], y), epochs=2, batch_size=20, verbose=0)
    assert first.history["loss"] == second.history["loss"] and len(first) == 2
    assert same_state(apart.module.state_dict(), paired.module.state_dict())
    held_out = ComputationGraph(config).fit([X[:, :12], X[:, 12:]], y, epochs=1, validation_split=0.2, verbose=0)
    assert held_out[0].examples == 160 and "val_accuracy" in held_out.history


def test_keras_positional_batch_size_and_epochs_and_the_other_forms():
    X, y = binary_task(200)
    history = classifier().fit(X, y, 16, 2, verbose=0)  # Keras' order: x, y, batch_size, epochs
    assert len(history) == 2 and history[0].batches == math.ceil(200 / 16)
    iterator = ArrayDataSetIterator(torch.from_numpy(X), torch.from_numpy(y), batch_size=50)
    assert len(classifier().fit(iterator, verbose=0)) == 1
    assert len(classifier().fit(iterator, 3, verbose=0)) == 3  # DL4J's fit(iterator, numEpochs)
    assert len(classifier().fit(iterator, epochs=2, verbose=0)) == 2
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.from_numpy(X), torch.from_numpy(y)),
                                         batch_size=40)
    history = classifier().fit(loader, epochs=1, verbose=0)
    assert history[0].batches == 5 and "accuracy" in history.history


def test_fit_refuses_labels_given_twice_or_where_they_cannot_go():
    X, y = binary_task(100)
    iterator = ArrayDataSetIterator(torch.from_numpy(X), torch.from_numpy(y), batch_size=50)
    model = classifier()
    with pytest.raises(DataError, match=r"fit\(x, y\): y goes with features given as arrays.*ArrayDataSetIterator"):
        model.fit(iterator, y)
    with pytest.raises(DataError, match=r"y must be an array, a tensor or a pandas object \(a list of them for a "
                                        r"graph's outputs\), got list"):
        model.fit(X, list(y))
    with pytest.raises(TypeError, match="epochs twice"):
        model.fit(iterator, 2, epochs=3)
    assert model.iteration_count == 0


def test_callbacks_is_the_keras_name_of_listeners_and_both_is_one_error():
    X, y = binary_task(100)

    class Count(TrainingListener):
        epochs = 0

        def on_epoch_end(self, model, summary):
            self.epochs += 1

    count = Count()
    classifier().fit(X, y, epochs=2, callbacks=[count], verbose=0)
    assert count.epochs == 2
    model = classifier()
    with pytest.raises(ConfigError, match="callbacks: is Keras' name for listeners=; give one of them, not both"):
        model.fit(X, y, callbacks=[Count()], listeners=[Count()])
    assert model.iteration_count == 0


# ---- History's training accuracy -------------------------------------------------------------

def test_training_accuracy_is_the_share_of_training_examples_the_step_got_right():
    # The optimizer's learning rate 0 keeps the weights: every batch meets the same model, so
    # the running accuracy over the epoch's batches is that model's accuracy on the training set.
    X, y = binary_task(300)
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(20, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    frozen = TorchModel(module, loss=torch.nn.CrossEntropyLoss(), optimizer=lambda p: torch.optim.SGD(p, lr=0.0))
    history = frozen.fit(X, y, epochs=2, batch_size=32, verbose=0)
    expected = frozen.evaluate((X, y)).accuracy()
    assert 0.2 < expected < 0.8  # an untrained model: neither all right nor all wrong
    assert history.history["accuracy"] == [pytest.approx(expected, abs=1e-12)] * 2
    one_hot = torch.nn.functional.one_hot(torch.from_numpy(y), 2).float()  # probability rows as labels
    assert frozen.fit(torch.from_numpy(X), one_hot, verbose=0).history["accuracy"] == [pytest.approx(expected)]
    # 300 batches of one: more than the 256 whose hits are held before they are summed.
    assert frozen.fit(X, y, batch_size=1, verbose=0).history["accuracy"] == [pytest.approx(expected, abs=1e-12)]


def test_training_accuracy_is_counted_before_each_update_from_the_steps_own_outputs():
    # One batch per epoch: epoch e's training accuracy is the accuracy of the weights it started with.
    X, y = binary_task(256)
    model = classifier(lr=0.05)

    class BeforeEachEpoch(TrainingListener):
        accuracies = []

        def on_epoch_start(self, model, epoch):
            self.accuracies.append(model.evaluate((X, y)).accuracy())

    before = BeforeEachEpoch()
    history = model.fit(X, y, batch_size=256, epochs=4, shuffle=False, listeners=[before], verbose=0)
    assert history.history["accuracy"] == pytest.approx(before.accuracies, abs=1e-12)
    assert len(set(before.accuracies)) > 1  # the weights moved: the numbers say which weights were scored


def test_no_training_accuracy_where_the_metrics_or_the_model_have_none():
    X, y = binary_task(100)
    history = classifier().fit(X, y, validation_split=0.2, metrics=["f1"], verbose=0)
    assert "accuracy" not in history.history and "val_f1" in history.history
    regressor = TorchModel(torch.nn.Linear(20, 1), loss=torch.nn.MSELoss(), optimizer=lambda p: torch.optim.SGD(p, lr=0.01))
    history = regressor.fit(X, y.reshape(-1, 1).astype("float32"), verbose=0)
    assert "accuracy" not in history.history and len(history.history["loss"]) == 1


# ---- EarlyStopping: Keras' stopping rule on dl4py's controller -------------------------------

def keras_stop(values, patience=0, min_delta=0.0, minimize=True, baseline=None, start_from_epoch=0):
    """(epoch stopped after or None, best epoch) by Keras 3's EarlyStopping rule."""
    def improves(value, reference):
        return value + abs(min_delta) < reference if minimize else value - abs(min_delta) > reference

    best, best_epoch, wait = (math.inf if minimize else -math.inf), None, 0
    for epoch, value in enumerate(values):
        if epoch < start_from_epoch:
            continue
        wait += 1
        if improves(value, best):
            best, best_epoch = value, epoch
            if baseline is None or improves(value, baseline):
                wait = 0
            continue
        if wait >= patience and epoch > 0:
            return epoch, best_epoch
    return None, best_epoch


def drive(callback: EarlyStopping, values, key="val_loss") -> int | None:
    """Show ``callback`` one epoch record per value on a real model; the epoch it stopped after."""
    model = classifier().init()
    callback.on_fit_start(model)
    for epoch, value in enumerate(values):
        callback.on_epoch_end(model, EpochSummary(epoch, 1, 1, 0.5, 0.1, validation={key: value}))
        if model.stop_reason is not None:
            return epoch
    return None


@pytest.mark.parametrize("values, options, stop", [
    ([5.0, 4.0, 3.0, 3.5, 3.2, 2.0], {"patience": 2}, 4),
    ([3.0, 2.0, 2.5, 1.0], {"patience": 0}, 2),  # Keras' 0: the first epoch without improvement
    ([3.0, 2.0, 2.5, 1.0], {"patience": 1}, 2),  # ... as 1 does
    ([5.0, 4.0, 3.99, 3.98, 3.0, 1.0], {"patience": 2, "min_delta": 0.05}, 3),  # 0.01 and 0.02 do not count
    ([5.0, 4.0, 3.99, 3.98, 3.0, 1.0], {"patience": 2}, None),
    ([5.0, 4.0, 4.5, 3.0], {"patience": 2, "baseline": 1.0}, 2),  # 4.0 improved, but not on the baseline
    ([5.0, 4.0, 4.5, 3.0], {"patience": 2}, None),
    ([1.0, 2.0, 3.0, 4.0, 3.5], {"patience": 1, "start_from_epoch": 2}, 3),  # epochs 0 and 1 not watched
    ([1.0, 2.0, 3.0, 4.0, 3.5], {"patience": 1}, 1),
])
def test_early_stopping_stops_after_the_epoch_keras_does(values, options, stop):
    assert keras_stop(values, **options)[0] == stop  # the expectation is Keras' rule
    assert drive(EarlyStopping(**options), values) == stop


def test_early_stopping_mode_max_and_auto_direction():
    values = [0.5, 0.6, 0.55, 0.58, 0.9]
    assert drive(EarlyStopping(monitor="val_accuracy", patience=2), values, "val_accuracy") == 3  # auto: max
    assert drive(EarlyStopping(monitor="val_accuracy", patience=2, mode="max"), values, "val_accuracy") == 3
    assert drive(EarlyStopping(monitor="val_accuracy", patience=2, mode="min"), values, "val_accuracy") == 2
    assert keras_stop(values, patience=2, minimize=False)[0] == 3


def test_early_stopping_agrees_with_keras_on_random_sequences():
    # Values, deltas and baselines on a grid of quarters: sums and differences are exact in binary.
    rnd = random.Random(7)
    for _ in range(300):
        values = [rnd.randrange(0, 13) / 4 for _ in range(rnd.randrange(1, 9))]
        options = {"patience": rnd.randrange(0, 4), "min_delta": rnd.choice([0.0, 0.25, 0.5]),
                   "baseline": rnd.choice([None, 1.0, 2.0]), "start_from_epoch": rnd.randrange(0, 3)}
        minimize = rnd.random() < 0.5
        callback = EarlyStopping(**options, mode="min" if minimize else "max")
        stop, best_epoch = keras_stop(values, minimize=minimize, **options)
        assert drive(callback, values) == stop, (values, options, minimize)
        assert callback.stopped_epoch == (stop or 0)
        if options["min_delta"] == 0:  # with a delta, Keras' code keeps the last big step as best, not the best value
            assert callback.best_epoch == (-1 if best_epoch is None else best_epoch), (values, options, minimize)


@pytest.mark.parametrize("precision", [None, "bfloat16"])  # bfloat16: float32 masters beside the module
def test_early_stopping_in_a_fit_stops_at_once_and_restores_the_exact_best_weights(precision):
    X, y = binary_task(200)
    model, snapshots = classifier(precision=precision), Snapshots()
    history = model.fit(X, y, epochs=10, batch_size=50, validation_split=0.2, verbose=0, callbacks=[
        Scripted("val_loss", [1.0, 0.5, 0.8, 0.9, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]), snapshots,
        EarlyStopping(monitor="val_loss", patience=2, restore_best_weights=True)])
    assert history.epoch == [0, 1, 2, 3] and history.history["val_loss"] == [1.0, 0.5, 0.8, 0.9]
    assert model.epoch_count == 4 and model.iteration_count == 4 * 4  # not one batch past the stop
    assert same_state(model.module.state_dict(), snapshots.states[1])  # epoch 1's weights, bit for bit
    assert same_state(model.stepped_module.state_dict(), snapshots.stepped[1])
    assert not same_state(snapshots.stepped[1], snapshots.stepped[3])


def test_early_stopping_without_restore_keeps_the_last_weights():
    X, y = binary_task(200)
    kept, snapshots = classifier(), Snapshots()
    kept.fit(X, y, epochs=10, batch_size=50, validation_split=0.2, verbose=0, callbacks=[
        Scripted("val_loss", [1.0, 0.5, 0.8, 0.9]), snapshots, EarlyStopping(patience=2)])
    assert same_state(kept.module.state_dict(), snapshots.states[3])  # without restore: the last weights


def test_early_stopping_restores_the_best_weights_when_it_did_not_stop_too():
    X, y = binary_task(200)
    model, snapshots = classifier(), Snapshots()
    model.fit(X, y, epochs=3, validation_split=0.2, verbose=0, callbacks=[
        Scripted("val_loss", [1.0, 0.4, 0.7]), snapshots, EarlyStopping(patience=5, restore_best_weights=True)])
    assert model.epoch_count == 3 and same_state(model.module.state_dict(), snapshots.states[1])


# ---- ModelCheckpoint --------------------------------------------------------------------------

def test_model_checkpoint_save_best_only_writes_only_on_improvement(tmp_path):
    X, y = binary_task(200)
    path = tmp_path / "best.dl4py"

    class FileSeen(TrainingListener):
        def __init__(self):
            self.seen = []

        def on_epoch_end(self, model, summary):
            stat = path.stat() if path.exists() else None
            digest = hashlib.sha256(path.read_bytes()).hexdigest() if stat else None
            self.seen.append(None if stat is None else (stat.st_ino, stat.st_mtime_ns, digest))

    model, snapshots, seen = classifier(), Snapshots(), FileSeen()
    checkpoint = ModelCheckpoint(str(path), monitor="val_loss", save_best_only=True)
    scripted = Scripted("val_loss", [3.0, 2.0, 2.5, 1.0, 1.5, 1.2, 0.5])
    model.fit(X, y, epochs=5, validation_split=0.2, verbose=0, callbacks=[scripted, snapshots, checkpoint, seen])
    versions = seen.seen
    written = [e for e in range(5) if versions[e] is not None and (e == 0 or versions[e] != versions[e - 1])]
    assert written == [0, 1, 3]
    assert len({digest for _, _, digest in versions}) == 3
    best = dl4py.load(path)
    assert same_state(best.module.state_dict(), snapshots.states[3]) and best.epoch_count == 4
    assert read_meta(path)["has_updater"]

    # The best carries over to the next fit, as Keras' does: 1.2 does not beat 1.0, 0.5 does.
    model.fit(X, y, epochs=2, validation_split=0.2, verbose=0, callbacks=[scripted, snapshots, checkpoint, seen])
    assert seen.seen[5] == seen.seen[4] and seen.seen[6] != seen.seen[5]
    assert same_state(dl4py.load(path).module.state_dict(), snapshots.states[6])

    threshold = ModelCheckpoint(str(tmp_path / "other.dl4py"), save_best_only=True, initial_value_threshold=1.0)
    classifier().fit(X, y, epochs=3, validation_split=0.2, verbose=0,
                     callbacks=[Scripted("val_loss", [3.0, 2.0, 1.5]), threshold])
    assert not (tmp_path / "other.dl4py").exists()  # nothing beat the initial 1.0


def test_model_checkpoint_every_epoch_with_keras_filename_fields_and_weights_only(tmp_path):
    X, y = binary_task(200)
    model = classifier()
    model.fit(X, y, epochs=3, validation_split=0.2, verbose=0, callbacks=[
        Scripted("val_loss", [3.0, 2.0, 2.5]),
        ModelCheckpoint(str(tmp_path / "ckpt-{epoch:02d}-{val_loss:.2f}.dl4py"), save_weights_only=True)])
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["ckpt-01-3.00.dl4py", "ckpt-02-2.00.dl4py", "ckpt-03-2.50.dl4py"]
    assert not read_meta(tmp_path / names[0])["has_updater"]  # weights only: no updater state
    assert dl4py.load(tmp_path / names[-1]).epoch_count == 3


# ---- a key History never has: one error before the first step ---------------------------------

@pytest.mark.parametrize("callback, validation_split, message", [
    (EarlyStopping(monitor="val_acc"), 0.2,
     r"EarlyStopping.monitor: this fit's History will have no 'val_acc'; its keys are loss, accuracy, .*val_accuracy"),
    (EarlyStopping(), None, r"no 'val_loss'.*val_ keys need held-out data: fit\(\.\.\., validation_split=0.1\)"),
    (ModelCheckpoint("m.dl4py", monitor="acc", mode="max", save_best_only=True), None, "no 'acc'; its keys are loss, accuracy"),
    (ModelCheckpoint("m-{val_accuracy}.dl4py"), None, r"ModelCheckpoint.filepath: \{val_accuracy\} is not a field"),
    (EarlyStopping(monitor="seconds"), None, "'auto' cannot tell whether a higher or a lower 'seconds' is better"),
])
def test_a_key_history_never_has_is_one_error_at_fit_start(callback, validation_split, message):
    X, y = binary_task(100)
    model = classifier()
    with pytest.raises(ConfigError, match=message):
        model.fit(X, y, epochs=2, validation_split=validation_split, callbacks=[callback], verbose=0)
    assert model.iteration_count == 0


def test_keras_arguments_that_cannot_apply_are_errors(tmp_path):
    with pytest.raises(ConfigError, match="EarlyStopping.mode: must be 'auto', 'min' or 'max'"):
        EarlyStopping(mode="maximum")
    X, y = binary_task(100)
    classifier().fit(X, y, verbose=0, callbacks=[EarlyStopping(monitor="seconds", mode="min")])
    classifier().fit(X, y, verbose=0, callbacks=[ModelCheckpoint(tmp_path / "m.dl4py", monitor="seconds")])  # no direction needed
    with pytest.raises(ConfigError, match="EarlyStopping.patience: must be an integer >= 0"):
        EarlyStopping(patience=-1)
    with pytest.raises(ConfigError, match="save_best_only compares the epochs' records"):
        ModelCheckpoint("m.dl4py", save_best_only=True, save_freq=10)
