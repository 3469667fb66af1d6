"""Classification evaluation: DL4J's ``org.deeplearning4j.eval.Evaluation`` on a confusion matrix."""

from __future__ import annotations

import torch

from dl4py.errors import ConfigError, LabelError

__all__ = ["Evaluation"]

# DL4J's CONFUSION_PRINT_MAX_CLASSES: beyond this the matrix is too wide to read.
_MAX_PRINTED_CLASSES = 20
_NAME_WIDTH_CAP = 24
_RULE = "=" * 66


class Evaluation:
    """Accumulates a confusion matrix over batches and reports accuracy, precision, recall and F1.

    ``eval(labels, predictions)`` takes ``[n]`` integer class indices or ``[n, k]`` rows
    (one-hot, probabilities or logits: the argmax is taken) for either argument, as torch
    tensors on any device or numpy arrays. Rows of the confusion matrix are the actual
    class, columns the predicted class (DL4J's convention).

    Macro averages follow DL4J: precision leaves out classes that were never predicted
    (TP + FP = 0), recall leaves out classes with no examples (TP + FN = 0), and F1 averages
    the per-class F1 over the classes left in by both rules. ``stats()`` lists what was
    left out; when every class is left out the average is 0.0 rather than NaN. Unlike
    DL4J, two-class evaluations are macro-averaged too: ``precision(1)`` gives DL4J's
    binary default (positive class 1). With no examples, the metrics are 0.0, as in DL4J.

    ``top_n`` > 1 also counts top-N accuracy (DL4J's ``topN``): an example is correct when
    fewer than ``top_n`` classes score strictly higher than its actual class, so a class
    tied with the actual one does not push it out (DL4J's rule). It needs ``[n, k]``
    predictions.

    >>> ev = Evaluation(num_classes=3)
    >>> ev.eval(torch.tensor([0, 1, 2]), torch.tensor([[2.0, 0.1, 0.3], [0.2, 1.5, 0.1], [3.0, 0.0, 0.0]]))
    >>> ev.accuracy()
    0.6666666666666666
    """

    def __init__(self, num_classes: int | None = None, labels: list[str] | None = None, top_n: int = 1):
        if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1:
            raise ConfigError("top_n", f"must be an int >= 1, got {top_n!r}")
        self.top_n = top_n
        self._top_n_correct = 0
        if num_classes is not None:
            if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
                raise ConfigError("num_classes", f"must be an int >= 2, got {num_classes!r}")
        if labels is not None:
            labels = [str(name) for name in labels]
            if len(labels) < 2:
                raise ConfigError("labels", f"needs at least 2 class names, got {len(labels)}")
            if num_classes is not None and num_classes != len(labels):
                raise ConfigError("labels", f"has {len(labels)} names but num_classes is {num_classes}")
            num_classes = len(labels)
        self._labels = labels
        self._cm = None if num_classes is None else torch.zeros(num_classes, num_classes, dtype=torch.int64)

    # ------------------------------------------------------------------ accumulating

    @property
    def num_classes(self) -> int | None:
        """The number of classes; None until given or inferred from the first ``eval``."""
        return None if self._cm is None else self._cm.shape[0]

    @property
    def labels(self) -> list[str] | None:
        """Class names given to the constructor, or None."""
        return None if self._labels is None else list(self._labels)

    def eval(self, labels, predictions) -> None:
        """Add one batch. See the class docstring for the accepted shapes."""
        labels = _as_tensor(labels, "labels")
        predictions = _as_tensor(predictions, "predictions")
        if labels.shape[:1] != predictions.shape[:1]:
            raise ValueError(
                f"labels has {labels.shape[0]} rows but predictions has {predictions.shape[0]}; "
                "they must describe the same examples")
        k = self._resolve_num_classes(labels, predictions)
        if self.top_n > 1 and predictions.dim() != 2:
            raise ValueError(f"predictions: top_n={self.top_n} needs [n, k] scores, got class indices "
                             f"of shape {list(predictions.shape)}")
        actual = _class_indices(labels, "labels")
        predicted = _class_indices(predictions, "predictions")
        # One transfer per call: the argmax ran where the data lives, only indices move.
        if actual.device == predicted.device:
            actual, predicted = torch.stack([actual, predicted]).cpu()
        else:
            actual, predicted = actual.cpu(), predicted.cpu()
        _check_range(actual, labels, "labels", k)
        _check_range(predicted, predictions, "predictions", k)
        counts = torch.bincount(actual * k + predicted, minlength=k * k).reshape(k, k)
        if self.top_n > 1:
            self._top_n_correct += _top_n_hits(predictions, actual, self.top_n)
        # Only a batch that passed every check may fix an inferred num_classes.
        self._cm = counts if self._cm is None else self._cm + counts

    def merge(self, other: Evaluation) -> None:
        """Add ``other``'s counts to this one, as when parallel workers each evaluate a share."""
        if not isinstance(other, Evaluation):
            raise ValueError(f"merge: other must be an Evaluation, got {type(other).__name__}")
        if other._cm is None:
            return
        if self._cm is not None and self._cm.shape != other._cm.shape:
            raise ValueError(
                f"merge: cannot merge an evaluation of {other.num_classes} classes "
                f"into one of {self.num_classes} classes")
        if self._labels is not None and other._labels is not None and self._labels != other._labels:
            raise ValueError(f"merge: class names differ: {self._labels} vs {other._labels}")
        if self.top_n != other.top_n:
            raise ValueError(f"merge: top_n differs: {self.top_n} vs {other.top_n}")
        self._top_n_correct += other._top_n_correct
        self._labels = self._labels or other.labels
        self._cm = other._cm.clone() if self._cm is None else self._cm + other._cm

    def _resolve_num_classes(self, labels: torch.Tensor, predictions: torch.Tensor) -> int:
        widths = {name: t.shape[1] for name, t in (("labels", labels), ("predictions", predictions)) if t.dim() == 2}
        if len(set(widths.values())) > 1:
            raise ValueError(
                f"labels has {widths['labels']} columns but predictions has {widths['predictions']}")
        if self._cm is not None:
            k = self._cm.shape[0]
            for name, width in widths.items():
                if width != k:
                    raise ValueError(f"{name} has {width} columns but this evaluation has {k} classes")
            return k
        if not widths:
            raise ValueError(
                "cannot infer num_classes from 1-D labels and predictions; "
                "pass Evaluation(num_classes=...) or [n, k] predictions")
        name, width = next(iter(widths.items()))
        if width < 2:
            # DL4J thresholds a single column at 0.5; that is wrong for logits, so ask for two.
            raise ValueError(f"{name} has {width} column; pass 2 columns (or [n] indices) for two classes")
        return width

    # ------------------------------------------------------------------ counts

    def num_examples(self) -> int:
        return 0 if self._cm is None else int(self._cm.sum())

    def confusion_matrix(self) -> torch.Tensor:
        """A copy of the ``[k, k]`` int64 counts; rows = actual class, columns = predicted."""
        return self._matrix().clone()

    def true_positives(self) -> torch.Tensor:
        """``[k]`` int64 tensor: examples of class i predicted as i."""
        return self._matrix().diagonal().clone()

    def false_positives(self) -> torch.Tensor:
        """``[k]`` int64 tensor: examples of other classes predicted as i."""
        cm = self._matrix()
        return cm.sum(0) - cm.diagonal()

    def false_negatives(self) -> torch.Tensor:
        """``[k]`` int64 tensor: examples of class i predicted as something else."""
        cm = self._matrix()
        return cm.sum(1) - cm.diagonal()

    def class_counts(self) -> torch.Tensor:
        """``[k]`` int64 tensor: examples whose actual class is i."""
        return self._matrix().sum(1)

    def _matrix(self) -> torch.Tensor:
        if self._cm is None:
            raise ValueError("num_classes is not known yet: nothing was evaluated and none was given")
        return self._cm

    # ------------------------------------------------------------------ metrics

    def accuracy(self) -> float:
        n = self.num_examples()
        return 0.0 if n == 0 else int(self._cm.diagonal().sum()) / n

    def top_n_accuracy(self) -> float:
        """Fraction of examples whose actual class is among the ``top_n`` highest scores
        (ties counted as correct); ``accuracy()`` when top_n is 1."""
        if self.top_n == 1:
            return self.accuracy()
        n = self.num_examples()
        return 0.0 if n == 0 else self._top_n_correct / n

    def precision(self, cls: int | None = None) -> float:
        """TP / (TP + FP) of class ``cls`` (0.0 if it was never predicted), or the macro average."""
        return self._metric("precision", cls)

    def recall(self, cls: int | None = None) -> float:
        """TP / (TP + FN) of class ``cls`` (0.0 if it has no examples), or the macro average."""
        return self._metric("recall", cls)

    def f1(self, cls: int | None = None) -> float:
        """2PR / (P + R) of class ``cls`` (0.0 when P + R = 0), or the macro average of per-class F1."""
        return self._metric("f1", cls)

    def excluded(self, metric: str) -> list[int]:
        """Classes left out of the macro average of ``metric`` ('precision', 'recall' or 'f1')."""
        tp, fp, fn = self.true_positives(), self.false_positives(), self.false_negatives()
        rules = {"precision": tp + fp == 0, "recall": tp + fn == 0,
                 "f1": (tp + fp == 0) | (tp + fn == 0)}
        if metric not in rules:
            raise ValueError(f"metric must be one of {sorted(rules)}, got {metric!r}")
        return rules[metric].nonzero().flatten().tolist()

    def _per_class(self) -> dict[str, list[float]]:
        tp = self.true_positives().double()
        fp, fn = self.false_positives().double(), self.false_negatives().double()
        # 0/0 becomes 0.0, DL4J's edge value; the macro averages skip those classes instead.
        precision = torch.where(tp + fp > 0, tp / (tp + fp).clamp(min=1), 0.0)
        recall = torch.where(tp + fn > 0, tp / (tp + fn).clamp(min=1), 0.0)
        denom = precision + recall
        f1 = torch.where(denom > 0, 2 * precision * recall / denom.clamp(min=1e-300), 0.0)
        return {"precision": precision.tolist(), "recall": recall.tolist(), "f1": f1.tolist()}

    def _metric(self, metric: str, cls: int | None) -> float:
        if cls is None and self._cm is None:
            return 0.0  # nothing evaluated: DL4J's value for an empty evaluation
        values = self._per_class()[metric]
        if cls is not None:
            k = len(values)
            if isinstance(cls, bool) or not isinstance(cls, int) or not 0 <= cls < k:
                raise ValueError(f"cls: class index {cls!r} is out of range [0, {k})")
            return values[cls]
        left_out = set(self.excluded(metric))
        kept = [v for i, v in enumerate(values) if i not in left_out]
        return sum(kept) / len(kept) if kept else 0.0

    # ------------------------------------------------------------------ reporting

    def to_dict(self) -> dict:
        """JSON-ready summary: macro metrics, per-class lists, the confusion matrix, excluded classes."""
        if self._cm is None:
            return {"num_classes": None, "labels": self.labels, "num_examples": 0, "accuracy": 0.0,
                    "precision": 0.0, "recall": 0.0, "f1": 0.0, "per_class": {},
                    "excluded": {}, "confusion_matrix": [], **self._top_n_fields()}
        per_class = self._per_class()
        per_class["num_examples"] = self.class_counts().tolist()
        return {
            "num_classes": self.num_classes,
            "labels": self.labels,
            "num_examples": self.num_examples(),
            "accuracy": self.accuracy(),
            "precision": self.precision(),
            "recall": self.recall(),
            "f1": self.f1(),
            "per_class": per_class,
            "excluded": {m: self.excluded(m) for m in ("precision", "recall", "f1")},
            "confusion_matrix": self._cm.tolist(),
            **self._top_n_fields(),
        }

    def _top_n_fields(self) -> dict:
        return {"top_n": self.top_n, "top_n_accuracy": self.top_n_accuracy()} if self.top_n > 1 else {}

    def stats(self, confusion: bool | None = None) -> str:
        """DL4J-style report. ``confusion`` forces the matrix on or off (default: up to 20 classes)."""
        if self.num_examples() == 0:
            raise ValueError("stats(): no examples were evaluated; call eval(labels, predictions) first")
        k = self.num_classes
        show_matrix = k <= _MAX_PRINTED_CLASSES if confusion is None else confusion
        parts = [self._summary(), self._per_class_table()]
        if show_matrix:
            parts.append(_center("Confusion Matrix") + "\n" + self._matrix_text())
        else:
            parts.append(f"Confusion matrix not shown for {k} classes (> {_MAX_PRINTED_CLASSES}); "
                         "use stats(confusion=True) or confusion_matrix()")
        return "\n\n".join(parts) + "\n" + _RULE

    def _summary(self) -> str:
        k = self.num_classes
        lines = [_center("Evaluation Metrics"),
                 f" # of classes:    {k}",
                 f" # of examples:   {self.num_examples()}",
                 f" Accuracy:        {self.accuracy():.4f}"]
        if self.top_n > 1:
            lines.append(f" {f'Top {self.top_n} Accuracy:':<17}{self.top_n_accuracy():.4f}")
        for title, metric in (("Precision", "precision"), ("Recall", "recall"), ("F1 Score", "f1")):
            line = f" {title + ':':<17}{getattr(self, metric)():.4f}"
            n_out = len(self.excluded(metric))
            if n_out:
                line += f"\t({n_out} class{'es' if n_out > 1 else ''} excluded from average)"
            lines.append(line)
        lines.append(f"Precision, recall & F1: macro-averaged (equally weighted avg. of {k} classes)")
        warnings = [(self.excluded("precision"), "never predicted by the model", "precision"),
                    (self.excluded("recall"), "absent from the labels (no examples)", "recall")]
        for classes, why, metric in warnings:
            if classes:
                n, was = len(classes), "was" if len(classes) == 1 else "were"
                lines.append(f"Warning: {n} class{'es' if n > 1 else ''} {was} {why} and {was} "
                             f"excluded from average {metric}: {classes}")
        if self.excluded("f1"):
            lines.append(f"F1 average excludes the classes excluded from either: {self.excluded('f1')}")
        return "\n".join(lines)

    def _per_class_table(self) -> str:
        per_class = self._per_class()
        out_p, out_r = set(self.excluded("precision")), set(self.excluded("recall"))
        names = [self._class_name(i) for i in range(self.num_classes)]
        width = max(8, *(len(n) for n in names))
        lines = [_center("Per-class Metrics"),
                 f" {'Class':<{width}}  Precision     Recall         F1   # examples"]
        for i, (name, count) in enumerate(zip(names, self.class_counts().tolist())):
            p = "-" if i in out_p else f"{per_class['precision'][i]:.4f}"
            r = "-" if i in out_r else f"{per_class['recall'][i]:.4f}"
            lines.append(f" {name:<{width}}  {p:>9}  {r:>9}  {per_class['f1'][i]:>9.4f}  {count:>11}")
        if out_p or out_r:
            lines.append("'-' = undefined (0/0), excluded from that macro average; "
                         "such a class has F1 0 and is excluded from the F1 average")
        return "\n".join(lines)

    def _matrix_text(self) -> str:
        k, cm = self.num_classes, self._cm.tolist()
        # DL4J sizes cells to the largest count (or class index) plus a space; 4 keeps small matrices legible.
        cell = max(4, len(str(max(k - 1, int(self._cm.max())))) + 1)
        lines = ["".join(f"{j:>{cell}}" for j in range(k)), "-" * (cell * k + 1)]
        for i, row in enumerate(cm):
            lines.append("".join(f"{c:>{cell}}" for c in row) + f" | {i} = {self._class_name(i, index=False)}")
        lines.append("\nConfusion matrix format: Actual (rowClass) predicted as (columnClass) N times")
        return "\n".join(lines)

    def _class_name(self, i: int, index: bool = True) -> str:
        if self._labels is None:
            return str(i)
        name = self._labels[i]
        if len(name) > _NAME_WIDTH_CAP:
            name = name[:_NAME_WIDTH_CAP - 3] + "..."
        return f"{i} = {name}" if index else name

    def __repr__(self) -> str:
        return (f"Evaluation(num_classes={self.num_classes}, num_examples={self.num_examples()}, "
                f"accuracy={self.accuracy():.4f})")


