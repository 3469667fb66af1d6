"""ROC and precision-recall areas: DL4J's ``ROC`` (binary) and ``ROCMultiClass`` (one-vs-all)."""

from __future__ import annotations

import math

import torch

from dl4py.errors import ConfigError
from dl4py.eval.evaluation import _as_tensor

__all__ = ["ROC", "ROCMultiClass"]


class ROC:
    """Binary ROC: AUROC (``calculate_auc``) and AUPRC (``calculate_auprc``), DL4J's ``ROC``.

    ``eval(labels, predictions)`` takes either one column (a sigmoid output: ``[n]`` or
    ``[n, 1]`` scores, labels 0/1) or two (a softmax output ``[n, 2]``: column 1 is the
    positive class; labels ``[n]`` class indices or ``[n, 2]`` one-hot).

    ``threshold_steps=0`` (the default, DL4J's exact mode) keeps every score and uses every
    distinct one as a threshold; tied scores form one point, so the areas do not depend
    on the order of tied examples (DL4J's exact mode makes a point per example). Both
    areas are trapezoidal, as DL4J's: AUROC equals scikit-learn's ``roc_auc_score`` and
    AUPRC ``auc(recall, precision)`` of its ``precision_recall_curve``, the curve starting
    at recall 0, precision 1. ``threshold_steps=N`` is DL4J's binned mode: counts at the
    thresholds 0, 1/N, ..., 1 (a score >= t counts as positive; the last, 1.0, counts none,
    so the curve starts at the origin), constant memory, for probabilities in [0, 1] only.

    >>> roc = ROC()
    >>> roc.eval(torch.tensor([0, 1, 1, 0]), torch.tensor([0.1, 0.9, 0.4, 0.3]))
    >>> roc.calculate_auc()
    1.0
    """

    def __init__(self, threshold_steps: int = 0):
        if isinstance(threshold_steps, bool) or not isinstance(threshold_steps, int) or threshold_steps < 0:
            raise ConfigError("threshold_steps", f"must be 0 (exact) or a positive int, got {threshold_steps!r}")
        self.threshold_steps = threshold_steps
        self._positives = self._negatives = 0
        if threshold_steps:
            self._thresholds = torch.arange(threshold_steps + 1, dtype=torch.float64) / threshold_steps
            self._tp = torch.zeros(threshold_steps + 1, dtype=torch.int64)
            self._fp = torch.zeros(threshold_steps + 1, dtype=torch.int64)
        else:
            # Exact mode needs every score; kept as float64 on the CPU, concatenated when read.
            self._scores: list[torch.Tensor] = []
            self._labels: list[torch.Tensor] = []

    # ------------------------------------------------------------------ accumulating

    def eval(self, labels, predictions) -> None:
        """Add one batch. See the class docstring for the accepted shapes."""
        scores, positive = _binary_columns(labels, predictions)
        self._add(scores, positive)

    def _add(self, scores: torch.Tensor, positive: torch.Tensor) -> None:
        """``scores`` [n] float, ``positive`` [n] bool, on any device."""
        bad = scores.isnan()
        if bool(bad.any()):
            raise ValueError(f"predictions: row {int(bad.nonzero()[0])} contains NaN; ROC needs real scores")
        n_pos = int(positive.sum())
        self._positives += n_pos
        self._negatives += positive.numel() - n_pos
        if self.threshold_steps == 0:
            self._scores.append(scores.to("cpu", torch.float64))
            self._labels.append(positive.cpu())
            return
        # Thresholds met by each score: t_0..t_{c-1} where c = #(t <= score).
        met = torch.searchsorted(self._thresholds.to(scores.device), scores.to(torch.float64), right=True)
        size = self.threshold_steps + 2
        pos_hist = torch.bincount(met[positive], minlength=size).cpu()
        neg_hist = torch.bincount(met[~positive], minlength=size).cpu()
        # A score meets threshold i when c > i: counts at i are the sums of the histogram above i.
        self._tp += pos_hist.flip(0).cumsum(0).flip(0)[1:]
        self._fp += neg_hist.flip(0).cumsum(0).flip(0)[1:]
        self._tp[-1] = self._fp[-1] = 0  # DL4J: threshold 1.0 predicts nothing positive

    def merge(self, other: ROC) -> None:
        """Add ``other``'s examples to this one."""
        if not isinstance(other, ROC):
            raise ValueError(f"merge: other must be a ROC, got {type(other).__name__}")
        if other.threshold_steps != self.threshold_steps:
            raise ValueError(f"merge: threshold_steps differ: {self.threshold_steps} vs {other.threshold_steps}")
        self._positives += other._positives
        self._negatives += other._negatives
        if self.threshold_steps:
            self._tp += other._tp
            self._fp += other._fp
        else:
            self._scores.extend(other._scores)
            self._labels.extend(other._labels)

    def num_examples(self) -> int:
        return self._positives + self._negatives

    def count_actual_positive(self) -> int:
        return self._positives

    def count_actual_negative(self) -> int:
        return self._negatives

    # ------------------------------------------------------------------ curves

    def _counts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(thresholds, TP, FP), thresholds descending, the first point predicting nothing positive."""
        if self.threshold_steps:
            return self._thresholds.flip(0), self._tp.flip(0), self._fp.flip(0)
        scores, positive = torch.cat(self._scores), torch.cat(self._labels)
        order = torch.argsort(scores, descending=True, stable=True)
        scores, positive = scores[order], positive[order]
        tp, fp = positive.cumsum(0), (~positive).cumsum(0)
        # One point per distinct score, after the last example of its tie group.
        last = torch.cat([(scores[1:] != scores[:-1]).nonzero().flatten(), torch.tensor([len(scores) - 1])])
        zero = torch.zeros(1, dtype=torch.int64)
        return (torch.cat([torch.tensor([math.inf]), scores[last]]),
                torch.cat([zero, tp[last]]), torch.cat([zero, fp[last]]))

    def roc_curve(self) -> dict[str, list[float]]:
        """Points ``threshold``, ``fpr``, ``tpr`` from the highest threshold down."""
        thresholds, fpr, tpr = self._roc_points()
        return {"threshold": thresholds.tolist(), "fpr": fpr.tolist(), "tpr": tpr.tolist()}

    def precision_recall_curve(self) -> dict[str, list[float]]:
        """Points ``threshold``, ``precision``, ``recall``; precision is 1 where nothing is predicted positive."""
        thresholds, precision, recall = self._pr_points()
        return {"threshold": thresholds.tolist(), "precision": precision.tolist(), "recall": recall.tolist()}

    def _roc_points(self):
        thresholds, tp, fp = self._checked_counts()
        return thresholds, _ratio(fp, self._negatives), _ratio(tp, self._positives)

    def _pr_points(self):
        thresholds, tp, fp = self._checked_counts()
        predicted = (tp + fp).double()
        precision = torch.where(predicted > 0, tp / predicted.clamp(min=1), 1.0)
        return thresholds, precision, _ratio(tp, self._positives)

    def _checked_counts(self):
        if self.num_examples() == 0:
            raise ValueError("no examples were evaluated; call eval(labels, predictions) first")
        return self._counts()

    def calculate_auc(self) -> float:
        """Area under the ROC curve; NaN without examples of both classes (it is undefined)."""
        if self._positives == 0 or self._negatives == 0:
            return math.nan
        _, fpr, tpr = self._roc_points()
        return _trapezoid(fpr, tpr)

    def calculate_auprc(self) -> float:
        """Area under the precision-recall curve (trapezoidal); NaN without positive examples."""
        if self._positives == 0:
            return math.nan
        _, precision, recall = self._pr_points()
        return _trapezoid(recall, precision)

    # ------------------------------------------------------------------ reporting

    def to_dict(self) -> dict:
        return {"threshold_steps": self.threshold_steps, "num_examples": self.num_examples(),
                "positives": self._positives, "negatives": self._negatives,
                "auc": _finite(self.calculate_auc()), "auprc": _finite(self.calculate_auprc())}

    def stats(self) -> str:
        """DL4J's two lines, and a note in binned mode."""
        text = (f"AUC (Area under ROC Curve):                {self.calculate_auc():.6f}\n"
                f"AUPRC (Area under Precision/Recall Curve): {self.calculate_auprc():.6f}\n"
                f"Examples: {self.num_examples()} ({self._positives} positive, {self._negatives} negative)")
        if self.threshold_steps:
            text += (f"\n[Note: thresholded AUC/AUPRC with {self.threshold_steps} steps; "
                     "it may differ from the exact areas (threshold_steps=0)]")
        return text

    def __repr__(self) -> str:
        return f"ROC(threshold_steps={self.threshold_steps}, num_examples={self.num_examples()})"


