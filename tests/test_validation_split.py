"""validation_split keeps the held-out rows out of training and out of the normalizer's
statistics: in Python (the training part of the split is what the normalizer is fitted on,
and exactly what fit then trains on) and in a run config (``data.validation.split`` with
``data.normalizer``: the runner fits the normalizer after the split).

The held-out rows are outliers (about 1000 where the rest are about 0): statistics that took
in even one of them would be far off."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dl4py import ArrayDataSetIterator, InputType, MultiLayerNetwork, NetworkConfig, NormalizerStandardize, OutputLayer
from dl4py.config import RunConfig
from dl4py.nn.loading import load
from dl4py.runner import train_run
from dl4py.train.validation import split_validation

ROWS, FEATURES, FRACTION, SEED = 60, 3, 0.25, 5


def outlier_data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(features, labels, kept)``: ROWS rows near 0 on a 1/64 grid (exact in float32 and in
    a CSV file), except the rows ``split_validation(FRACTION, seed)`` holds out, which are
    near 1000; ``kept`` marks the others. The held-out rows are found by splitting the row
    numbers themselves."""
    ids = torch.arange(ROWS, dtype=torch.float32)[:, None]
    _, probe = split_validation(ArrayDataSetIterator(ids, torch.zeros(ROWS, dtype=torch.long), 8), FRACTION, seed=seed)
    held = probe.features[:, 0].long()
    kept = torch.ones(ROWS, dtype=torch.bool)
    kept[held] = False
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(ROWS, FEATURES, generator=generator) * 64).round() / 64
    x[held] += 1000.0
    return x, torch.arange(ROWS) % 3, kept


def assert_statistics_of(normalizer, rows: torch.Tensor, everything: torch.Tensor) -> None:
    """The normalizer's mean and population std are those of ``rows``, not of ``everything``."""
    rows, everything = rows.double(), everything.double()
    np.testing.assert_allclose(normalizer.mean.numpy(), rows.mean(0).numpy(), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(normalizer.std.numpy(), rows.std(0, unbiased=False).numpy(), rtol=1e-9)
    assert (everything.mean(0) - rows.mean(0)).abs().min() > 100  # the data tells the two apart


def network() -> NetworkConfig:
    return NetworkConfig(seed=1, input_type=InputType.feed_forward(FEATURES),
                         layers=[OutputLayer(n_out=3, activation="softmax", loss="mcxent")])


def test_in_python_fit_trains_on_exactly_the_rows_the_normalizer_was_fitted_on():
    x, y, kept = outlier_data(SEED)
    data = ArrayDataSetIterator(x, y, batch_size=8, seed=SEED)
    train, held = split_validation(data, FRACTION)  # the split fit(validation_split=) makes
    normalizer = NormalizerStandardize().fit(train)
    assert_statistics_of(normalizer, x[kept], x)

    model = MultiLayerNetwork(network(), backend="cpu").set_normalizer(normalizer)
    history = model.fit(data, epochs=1, validation_split=FRACTION, verbose=0)
    # fit held out the outliers the normalizer never saw, and trained on the rest:
    assert history.history["examples"] == [int(kept.sum())]
    assert torch.equal(held.features, x[~kept])
    assert history.history["val_loss"] == [pytest.approx(model.score(held), rel=1e-9)]
    assert model.normalizer is normalizer  # fit keeps it as fitted
    assert_statistics_of(model.normalizer, x[kept], x)


def test_fit_fits_the_normalizer_it_is_given_on_the_training_rows_only():
    """``fit(data, validation_split=f, normalizer=N())``: N sees the rows fit trains on, never
    the held-out ones, and the model keeps it (the Python twin of a run config's normalizer)."""
    x, y, kept = outlier_data(SEED)
    data = ArrayDataSetIterator(x, y, batch_size=8, seed=SEED)
    model = MultiLayerNetwork(network(), backend="cpu")
    history = model.fit(data, epochs=1, validation_split=FRACTION, normalizer=NormalizerStandardize(), verbose=0)
    assert history.history["examples"] == [int(kept.sum())]
    assert_statistics_of(model.normalizer, x[kept], x)
    with pytest.raises(TypeError, match="needs a dl4py Normalizer, got str"):
        model.fit(data, normalizer="standardize", verbose=0)


def test_a_run_config_fits_its_normalizer_on_the_rows_left_after_the_split(tmp_path):
    x, y, kept = outlier_data(SEED)
    train_csv = tmp_path / "train.csv"
    train_csv.write_text("".join(",".join(f"{v!r}" for v in row) + f",{label}\n"
                                 for row, label in zip(x.tolist(), y.tolist())))
    config = tmp_path / "run.yaml"
    config.write_text(f"""\
network:
  seed: 1
  input_type: {{type: feed_forward, size: {FEATURES}}}
  layers:
    - {{type: output, n_out: 3, activation: softmax, loss: mcxent}}
data:
  dataset: csv
  train_path: {train_csv}
  num_classes: 3
  seed: {SEED}
  normalizer: standardize
  validation: {{split: {FRACTION}}}
training: {{epochs: 1, batch_size: 8, backend: cpu, score_every: 0}}
""")
    result = train_run(RunConfig.from_file(config), output=tmp_path / "run", progress=False)
    assert result["status"] == "completed" and result["history"]["examples"] == [int(kept.sum())]
    for saved in ("model.dl4py", "checkpoint.dl4py"):
        assert_statistics_of(load(tmp_path / "run" / saved, backend="cpu").normalizer, x[kept], x)
