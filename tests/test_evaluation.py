"""Evaluation: hand-computed metrics, input forms, merge, DL4J's exclusion rule, errors, reports."""

import json
import math
import re

import numpy as np
import pytest
import torch

from dl4py.eval import Evaluation

# Worked out on paper. Rows = actual, columns = predicted:
#            pred 0  pred 1  pred 2
#  actual 0     2       1       1
#  actual 1     1       2       0
#  actual 2     0       1       2
Y3 = [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
P3 = [0, 0, 1, 2, 1, 1, 0, 2, 2, 1]
CM3 = [[2, 1, 1], [1, 2, 0], [0, 1, 2]]
# TP = [2, 2, 2], FP = [1, 2, 1], FN = [2, 1, 1]
PREC3 = [2 / 3, 1 / 2, 2 / 3]
REC3 = [1 / 2, 2 / 3, 2 / 3]
F13 = [4 / 7, 4 / 7, 2 / 3]


def _eval(y, p, /, **kwargs) -> Evaluation:
    ev = Evaluation(**kwargs)
    ev.eval(y, p)
    return ev


def _scores(pred_idx, k, seed=0) -> torch.Tensor:
    """Random logits whose argmax is pred_idx."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(pred_idx), k, generator=g)
    logits[torch.arange(len(pred_idx)), torch.as_tensor(pred_idx)] += 10.0
    return logits


def test_hand_computed_three_classes():
    ev = _eval(torch.tensor(Y3), torch.tensor(P3), num_classes=3)
    assert ev.confusion_matrix().tolist() == CM3
    assert ev.confusion_matrix().dtype == torch.int64
    assert ev.true_positives().tolist() == [2, 2, 2]
    assert ev.false_positives().tolist() == [1, 2, 1]
    assert ev.false_negatives().tolist() == [2, 1, 1]
    assert ev.num_examples() == 10
    assert ev.accuracy() == pytest.approx(6 / 10, abs=1e-15)
    for c in range(3):
        assert ev.precision(c) == pytest.approx(PREC3[c], abs=1e-15)
        assert ev.recall(c) == pytest.approx(REC3[c], abs=1e-15)
        assert ev.f1(c) == pytest.approx(F13[c], abs=1e-15)
    assert ev.precision() == pytest.approx(11 / 18, abs=1e-15)
    assert ev.recall() == pytest.approx(11 / 18, abs=1e-15)
    assert ev.f1() == pytest.approx(38 / 63, abs=1e-15)  # mean of per-class F1, not F1 of the means


def test_num_classes_inferred_from_first_call():
    ev = Evaluation()
    assert ev.num_classes is None
    ev.eval(torch.tensor(Y3), _scores(P3, 3))
    assert ev.num_classes == 3
    assert ev.confusion_matrix().tolist() == CM3
    with pytest.raises(ValueError, match="4 columns but this evaluation has 3 classes"):
        ev.eval(torch.tensor([0]), torch.zeros(1, 4))


def test_rejected_or_empty_first_batch():
    ev = Evaluation()
    with pytest.raises(ValueError, match="labels: class index 5"):
        ev.eval(torch.tensor([5]), torch.zeros(1, 4))
    assert ev.num_classes is None  # a rejected batch does not fix the class count
    ev.eval(torch.zeros(0, dtype=torch.int64), torch.zeros(0, 4))
    assert ev.num_classes == 4 and ev.num_examples() == 0
    with pytest.raises(ValueError, match="pass 2 columns"):
        Evaluation().eval(torch.zeros(3, 1), torch.zeros(3, 1))


def test_one_hot_and_index_labels_agree():
    one_hot = torch.nn.functional.one_hot(torch.tensor(Y3), 3).float()
    scores = _scores(P3, 3)
    assert _eval(one_hot, scores).to_dict() == _eval(torch.tensor(Y3), scores).to_dict()


def test_logits_probabilities_and_indices_agree():
    logits = _scores(P3, 3)
    y = torch.tensor(Y3)
    by_logits = _eval(y, logits).to_dict()
    assert _eval(y, logits.softmax(dim=1)).to_dict() == by_logits
    assert _eval(y, torch.tensor(P3), num_classes=3).to_dict() == by_logits
    assert by_logits["confusion_matrix"] == CM3


def test_numpy_and_torch_agree():
    logits = _scores(P3, 3)
    from_numpy = _eval(np.asarray(Y3, dtype=np.int32), logits.numpy())
    assert from_numpy.to_dict() == _eval(torch.tensor(Y3), logits).to_dict()


def test_merge_equals_evaluating_all_at_once():
    g = torch.Generator().manual_seed(1)
    y = torch.randint(0, 5, (300,), generator=g)
    scores = torch.randn(300, 5, generator=g)
    whole = _eval(y, scores)
    merged = Evaluation()  # an empty one adopts the shards' class count
    for lo in range(0, 300, 100):
        shard = _eval(y[lo:lo + 100], scores[lo:lo + 100], num_classes=5)
        merged.merge(shard)
    assert torch.equal(merged.confusion_matrix(), whole.confusion_matrix())
    assert merged.to_dict() == whole.to_dict()


def test_merge_rejects_different_num_classes_and_names():
    with pytest.raises(ValueError, match="evaluation of 4 classes into one of 3 classes"):
        Evaluation(num_classes=3).merge(Evaluation(num_classes=4))
    with pytest.raises(ValueError, match="class names differ"):
        Evaluation(labels=["a", "b"]).merge(Evaluation(labels=["a", "c"]))


def test_dl4j_exclusion_rule():
    # Class 1 predicted but never present; class 2 present but never predicted; class 3 neither.
    # TP = [2, 0, 0, 0], FP = [2, 1, 0, 0], FN = [1, 0, 2, 0]
    ev = _eval(torch.tensor([0, 0, 2, 2, 0]), torch.tensor([0, 1, 0, 0, 0]), num_classes=4)
    assert ev.excluded("precision") == [2, 3]
    assert ev.excluded("recall") == [1, 3]
    assert ev.excluded("f1") == [1, 2, 3]
    assert ev.precision() == pytest.approx((1 / 2 + 0) / 2, abs=1e-15)  # classes 0, 1
    assert ev.recall() == pytest.approx((2 / 3 + 0) / 2, abs=1e-15)  # classes 0, 2
    assert ev.f1() == pytest.approx(4 / 7, abs=1e-15)  # class 0 only
    assert ev.precision(2) == 0.0 and ev.recall(1) == 0.0 and ev.f1(2) == 0.0
    text = ev.stats()
    assert "excluded from average precision: [2, 3]" in text
    assert "excluded from average recall: [1, 3]" in text
    assert re.search(r"F1 Score:\s+0\.5714\t\(3 classes excluded from average\)", text)


def test_all_classes_excluded_gives_zero_not_nan():
    ev = _eval(torch.tensor([0, 0]), torch.tensor([1, 1]), num_classes=2)
    assert ev.excluded("f1") == [0, 1]
    assert ev.f1() == 0.0
    empty = Evaluation(num_classes=3)
    for value in (empty.accuracy(), empty.precision(), empty.recall(), empty.f1()):
        assert value == 0.0 and not math.isnan(value)
    assert Evaluation().precision() == 0.0


def test_empty_stats_says_nothing_was_evaluated():
    with pytest.raises(ValueError, match="no examples were evaluated"):
        Evaluation(num_classes=3).stats()
    with pytest.raises(ValueError, match="no examples were evaluated"):
        Evaluation().stats()


@pytest.mark.parametrize("labels, predictions, message", [
    ([0, 3, 1], [0, 1, 1], r"labels: class index 3 at row 1 is out of range \[0, 3\)"),
    ([0, -1, 1], [0, 1, 1], r"labels: class index -1 at row 1 is out of range \[0, 3\)"),
    ([0, 1, 1], [0, 1, 7], r"predictions: class index 7 at row 2 is out of range \[0, 3\)"),
    ([0, 1], [0, 1, 1], "labels has 2 rows but predictions has 3"),
    ([0.0, 1.0, 1.0], [0, 1, 1], "labels: 1-D input must hold integer class indices"),
])
def test_bad_indices_and_rows(labels, predictions, message):
    with pytest.raises(ValueError, match=message):
        Evaluation(num_classes=3).eval(torch.tensor(labels), torch.tensor(predictions))


def test_bad_shapes():
    ev = Evaluation(num_classes=3)
    with pytest.raises(ValueError, match=r"predictions: expected shape \[n\].*got \[2, 3, 1\]"):
        ev.eval(torch.tensor([0, 1]), torch.zeros(2, 3, 1))
    with pytest.raises(ValueError, match="labels has 4 columns but predictions has 3"):
        Evaluation().eval(torch.zeros(2, 4), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="cannot infer num_classes"):
        Evaluation().eval(torch.tensor([0, 1]), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="predictions: row 1 contains NaN"):
        ev.eval(torch.tensor([0, 1]), torch.tensor([[1.0, 0, 0], [0, float("nan"), 0]]))
    assert ev.num_examples() == 0  # a rejected batch adds nothing


def test_bad_constructor_and_class_arguments():
    with pytest.raises(ValueError, match="num_classes: must be an int >= 2"):
        Evaluation(num_classes=1)
    with pytest.raises(ValueError, match="labels: has 2 names but num_classes is 3"):
        Evaluation(num_classes=3, labels=["a", "b"])
    ev = _eval(torch.tensor(Y3), torch.tensor(P3), num_classes=3)
    with pytest.raises(ValueError, match=r"cls: class index 3 is out of range \[0, 3\)"):
        ev.precision(3)
    with pytest.raises(ValueError, match="metric must be one of"):
        ev.excluded("accuracy")


def _number(text: str, title: str) -> float:
    return float(re.search(rf"^ {re.escape(title)}:\s+([0-9.]+)", text, re.M).group(1))


def test_stats_reports_its_numbers():
    ev = _eval(torch.tensor(Y3), torch.tensor(P3), labels=["cat", "dog", "bird"])
    text = ev.stats()
    assert text.startswith("=" * 24 + "Evaluation Metrics" + "=" * 24)
    assert _number(text, "# of classes") == 3
    assert _number(text, "Accuracy") == round(ev.accuracy(), 4)
    assert _number(text, "Precision") == round(ev.precision(), 4)
    assert _number(text, "Recall") == round(ev.recall(), 4)
    assert _number(text, "F1 Score") == round(ev.f1(), 4)
    assert "macro-averaged (equally weighted avg. of 3 classes)" in text
    assert "Warning" not in text
    rows = re.findall(r"^ (\d) = (\w+)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s+(\d+)$", text, re.M)
    assert [(int(i), name) for i, name, *_ in rows] == [(0, "cat"), (1, "dog"), (2, "bird")]
    for c, (_, _, p, r, f, n) in enumerate(rows):
        assert (float(p), float(r), float(f)) == (round(PREC3[c], 4), round(REC3[c], 4), round(F13[c], 4))
        assert int(n) == sum(CM3[c])
    matrix = re.findall(r"^((?:\s+\d+)+) \| (\d) = (\w+)$", text, re.M)
    assert [[int(v) for v in cells.split()] for cells, _, _ in matrix] == CM3
    assert [name for _, _, name in matrix] == ["cat", "dog", "bird"]
    assert "Actual (rowClass) predicted as (columnClass) N times" in text


def test_stats_skips_matrix_for_many_classes():
    k = 25
    y = torch.arange(k).repeat(2)
    ev = _eval(y, _scores(y, k))
    text = ev.stats()
    assert "Confusion matrix not shown for 25 classes" in text
    assert "Confusion Matrix" not in text
    assert len(re.findall(r"^ \d+\s+1\.0000\s+1\.0000\s+1\.0000\s+2$", text, re.M)) == k
    assert "Confusion Matrix" in ev.stats(confusion=True)


def test_to_dict_is_json_ready():
    ev = _eval(torch.tensor(Y3), torch.tensor(P3), labels=["cat", "dog", "bird"])
    d = ev.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["confusion_matrix"] == CM3
    assert d["num_examples"] == 10 and d["labels"] == ["cat", "dog", "bird"]
    assert d["f1"] == ev.f1() and d["per_class"]["precision"] == pytest.approx(PREC3, abs=1e-15)
    assert d["per_class"]["num_examples"] == [4, 3, 3]
    assert json.loads(json.dumps(Evaluation().to_dict()))["num_examples"] == 0


def test_cross_check_with_explicit_loops():
    rng = np.random.default_rng(7)
    n, k = 1000, 7
    y = rng.integers(0, k, n)
    # Skewed predictions: right about half the time, so the per-class numbers differ.
    pred = np.where(rng.random(n) < 0.5, y, rng.integers(0, k, n))
    ev = _eval(torch.from_numpy(y), torch.from_numpy(_scores(pred, k, seed=3).numpy()))
    tp, fp, fn = [0] * k, [0] * k, [0] * k
    for actual, guess in zip(y.tolist(), pred.tolist()):
        if actual == guess:
            tp[actual] += 1
        else:
            fp[guess] += 1
            fn[actual] += 1
    assert ev.true_positives().tolist() == tp
    assert ev.false_positives().tolist() == fp
    assert ev.false_negatives().tolist() == fn
    precision = [tp[c] / (tp[c] + fp[c]) for c in range(k)]
    recall = [tp[c] / (tp[c] + fn[c]) for c in range(k)]
    for c in range(k):
        assert ev.precision(c) == pytest.approx(precision[c], abs=1e-12)
        assert ev.recall(c) == pytest.approx(recall[c], abs=1e-12)
        f1 = 2 * precision[c] * recall[c] / (precision[c] + recall[c])
        assert ev.f1(c) == pytest.approx(f1, abs=1e-12)
    assert ev.precision() == pytest.approx(sum(precision) / k, abs=1e-12)
    assert ev.recall() == pytest.approx(sum(recall) / k, abs=1e-12)
    assert ev.accuracy() == pytest.approx(sum(tp) / n, abs=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_match_cpu():
    logits = _scores(P3, 3)
    on_gpu = _eval(torch.tensor(Y3).cuda(), logits.cuda())
    assert on_gpu.to_dict() == _eval(torch.tensor(Y3), logits).to_dict()
    mixed = _eval(np.asarray(Y3), logits.cuda())  # labels on the host, predictions on the device
    assert mixed.confusion_matrix().tolist() == CM3