class ROCMultiClass:
    """One-vs-all ROC per class of a ``[n, k]`` output: DL4J's ``ROCMultiClass``.

    Labels are ``[n]`` class indices or ``[n, k]`` one-hot rows; class i's scores are
    column i. ``calculate_auc(i)`` / ``calculate_auprc(i)`` per class, and their averages
    over the classes (DL4J's ``calculateAverageAUC``, ``calculateAverageAUCPR``).
    """

    def __init__(self, threshold_steps: int = 0):
        ROC(threshold_steps)  # validates threshold_steps with the same message
        self.threshold_steps = threshold_steps
        self._rocs: list[ROC] | None = None

    @property
    def num_classes(self) -> int | None:
        return None if self._rocs is None else len(self._rocs)

    def eval(self, labels, predictions) -> None:
        scores = _as_tensor(predictions, "predictions")
        if scores.dim() != 2 or scores.shape[1] < 2:
            raise ValueError(f"predictions: expected [n, k] scores with k >= 2, got {list(scores.shape)}")
        k = scores.shape[1]
        if self._rocs is not None and k != len(self._rocs):
            raise ValueError(f"predictions have {k} columns but this evaluation has {len(self._rocs)} classes")
        actual = _label_indices(_as_tensor(labels, "labels"), scores.shape[0], k).to(scores.device)
        if self._rocs is None:
            self._rocs = [ROC(self.threshold_steps) for _ in range(k)]
        for i, roc in enumerate(self._rocs):
            roc._add(scores[:, i], actual == i)

    def merge(self, other: ROCMultiClass) -> None:
        if not isinstance(other, ROCMultiClass):
            raise ValueError(f"merge: other must be a ROCMultiClass, got {type(other).__name__}")
        if other._rocs is None:
            return
        if self._rocs is None:
            self._rocs = [ROC(self.threshold_steps) for _ in other._rocs]
        if len(self._rocs) != len(other._rocs):
            raise ValueError(f"merge: {len(other._rocs)} classes into {len(self._rocs)}")
        for mine, theirs in zip(self._rocs, other._rocs):
            mine.merge(theirs)

    def roc(self, cls: int) -> ROC:
        """Class ``cls`` against the rest, as a binary ``ROC``."""
        k = self.num_classes or 0
        if isinstance(cls, bool) or not isinstance(cls, int) or not 0 <= cls < k:
            raise ValueError(f"cls: class index {cls!r} is out of range [0, {k})")
        return self._rocs[cls]

    def num_examples(self) -> int:
        return 0 if self._rocs is None else self._rocs[0].num_examples()

    def calculate_auc(self, cls: int | None = None) -> float:
        """Class ``cls``'s one-vs-all AUROC (DL4J's ``calculateAUC(classIdx)``)."""
        return self.roc(_class_index(cls, "calculate_auc", "calculate_average_auc")).calculate_auc()

    def calculate_auprc(self, cls: int | None = None) -> float:
        """Class ``cls``'s one-vs-all AUPRC (DL4J's ``calculateAUCPR(classIdx)``)."""
        return self.roc(_class_index(cls, "calculate_auprc", "calculate_average_auprc")).calculate_auprc()

    def calculate_average_auc(self) -> float:
        return _mean([r.calculate_auc() for r in self._rocs or []])

    def calculate_average_auprc(self) -> float:
        return _mean([r.calculate_auprc() for r in self._rocs or []])

    def to_dict(self) -> dict:
        rocs = self._rocs or []
        return {"threshold_steps": self.threshold_steps, "num_classes": self.num_classes,
                "num_examples": self.num_examples(),
                "average_auc": _finite(self.calculate_average_auc()),
                "average_auprc": _finite(self.calculate_average_auprc()),
                "auc": [_finite(r.calculate_auc()) for r in rocs],
                "auprc": [_finite(r.calculate_auprc()) for r in rocs]}

    def stats(self) -> str:
        if self.num_examples() == 0:
            raise ValueError("stats(): no examples were evaluated; call eval(labels, predictions) first")
        lines = [" Class        AUC      AUPRC   # positive"]
        for i, r in enumerate(self._rocs):
            lines.append(f" {i:<7}{r.calculate_auc():>9.4f}  {r.calculate_auprc():>9.4f}  {r.count_actual_positive():>11}")
        lines.append(f" Average AUC: {self.calculate_average_auc():.4f}   "
                     f"Average AUPRC: {self.calculate_average_auprc():.4f}")
        return "\n".join(lines)


