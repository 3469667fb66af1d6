"""RegressionEvaluation and top-N accuracy against scikit-learn, scipy and numpy; the
evaluation a model chooses (ROC included); a regression CSV run from the command line.
ROC's own tests are in test_roc.py, beside dl4py/eval/roc.py."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from scipy.stats import pearsonr
from sklearn.metrics import mean_absolute_error, mean_squared_error, r2_score, roc_auc_score

from dl4py import (
    ROC,
    ArrayDataSetIterator,
    ConfigError,
    Evaluation,
    InputType,
    MultiLayerNetwork,
    NetworkConfig,
    OutputLayer,
    RegressionEvaluation,
    Sgd,
)
from dl4py.cli import main
from dl4py.train.early_stopping.calculators import RegressionScoreCalculator, calculator_for

TOL = 1e-9


def _batches(n: int, rng) -> list[slice]:
    """Uneven batches covering 0..n."""
    cuts = np.sort(rng.choice(np.arange(1, n), size=6, replace=False))
    edges = [0, *cuts.tolist(), n]
    return [slice(a, b) for a, b in zip(edges, edges[1:])]


# ---------------------------------------------------------------------- regression

def test_regression_metrics_match_sklearn_and_scipy_over_merged_batches():
    rng = np.random.default_rng(0)
    y = rng.normal(size=(400, 3)) * [1.0, 5.0, 0.1] + [0.0, 3.0, -2.0]
    p = y + rng.normal(size=y.shape) * [0.5, 4.0, 0.2]
    ev = RegressionEvaluation()
    for part in _batches(len(y), rng):  # numpy and torch inputs both accepted
        ev.eval(torch.tensor(y[part]), p[part])
    r2 = r2_score(y, p, multioutput="raw_values")
    for c in range(3):
        assert ev.mean_squared_error(c) == pytest.approx(mean_squared_error(y[:, c], p[:, c]), rel=TOL)
        assert ev.mean_absolute_error(c) == pytest.approx(mean_absolute_error(y[:, c], p[:, c]), rel=TOL)
        assert ev.root_mean_squared_error(c) == pytest.approx(math.sqrt(mean_squared_error(y[:, c], p[:, c])), rel=TOL)
        assert ev.r_squared(c) == pytest.approx(r2[c], rel=TOL)
        assert ev.relative_squared_error(c) == pytest.approx(1 - r2[c], rel=TOL)
        assert ev.pearson_correlation(c) == pytest.approx(pearsonr(y[:, c], p[:, c])[0], rel=TOL)
    # Averages over columns, DL4J's averageRSquared etc. = scikit-learn's uniform average.
    assert ev.r_squared() == pytest.approx(r2_score(y, p), rel=TOL)
    assert ev.mean_squared_error() == pytest.approx(mean_squared_error(y, p), rel=TOL)
    assert ev.mean_absolute_error() == pytest.approx(mean_absolute_error(y, p), rel=TOL)
    assert ev.num_examples() == 400 and ev.num_columns == 3

    # Two evaluations of halves merged = one of the whole (parallel workers' shares).
    first, second = RegressionEvaluation(), RegressionEvaluation()
    first.eval(y[:123], p[:123])
    second.eval(y[123:], p[123:])
    first.merge(second)
    for key, value in first.to_dict().items():
        expected = ev.to_dict()[key]
        assert value == (pytest.approx(expected, rel=TOL) if isinstance(value, float) else value), key


def test_regression_single_column_and_stable_with_a_large_offset():
    rng = np.random.default_rng(1)
    y = rng.normal(size=1000)
    p = y + 0.3 * rng.normal(size=1000)
    offset = 1e6  # DL4J's raw sums of squares lose about 4 digits of R² here
    ev = RegressionEvaluation()
    for part in _batches(1000, rng):
        ev.eval(y[part] + offset, (p[part] + offset).reshape(-1, 1))  # [n] labels, [n, 1] predictions
    assert ev.r_squared() == pytest.approx(r2_score(y, p), rel=1e-7)
    assert ev.pearson_correlation() == pytest.approx(pearsonr(y, p)[0], rel=1e-7)


def test_regression_edge_cases_and_report():
    ev = RegressionEvaluation(column_names=["price", "flat"])
    ev.eval(torch.tensor([[1.0, 2.0], [2.0, 2.0], [3.0, 2.0]]), torch.tensor([[1.0, 2.5], [2.0, 2.0], [4.0, 2.0]]))
    assert ev.r_squared(0) == pytest.approx(0.5)
    assert ev.relative_squared_error(1) == math.inf and ev.r_squared(1) == -math.inf  # constant target, as DL4J
    d = ev.to_dict()
    assert d["per_column"]["r2"][1] is None and json.loads(json.dumps(d))["column_names"] == ["price", "flat"]
    text = ev.stats()
    assert "R^2" in text and "price" in text and "5.00000e-01" in text
    with pytest.raises(ValueError, match="shape"):
        ev.eval(torch.zeros(2, 2), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="no examples"):
        RegressionEvaluation().stats()


# ---------------------------------------------------------------------- top-N

def test_top_n_accuracy_matches_numpy_ties_included():
    rng = np.random.default_rng(5)
    scores = rng.integers(0, 6, size=(500, 10)).astype(np.float32)  # integer scores: ties everywhere
    labels = rng.integers(0, 10, 500)
    for n in (1, 3, 5):
        ev = Evaluation(top_n=n)
        for part in _batches(500, rng):
            ev.eval(labels[part], scores[part])
        own = scores[np.arange(500), labels]
        expected = np.mean((scores > own[:, None]).sum(axis=1) < n)  # DL4J: fewer than n strictly higher
        assert ev.top_n_accuracy() == pytest.approx(expected if n > 1 else ev.accuracy(), abs=TOL)
        if n > 1:
            assert f"Top {n} Accuracy:" in ev.stats() and ev.to_dict()["top_n_accuracy"] == ev.top_n_accuracy()
    with pytest.raises(ValueError, match="top_n=3 needs"):
        Evaluation(num_classes=10, top_n=3).eval(torch.tensor([1]), torch.tensor([2]))
    with pytest.raises(ConfigError, match="top_n"):
        Evaluation(top_n=0)


# ---------------------------------------------------------------------- models choose

def _linear(loss: str, n_out: int, activation: str) -> MultiLayerNetwork:
    config = NetworkConfig(layers=[OutputLayer(n_out=n_out, loss=loss, activation=activation)],
                           input_type=InputType.feed_forward(4), updater=Sgd(0.1), seed=3)
    return MultiLayerNetwork(config, backend="cpu").init()


def test_model_evaluate_picks_regression_for_a_regression_loss_and_evaluate_roc():
    x = torch.randn(256, 4, generator=torch.Generator().manual_seed(0))
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    net = _linear("mse", 1, "identity")
    net.fit(ArrayDataSetIterator(x, y, 32, shuffle=False), epochs=5)
    evaluation = net.evaluate(ArrayDataSetIterator(x, y, 50, shuffle=False))
    assert isinstance(evaluation, RegressionEvaluation)
    predicted = net.output(x).numpy()
    assert evaluation.r_squared() == pytest.approx(r2_score(y.numpy(), predicted), rel=1e-6)

    labels = (y[:, 0] > 0).long()
    classifier = _linear("negativeloglikelihood", 2, "softmax")
    classifier.fit(ArrayDataSetIterator(x, labels, 32, shuffle=False), epochs=3)
    assert type(classifier.evaluate(ArrayDataSetIterator(x, labels, 64))) is Evaluation
    roc = classifier.evaluate_roc(ArrayDataSetIterator(x, labels, 64, shuffle=False))
    positive = classifier.output(x)[:, 1].numpy()
    assert isinstance(roc, ROC) and roc.calculate_auc() == pytest.approx(roc_auc_score(labels, positive), abs=TOL)

    # Early stopping on a regression: its calculators, and a classification metric refused early.
    data = ArrayDataSetIterator(x, y, 64, shuffle=False)
    r2 = calculator_for("r2", data, net)
    assert isinstance(r2, RegressionScoreCalculator) and r2.minimize_score is False
    assert r2.calculate_score(net) == pytest.approx(evaluation.r_squared(), rel=1e-6)
    assert calculator_for("mse", data).minimize_score is True
    with pytest.raises(ConfigError, match="regression loss"):
        calculator_for("accuracy", data, net)


# ---------------------------------------------------------------------- command line

@pytest.mark.slow
def test_regression_csv_trains_and_evaluates_from_the_command_line(tmp_path, capsys):
    rng = np.random.default_rng(6)
    x = rng.normal(size=(400, 4))
    y = x @ np.array([1.5, -2.0, 0.5, 3.0]) + 1.0 + 0.1 * rng.normal(size=400)
    table = np.column_stack([x, y])
    np.savetxt(tmp_path / "train.csv", table[:300], delimiter=",", fmt="%.6f")
    np.savetxt(tmp_path / "test.csv", table[300:], delimiter=",", fmt="%.6f")
    config = tmp_path / "regression.yaml"
    config.write_text(f"""\
network:
  seed: 1
  updater: {{type: adam, learning_rate: 0.05}}
  input_type: {{type: feed_forward, size: 4}}
  layers:
    - {{type: output, n_out: 1, activation: identity, loss: mse}}
data: {{dataset: csv, train_path: {tmp_path / 'train.csv'}, test_path: {tmp_path / 'test.csv'}, num_classes: null}}
training: {{epochs: 15, batch_size: 32, backend: cpu, score_every: 0}}
""")
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "dl4py", "train", str(config), "--no-progress",
                           "--output", str(run_dir)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "completed" and result["test_examples"] == 100
    assert result["test_r2"] > 0.9
    assert result["test_rmse"] == pytest.approx(math.sqrt(result["test_mse"]))
    assert result["test_mae"] > 0 and result["test_accuracy"] is None and "test_f1" not in result

    row = next(line for line in (run_dir / "evaluation.txt").read_text().splitlines() if line.startswith(" col_0"))
    assert float(row.split()[-1]) == pytest.approx(result["test_r2"], rel=1e-5)  # the R^2 column

    assert main(["evaluate", str(run_dir), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["r2"] == pytest.approx(result["test_r2"], rel=1e-9) and stats["num_examples"] == 100
