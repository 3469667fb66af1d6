"""Model.predict / predict_proba: numpy, class indices for a classifier, values for a
regressor, on anything fit accepts, with the model's normalizer applied (and saved)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from devices import backend_for, on_devices, tolerance

import dl4py
from dl4py import (
    DataSet,
    DenseLayer,
    InputType,
    MnistDataSetIterator,
    MultiLayerNetwork,
    NetworkConfig,
    NormalizerStandardize,
    OutputLayer,
    Sgd,
)


@pytest.fixture(scope="module")
def classifier_on():
    """``classifier_on(device)``: an MLP trained one epoch on 1,024 MNIST images on ``device``
    with a standardizing normalizer, and 500 test images with their labels: (model, test)."""
    from conftest import require_mnist

    require_mnist()
    made = {}

    def get(device):
        if device not in made:
            train = MnistDataSetIterator(64, train=True, seed=1, limit=1024)
            config = NetworkConfig(seed=3, updater=Sgd(learning_rate=0.1), input_type=InputType.feed_forward(784),
                                   layers=[DenseLayer(n_out=32, activation="relu"), OutputLayer(n_out=10)])
            model = MultiLayerNetwork(config, backend=backend_for(device)).init()
            model.set_normalizer(NormalizerStandardize().fit(train.features))
            model.fit(train, epochs=1, verbose=0)
            made[device] = model, MnistDataSetIterator(100, train=False, shuffle=False, limit=500)
        return made[device]

    return get


@pytest.fixture
def classifier(classifier_on):
    return classifier_on("cpu")


def on_cpu(outputs) -> np.ndarray:
    return outputs.cpu().numpy()


@on_devices
def test_a_classifier_predicts_class_indices_and_probabilities_as_numpy(classifier_on, device):
    model, test = classifier_on(device)
    x, y = test.features.numpy(), test.labels.numpy()
    proba = model.predict_proba(x)
    assert isinstance(proba, np.ndarray) and proba.shape == (500, 10) and proba.dtype == np.float32
    np.testing.assert_allclose(proba, on_cpu(model.output(x)), **tolerance(device))  # exact on the CPU
    np.testing.assert_allclose(proba.sum(axis=1), 1.0, atol=1e-5)
    classes = model.predict(x)
    assert classes.shape == (500,) and classes.dtype == np.int64
    np.testing.assert_array_equal(classes, proba.argmax(axis=1))
    # The same numbers evaluate() counts: predict's accuracy is the evaluation's. evaluate() runs
    # the test set's batches of 100: on a GPU another kernel, which may turn a near tie or two.
    within = 1e-12 if device == "cpu" else 2 / 500
    assert (classes == y).mean() == pytest.approx(model.evaluate(test).accuracy(), abs=within)
    assert (classes == y).mean() > 0.7


def test_predict_takes_anything_fit_takes_in_any_batch_size(classifier):
    model, test = classifier
    x, y = test.features, test.labels
    expected = model.predict(x.numpy())
    for data in (x, (x.numpy(), y.numpy()), DataSet(x, y), test, [(x[:123], y[:123]), (x[123:400], y[123:400]), (x[400:], y[400:])]):
        np.testing.assert_array_equal(model.predict(data), expected)
    np.testing.assert_array_equal(model.predict(x, batch_size=7), expected)
    np.testing.assert_allclose(model.predict_proba(x, batch_size=7), model.predict_proba(x), atol=1e-6)


@on_devices
def test_the_normalizer_applies_and_is_saved_with_the_model(classifier_on, device, tmp_path):
    model, test = classifier_on(device)
    x = test.features
    normalizer = model.normalizer
    with_normalizer = model.predict_proba(x)
    try:
        model.set_normalizer(None)
        by_hand = model.predict_proba(normalizer.transform(x))
        raw = model.predict_proba(x)
    finally:
        model.set_normalizer(normalizer)
    np.testing.assert_allclose(with_normalizer, by_hand, atol=1e-6)
    assert np.abs(with_normalizer - raw).max() > 0.1  # it does make a difference
    model.save(tmp_path / "model.dl4py", save_updater=False)
    restored = dl4py.load(tmp_path / "model.dl4py", backend=backend_for(device))
    np.testing.assert_array_equal(restored.predict(x), model.predict(x))
    np.testing.assert_allclose(restored.predict_proba(x), with_normalizer, atol=1e-6)


@on_devices
def test_a_regressor_predicts_values_with_its_normalizer(device):
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(512, 4)) * [1, 10, 0.1, 3] + [100, -50, 7, 0]).astype(np.float32)
    weights = np.array([[1.0, -0.5], [0.1, 0.2], [-3.0, 1.0], [0.5, 0.0]], dtype=np.float32)
    targets = ((x - x.mean(0)) / x.std(0)) @ weights
    config = NetworkConfig(seed=1, updater=Sgd(learning_rate=0.05), input_type=InputType.feed_forward(4),
                           layers=[OutputLayer(n_out=2, loss="mse", activation="identity")])
    model = MultiLayerNetwork(config, backend=backend_for(device)).init().set_normalizer(NormalizerStandardize().fit(x))
    model.fit((x, targets), epochs=20, batch_size=64, verbose=0)
    values = model.predict(x)
    assert values.shape == (512, 2) and values.dtype == np.float32  # values, not class indices
    np.testing.assert_allclose(values, on_cpu(model.output(x)), **tolerance(device))
    np.testing.assert_allclose(values, model.predict_proba(x), atol=0)
    assert np.abs(values - targets).mean() < 0.05  # learnt through the normalizer


@on_devices
def test_a_one_column_sigmoid_classifier_predicts_at_one_half(device):
    config = NetworkConfig(seed=1, updater=Sgd(learning_rate=0.1), input_type=InputType.feed_forward(3),
                           layers=[OutputLayer(n_out=1, loss="xent", activation="sigmoid")])
    model = MultiLayerNetwork(config, backend=backend_for(device)).init()
    x = torch.randn(64, 3, generator=torch.Generator().manual_seed(0)) * 5
    p = model.predict_proba(x)
    classes = model.predict(x)
    assert classes.shape == (64,) and classes.dtype == np.int64
    np.testing.assert_array_equal(classes, (p[:, 0] >= 0.5).astype(np.int64))
    assert 0 < classes.sum() < 64


@on_devices
def test_output_reads_an_iterator_in_its_own_batches(classifier_on, device):
    """output() takes any data fit takes: an iterator is read as it batches itself."""
    model, test = classifier_on(device)
    features = torch.cat([batch.features for batch in test])
    # The same numbers (on a GPU, forward passes of 100 and of 500 may take other kernels).
    torch.testing.assert_close(model.output(test).cpu(), model.output(features).cpu(), **tolerance(device))
    # another forward batch size: the same numbers up to float32 summation order
    close = {"rtol": 1e-5, "atol": 1e-6} if device == "cpu" else tolerance(device)
    torch.testing.assert_close(model.output(test, batch_size=7).cpu(), model.output(features).cpu(), **close)