# ---------------------------------------------------------------------- helpers

def _binary_columns(labels, predictions) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [n], is-positive [n] bool) from a one- or two-column output."""
    scores = _as_tensor(predictions, "predictions")
    if scores.dim() == 2 and scores.shape[1] == 1:
        scores = scores[:, 0]
    if scores.dim() == 1:
        y = _as_tensor(labels, "labels")
        if y.dim() == 2 and y.shape[1] == 1:
            y = y[:, 0]
        if y.shape != scores.shape:
            raise ValueError(f"labels have shape {list(y.shape)} but predictions {list(scores.shape)}; "
                             "a one-column ROC needs one 0/1 label per score")
        bad = (y != 0) & (y != 1)
        if bool(bad.any()):
            row = int(bad.nonzero()[0])
            raise ValueError(f"labels: row {row} is {float(y[row]):g}; a one-column ROC needs labels 0 or 1")
        return scores, (y == 1).to(scores.device)
    if scores.dim() != 2 or scores.shape[1] != 2:
        raise ValueError(f"predictions: ROC needs [n], [n, 1] or [n, 2] scores, got {list(scores.shape)}; "
                         "use ROCMultiClass for more classes")
    actual = _label_indices(_as_tensor(labels, "labels"), scores.shape[0], 2)
    return scores[:, 1], (actual == 1).to(scores.device)


def _label_indices(y: torch.Tensor, n: int, k: int) -> torch.Tensor:
    if y.shape[0] != n:
        raise ValueError(f"labels have {y.shape[0]} rows but predictions {n}")
    if y.dim() == 2:
        if y.shape[1] != k:
            raise ValueError(f"labels have {y.shape[1]} columns but predictions {k}")
        return y.argmax(dim=1)
    if y.is_floating_point() and bool((y != y.round()).any()):
        raise ValueError("labels: 1-D labels must be integer class indices")
    y = y.long()
    bad = (y < 0) | (y >= k)
    if bool(bad.any()):
        row = int(bad.nonzero()[0])
        raise ValueError(f"labels: class index {int(y[row])} at row {row} is out of range [0, {k})")
    return y


def _ratio(counts: torch.Tensor, total: int) -> torch.Tensor:
    return counts.double() / total if total else torch.full(counts.shape, math.nan, dtype=torch.float64)


def _trapezoid(x: torch.Tensor, y: torch.Tensor) -> float:
    # Absolute widths, as DL4J's BaseCurve.calculateArea: the curves run either way.
    return float(((x[1:] - x[:-1]).abs() * (y[1:] + y[:-1]) / 2).sum())


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


def _class_index(cls: int | None, method: str, average: str) -> int:
    """``cls``, or a TypeError that says what a multi-class ROC needs (a bare ``calculate_auc()``
    is what a binary ROC takes, and what a user of one tries first)."""
    if cls is None:
        raise TypeError(f"ROCMultiClass.{method} needs the class index: {method}(cls) is that class's one-vs-all "
                        f"value; {average}() averages the classes")
    return cls
