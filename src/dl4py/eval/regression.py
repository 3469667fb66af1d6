"""Regression evaluation: DL4J's ``org.nd4j.evaluation.regression.RegressionEvaluation``."""

from __future__ import annotations

import math

import torch

from dl4py.errors import ConfigError

__all__ = ["RegressionEvaluation"]

_RULE = "=" * 66
_METRICS = ("mse", "mae", "rmse", "rse", "pearson", "r2")
_HEADERS = ("MSE", "MAE", "RMSE", "RSE", "PC", "R^2")  # DL4J's column titles
# Rows of the per-column accumulator table (float64, one column per output column).
_MEAN_Y, _MEAN_P, _M2_Y, _M2_P, _CO, _SSE, _SAE = range(7)


class RegressionEvaluation:
    """Per-column MSE, MAE, RMSE, RSE, R² and Pearson correlation, accumulated over batches.

    ``eval(labels, predictions)`` takes ``[n]`` or ``[n, c]`` tensors (or numpy arrays) on any
    device. Nothing but a few float64 numbers per column is kept: counts, means and centred
    sums of squares and products, merged batch by batch with Chan's parallel formulas, so
    neither the order of batches nor a large offset in the targets loses precision (DL4J's
    raw sums of squares do).

    Definitions follow DL4J: RSE = Σ(y - ŷ)² / Σ(y - ȳ)², R² = 1 - RSE (DL4J's ``rSquared``,
    the coefficient of determination, not the squared correlation), PC = Pearson's r of
    ``y`` and ``ŷ``. Called without a column, each metric is the plain average over columns
    (DL4J's ``averageMeanSquaredError`` ...). A column whose target is constant has no
    variance: its RSE is inf and R² -inf (NaN when the predictions are exact too) and PC NaN,
    as DL4J computes them; ``to_dict`` writes those as null.

    >>> ev = RegressionEvaluation()
    >>> ev.eval(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.0, 4.0]))
    >>> round(ev.r_squared(), 4)
    0.5
    """

    def __init__(self, num_columns: int | None = None, column_names: list[str] | None = None):
        if num_columns is not None:
            if isinstance(num_columns, bool) or not isinstance(num_columns, int) or num_columns < 1:
                raise ConfigError("num_columns", f"must be an int >= 1, got {num_columns!r}")
        if column_names is not None:
            column_names = [str(name) for name in column_names]
            if not column_names:
                raise ConfigError("column_names", "needs at least one name")
            if num_columns is not None and num_columns != len(column_names):
                raise ConfigError("column_names", f"has {len(column_names)} names but num_columns is {num_columns}")
            num_columns = len(column_names)
        self._names = column_names
        self._n = 0
        self._acc = None if num_columns is None else torch.zeros(7, num_columns, dtype=torch.float64)

    # ------------------------------------------------------------------ accumulating

    @property
    def num_columns(self) -> int | None:
        """The number of output columns; None until given or seen in the first ``eval``."""
        return None if self._acc is None else self._acc.shape[1]

    @property
    def column_names(self) -> list[str]:
        names = self._names or [f"col_{i}" for i in range(self.num_columns or 0)]
        return list(names)

    def num_examples(self) -> int:
        return self._n

    def eval(self, labels, predictions) -> None:
        """Add one batch: ``labels`` and ``predictions`` of the same shape, ``[n]`` or ``[n, c]``."""
        y = _as_matrix(labels, "labels")
        p = _as_matrix(predictions, "predictions")
        if y.shape != p.shape:
            raise ValueError(f"labels have shape {list(y.shape)} but predictions {list(p.shape)}; "
                             "a regression evaluation needs one prediction per target")
        if self._acc is not None and y.shape[1] != self.num_columns:
            raise ValueError(f"labels have {y.shape[1]} columns but this evaluation has {self.num_columns}")
        n = y.shape[0]
        if n == 0:
            return
        # float64 where the data lives; only the [7, c] batch summary moves to the CPU.
        y, p = y.to(torch.float64), p.to(y.device, torch.float64)
        mean_y, mean_p = y.mean(0), p.mean(0)
        dy, dp = y - mean_y, p - mean_p
        err = p - y
        batch = torch.stack([mean_y, mean_p, (dy * dy).sum(0), (dp * dp).sum(0), (dy * dp).sum(0),
                             (err * err).sum(0), err.abs().sum(0)]).cpu()
        self._add(n, batch)

    def merge(self, other: RegressionEvaluation) -> None:
        """Add ``other``'s statistics to this one, as when workers each evaluate a share."""
        if not isinstance(other, RegressionEvaluation):
            raise ValueError(f"merge: other must be a RegressionEvaluation, got {type(other).__name__}")
        if other._acc is None or other._n == 0:
            return
        if self._acc is not None and self.num_columns != other.num_columns:
            raise ValueError(f"merge: cannot merge an evaluation of {other.num_columns} columns "
                             f"into one of {self.num_columns} columns")
        if self._names is not None and other._names is not None and self._names != other._names:
            raise ValueError(f"merge: column names differ: {self._names} vs {other._names}")
        self._names = self._names or other._names
        self._add(other._n, other._acc)

    def _add(self, n_b: int, b: torch.Tensor) -> None:
        if self._acc is None or self._n == 0:
            self._acc, self._n = b.clone(), n_b
            return
        a, n_a = self._acc, self._n
        n = n_a + n_b
        # Chan et al.: centred sums of two parts combine through the difference of their means.
        d_y, d_p = b[_MEAN_Y] - a[_MEAN_Y], b[_MEAN_P] - a[_MEAN_P]
        w = n_a * n_b / n
        out = a + b
        out[_MEAN_Y] = a[_MEAN_Y] + d_y * (n_b / n)
        out[_MEAN_P] = a[_MEAN_P] + d_p * (n_b / n)
        out[_M2_Y] += d_y * d_y * w
        out[_M2_P] += d_p * d_p * w
        out[_CO] += d_y * d_p * w
        self._acc, self._n = out, n

    # ------------------------------------------------------------------ metrics

    def _per_column(self) -> dict[str, list[float]]:
        if self._acc is None or self._n == 0:
            k = self.num_columns or 0
            return {m: [math.nan] * k for m in _METRICS}
        a, n = self._acc.tolist(), self._n
        out = {m: [] for m in _METRICS}
        for sse, sae, m2y, m2p, co in zip(a[_SSE], a[_SAE], a[_M2_Y], a[_M2_P], a[_CO]):
            out["mse"].append(sse / n)
            out["mae"].append(sae / n)
            out["rmse"].append(math.sqrt(sse / n))
            out["rse"].append(sse / m2y if m2y > 0 else math.inf)  # DL4J: +inf without variance
            out["r2"].append((m2y - sse) / m2y if m2y > 0 else (-math.inf if sse > 0 else math.nan))
            denom = math.sqrt(m2y * m2p)
            out["pearson"].append(co / denom if denom > 0 else math.nan)
        return out

    def _metric(self, name: str, column: int | None) -> float:
        values = self._per_column()[name]
        if column is None:
            return sum(values) / len(values) if values else math.nan
        if isinstance(column, bool) or not isinstance(column, int) or not 0 <= column < len(values):
            raise ValueError(f"column: index {column!r} is out of range [0, {len(values)})")
        return values[column]

    def mean_squared_error(self, column: int | None = None) -> float:
        """Σ(y - ŷ)² / n of ``column``, or the average over columns."""
        return self._metric("mse", column)

    def mean_absolute_error(self, column: int | None = None) -> float:
        return self._metric("mae", column)

    def root_mean_squared_error(self, column: int | None = None) -> float:
        return self._metric("rmse", column)

    def relative_squared_error(self, column: int | None = None) -> float:
        """Σ(y - ŷ)² / Σ(y - ȳ)²."""
        return self._metric("rse", column)

    def r_squared(self, column: int | None = None) -> float:
        """1 - RSE: the coefficient of determination (scikit-learn's ``r2_score``)."""
        return self._metric("r2", column)

    def pearson_correlation(self, column: int | None = None) -> float:
        return self._metric("pearson", column)

    # ------------------------------------------------------------------ reporting

    def to_dict(self) -> dict:
        """JSON-ready: column averages, per-column lists; inf and NaN become null."""
        per_column = {m: [_finite(v) for v in vs] for m, vs in self._per_column().items()}
        averages = {m: _finite(self._metric(m, None)) for m in _METRICS}
        return {"num_columns": self.num_columns, "column_names": self.column_names,
                "num_examples": self._n, **averages, "per_column": per_column}

    def stats(self) -> str:
        """DL4J-style table: one row per column, and the averages when there are several."""
        if self._n == 0:
            raise ValueError("stats(): no examples were evaluated; call eval(labels, predictions) first")
        per_column = self._per_column()
        names = self.column_names
        width = max(8, *(len(n) for n in names))
        lines = ["Regression Metrics".center(len(_RULE), "="),
                 f" # of columns:    {self.num_columns}",
                 f" # of examples:   {self._n}",
                 "",
                 f" {'Column':<{width}}" + "".join(f"{h:>14}" for h in _HEADERS)]
        for i, name in enumerate(names):
            lines.append(f" {name:<{width}}" + "".join(f"{per_column[m][i]:>14.5e}" for m in _METRICS))
        if self.num_columns > 1:
            lines.append(f" {'Average':<{width}}" + "".join(f"{self._metric(m, None):>14.5e}" for m in _METRICS))
        lines.append("RSE = relative squared error, PC = Pearson correlation, R^2 = 1 - RSE")
        return "\n".join(lines) + "\n" + _RULE

    def __repr__(self) -> str:
        return (f"RegressionEvaluation(num_columns={self.num_columns}, num_examples={self._n}, "
                f"r2={self.r_squared():.4f})")


def _as_matrix(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        try:
            x = torch.as_tensor(x)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"{name}: expected a torch tensor or numpy array, got {type(x).__name__} ({e})") from e
    if x.dim() == 1:
        x = x.unsqueeze(1)
    if x.dim() != 2:
        raise ValueError(f"{name}: expected shape [n] or [n, columns], got {list(x.shape)}")
    if x.is_complex() or x.dtype == torch.bool:
        raise ValueError(f"{name}: expected real numbers, got dtype {x.dtype}")
    return x


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None
