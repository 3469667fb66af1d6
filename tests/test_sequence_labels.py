"""Per-step labels given as arrays, as a Keras user gives them: sequences ``[n, time, size]`` with
``[n, time]`` class indices (or ``[n, time, k]`` targets) train an ``rnn_output`` network through
``fit(x, y)``, and ``evaluate`` scores every step (padded steps of a masked batch left out, as
DL4J's ``evalTimeSeries``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dl4py import (
    LSTM,
    Adam,
    ArrayDataSetIterator,
    InputType,
    MultiLayerNetwork,
    NetworkConfig,
    RnnOutputLayer,
    SequenceDataSetIterator,
)
from dl4py.errors import DataError


def _network(loss="mcxent", activation=None, n_out=2):
    return MultiLayerNetwork(NetworkConfig(
        layers=[LSTM(n_out=8), RnnOutputLayer(n_out=n_out, loss=loss, activation=activation)],
        input_type=InputType.recurrent(2), seed=3, updater=Adam(learning_rate=0.05)))


def _steps(n=64, time=6, seed=0):
    """Each step's class is whether its first value is above 0.5: learnable step by step."""
    x = np.random.default_rng(seed).random((n, time, 2)).astype(np.float32)
    return x, (x[:, :, 0] > 0.5).astype(np.int64)


def test_per_step_class_indices_as_arrays_train_and_evaluate_every_step():
    x, y = _steps()
    net = _network()
    history = net.fit(x, y, epochs=15, batch_size=16, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    evaluation = net.evaluate((x, y))
    assert evaluation.num_examples() == y.size  # every step is an example
    predicted = net.output(x).argmax(dim=2).numpy()
    assert evaluation.accuracy() == pytest.approx((predicted == y).mean())
    assert evaluation.accuracy() > 0.8


def test_a_masked_batch_is_scored_on_its_real_steps_only():
    x, y = _steps(n=12, time=5)
    lengths = [5, 2, 3, 5, 1, 4, 5, 2, 3, 5, 1, 4]
    sequences = [x[i, :length] for i, length in enumerate(lengths)]
    labels = [y[i, :length] for i, length in enumerate(lengths)]
    net = _network()
    evaluation = net.evaluate(SequenceDataSetIterator(sequences, labels, batch_size=5))
    assert evaluation.num_examples() == sum(lengths)
    right = sum(int((net.output(s[None]).argmax(dim=2)[0].numpy() == lab).sum()) for s, lab in zip(sequences, labels))
    assert evaluation.accuracy() == pytest.approx(right / sum(lengths))


def test_per_step_targets_train_a_regression_output():
    x, _ = _steps(n=32)
    targets = np.stack([x[:, :, 0], x[:, :, 1] * 2], axis=2)
    history = _network(loss="mse", activation="identity").fit(x, targets, epochs=5, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]


def test_a_bad_per_step_label_names_its_row_and_step():
    x, y = _steps(n=10, time=4)
    y[7, 2] = -1
    with pytest.raises(DataError, match=r"labels must be class indices >= 0, got -1 \(row 7, step 2\)"):
        ArrayDataSetIterator(x, y, batch_size=4)
    y[7, 2] = 5
    with pytest.raises(DataError, match=r"labels must be < num_classes=2, got 5 \(row 7, step 2\)"):
        ArrayDataSetIterator(x, y, batch_size=4, num_classes=2)
    assert ArrayDataSetIterator(x, y, batch_size=4).max_label() == (5, 7)  # the example, for the model's check
    # labels [n, time] with features that are not sequences of that length: the old one-line refusal
    with pytest.raises(DataError, match=r"per-step labels \[n, time\] go with sequence features"):
        ArrayDataSetIterator(torch.zeros(10, 3), torch.zeros(10, 4, dtype=torch.int64), batch_size=4)


def test_a_data_loader_of_sequences_with_per_step_labels_trains():
    x, y = _steps(n=32)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y)),
                                         batch_size=8)
    history = _network().fit(loader, epochs=3, verbose=0)
    assert history[0].examples == 32 and history.history["loss"][-1] < history.history["loss"][0]
