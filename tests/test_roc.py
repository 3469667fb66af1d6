"""ROC and ROCMultiClass (``dl4py.eval.roc``) against scikit-learn and DL4J's thresholded ROC:
exact and binned areas, ties, merged batches, one-vs-all, and bad input named."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.metrics import auc, precision_recall_curve, roc_auc_score

from dl4py import ROC, ROCMultiClass

TOL = 1e-9


def _batches(n: int, rng) -> list[slice]:
    """Uneven batches covering 0..n."""
    cuts = np.sort(rng.choice(np.arange(1, n), size=6, replace=False))
    edges = [0, *cuts.tolist(), n]
    return [slice(a, b) for a, b in zip(edges, edges[1:])]


def _sk_auprc(y, s) -> float:
    precision, recall, _ = precision_recall_curve(y, s)
    return auc(recall, precision)  # trapezoidal, from (recall 0, precision 1): DL4J's calculateAUCPR


def test_roc_exact_matches_sklearn_with_ties_single_and_two_column_outputs():
    rng = np.random.default_rng(2)
    y = rng.integers(0, 2, 600)
    s = np.round(rng.random(600) * 0.8 + 0.2 * y, 1)  # 11 distinct scores: many ties
    expected_auc, expected_auprc = roc_auc_score(y, s), _sk_auprc(y, s)

    one_column, two_column, one_hot = ROC(), ROC(), ROC()
    for part in _batches(600, rng):
        one_column.eval(y[part].astype(np.float32).reshape(-1, 1), s[part].reshape(-1, 1))  # sigmoid output
        probs = torch.tensor(np.stack([1 - s[part], s[part]], axis=1))  # softmax output, positive class 1
        two_column.eval(torch.tensor(y[part]), probs)
        one_hot.eval(torch.nn.functional.one_hot(torch.tensor(y[part]), 2), probs)
    for roc in (one_column, two_column, one_hot):
        assert roc.calculate_auc() == pytest.approx(expected_auc, abs=TOL)
        assert roc.calculate_auprc() == pytest.approx(expected_auprc, abs=TOL)
        assert roc.count_actual_positive() == int(y.sum()) and roc.num_examples() == 600

    # Tied examples form one point: the order they come in does not change the areas.
    order = np.lexsort((y, s))  # within each tie, negatives first
    ordered, reverse = ROC(), ROC()
    ordered.eval(y[order], s[order])
    reverse.eval(y[order][::-1].copy(), s[order][::-1].copy())
    for roc in (ordered, reverse):
        assert roc.calculate_auc() == pytest.approx(expected_auc, abs=TOL)
        assert roc.calculate_auprc() == pytest.approx(expected_auprc, abs=TOL)

    merged = ROC()
    half = ROC()
    merged.eval(y[:300], s[:300])
    half.eval(y[300:], s[300:])
    merged.merge(half)
    assert merged.calculate_auc() == pytest.approx(expected_auc, abs=TOL)


def _dl4j_binned(y, s, steps):
    """DL4J's thresholded ROC, written out directly: t = i/steps; p >= t is positive, none at t = 1."""
    tp, fp = [], []
    for i in range(steps + 1):
        t = i * (1.0 / steps)
        predicted = (s >= t) & (t < 1.0)
        tp.append(np.sum(predicted & (y == 1)))
        fp.append(np.sum(predicted & (y == 0)))
    tp, fp = np.array(tp, float), np.array(fp, float)
    tpr, fpr = tp / y.sum(), fp / (len(y) - y.sum())
    precision = np.where(tp + fp > 0, tp / np.maximum(tp + fp, 1), 1.0)
    area = lambda x, v: np.sum(np.abs(np.diff(x)) * (v[1:] + v[:-1]) / 2)  # noqa: E731
    return area(fpr, tpr), area(tpr, precision)


def test_roc_binned_matches_dl4j_thresholds_and_equals_exact_on_its_grid():
    rng = np.random.default_rng(3)
    y = rng.integers(0, 2, 500)
    s = np.clip(rng.random(500) * 0.7 + 0.3 * y, 0, 1)
    s[:25] = 1.0  # saturated outputs: DL4J's last threshold, 1.0, still counts none of them
    binned = ROC(threshold_steps=10)
    for part in _batches(500, rng):
        binned.eval(y[part], s[part])
    expected_auc, expected_auprc = _dl4j_binned(y, s, 10)
    assert binned.calculate_auc() == pytest.approx(expected_auc, abs=TOL)
    assert binned.calculate_auprc() == pytest.approx(expected_auprc, abs=TOL)
    assert abs(binned.calculate_auc() - roc_auc_score(y, s)) > 1e-4  # coarse bins do lose area
    assert "thresholded" in binned.stats()

    grid = np.minimum(np.floor(s * 8), 7) / 8  # scores on the thresholds below 1: binning loses nothing
    on_grid = ROC(threshold_steps=8)
    on_grid.eval(y, grid)
    assert on_grid.calculate_auc() == pytest.approx(roc_auc_score(y, grid), abs=TOL)
    assert on_grid.calculate_auprc() == pytest.approx(_sk_auprc(y, grid), abs=TOL)
    with pytest.raises(ValueError, match="threshold_steps differ"):
        on_grid.merge(binned)


def test_roc_multi_class_one_vs_all_matches_sklearn():
    rng = np.random.default_rng(4)
    labels = rng.integers(0, 4, 300)
    scores = torch.tensor(rng.normal(size=(300, 4)) + np.eye(4)[labels]).softmax(dim=1).numpy()
    roc = ROCMultiClass()
    for part in _batches(300, rng):
        roc.eval(labels[part], scores[part])
    for c in range(4):
        assert roc.calculate_auc(c) == pytest.approx(roc_auc_score(labels == c, scores[:, c]), abs=TOL)
        assert roc.calculate_auprc(c) == pytest.approx(_sk_auprc(labels == c, scores[:, c]), abs=TOL)
    assert roc.calculate_average_auc() == pytest.approx(
        roc_auc_score(labels, scores, multi_class="ovr", average="macro"), abs=TOL)
    # A binary ROC's bare calculate_auc() says what a multi-class one needs instead
    with pytest.raises(TypeError, match=r"calculate_auc needs the class index.*calculate_average_auc\(\) averages"):
        roc.calculate_auc()
    with pytest.raises(TypeError, match=r"calculate_auprc needs the class index.*calculate_average_auprc\(\)"):
        roc.calculate_auprc()


def test_roc_refuses_bad_input_by_name():
    with pytest.raises(ValueError, match="row 1 is 2"):
        ROC().eval(torch.tensor([0.0, 2.0]), torch.tensor([0.1, 0.2]))
    with pytest.raises(ValueError, match="ROCMultiClass"):
        ROC().eval(torch.tensor([0, 2]), torch.rand(2, 3))
    with pytest.raises(ValueError, match="row 0 contains NaN"):
        ROC().eval(torch.tensor([1, 0]), torch.tensor([math.nan, 0.2]))
    assert math.isnan(ROC().calculate_auc())