# ---------------------------------------------------------------------- input helpers

def _as_tensor(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        try:
            x = torch.as_tensor(x)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"{name}: expected a torch tensor or numpy array, got {type(x).__name__} ({e})") from e
    if x.dim() not in (1, 2):
        raise ValueError(f"{name}: expected shape [n] (class indices) or [n, k] (scores), got {list(x.shape)}")
    return x


def _class_indices(x: torch.Tensor, name: str) -> torch.Tensor:
    """[n] int64 class indices on x's device; NaN rows become -1 so the CPU check can name them."""
    if x.dim() == 1:
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise ValueError(f"{name}: 1-D input must hold integer class indices, got dtype {x.dtype}")
        return x.long()
    idx = x.argmax(dim=1)
    if x.is_floating_point():
        idx = torch.where(x.isnan().any(dim=1), -1, idx)
    return idx


def _top_n_hits(scores: torch.Tensor, actual: torch.Tensor, n: int) -> int:
    """Rows where fewer than ``n`` classes score strictly higher than the actual class."""
    actual = actual.to(scores.device)
    own = scores.gather(1, actual.unsqueeze(1))
    return int(((scores > own).sum(dim=1) < n).sum())


def _check_range(idx: torch.Tensor, original: torch.Tensor, name: str, k: int) -> None:
    bad = ((idx < 0) | (idx >= k)).nonzero()
    if len(bad) == 0:
        return
    row = int(bad[0])
    if original.dim() == 2:
        raise LabelError(f"{name}: row {row} contains NaN")
    raise LabelError(f"{name}: class index {int(idx[row])} at row {row} is out of range [0, {k})")


def _center(title: str) -> str:
    return title.center(len(_RULE), "=")
