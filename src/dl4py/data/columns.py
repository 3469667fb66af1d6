"""Named columns -> features and labels: the rules a DataFrame, a Hugging Face dataset, a
dict batch and a streamed CSV/Parquet chunk share, so each names its mistakes the same way.

Labels follow `DataSet`: an integer (or bool) column is class indices, one float column a
regression target ``[n, 1]``, several label columns a float target ``[n, k]``.
"""

from __future__ import annotations

import importlib
import math
from typing import Callable

import numpy as np
import torch

from dl4py.errors import DataError

__all__ = ["frame_arrays", "dict_arrays", "labels_from_columns", "optional_import", "first_non_finite",
           "cell_explainer", "Explain"]

# Words one bad cell as a whole one-line message: (row position in the frame, column name;
# None when the row itself is malformed) -> "FILE: line 7, column 'b': 'x' is not a number".
Explain = Callable[[int, "str | None"], str]


def optional_import(module: str, extra: str, what: str):
    """Import an optional dependency, or raise a DataError naming the extra to install."""
    try:
        mod = importlib.import_module(module)
    except ImportError:  # also when sys.modules[module] is None (how tests simulate absence)
        mod = None
    if mod is None:
        raise DataError(f"{what} needs the '{module}' package: pip install \"dl4py[{extra}]\"")
    return mod


def _names(value, what: str) -> list[str] | None:
    if value is None:
        return None
    names = [value] if isinstance(value, str) else list(value)
    if not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{what} must be a column name or a list of names, got {value!r}")
    return names


def split_columns(columns: list[str], label, features, where: str) -> tuple[list[str], list[str] | None]:
    """-> (feature columns, label columns or None). Every name must exist in ``columns``."""
    labels, wanted = _names(label, "label"), _names(features, "features")
    for name in (labels or []) + (wanted or []):
        if name not in columns:
            shown = ", ".join(repr(c) for c in columns[:20]) + (" ..." if len(columns) > 20 else "")
            raise DataError(f"{where} has no column {name!r}; its columns are {shown}")
    if wanted is None:
        wanted = [c for c in columns if c not in (labels or [])]
    if not wanted:
        raise DataError(f"{where}: no feature columns are left besides the label {label!r}")
    return wanted, labels


def frame_arrays(frame, label, features, where: str, need_label: bool = True, explain: Explain | None = None):
    """A pandas DataFrame -> (features float32 [n, k], labels or None).

    A NaN or infinite feature or label is a DataError naming its column and row:
    ``explain(row, column)`` words it (a streamed file names its line, and then a text cell
    too); by default the row's index label. The check is one vectorized pass per array."""
    columns = [str(c) for c in frame.columns]
    if need_label and label is None:
        raise DataError(
            f"{where}: name the label column, e.g. fit(df, label=\"y\") (columns: {', '.join(columns[:20])})"
        )
    feature_names, label_names = split_columns(columns, label, features, where)
    # Names are matched as text (a DataFrame made from an array has integer column names).
    original = {str(c): c for c in frame.columns}
    if explain is not None:  # a file: its first cell that is not a number, by line
        _raise_first_text_cell(frame, original, feature_names + (label_names or []), explain)
    x = _numeric(frame[[original[n] for n in feature_names]], where, "feature")
    label_values = None if label_names is None else frame[[original[n] for n in label_names]].to_numpy()
    y = None if label_names is None else labels_from_columns(label_values, label_names, where)
    found = [(cell[0], names[cell[1]]) for values, names in ((x, feature_names), (label_values, label_names))
             if values is not None and (cell := first_non_finite(values)) is not None]
    if found:  # the earliest row, so a file names its first bad line
        raise DataError((explain or cell_explainer(frame, where))(*min(found, key=lambda cell: cell[0])))
    return x, y


def first_non_finite(values: np.ndarray) -> tuple[int, int] | None:
    """(row, column) of the first NaN or infinity of a 2-D array, or None. Integers pass at
    once; floats cost one vectorized pass, and the cell is searched for only when there is one."""
    if values.dtype.kind not in "fc":
        return None
    finite = np.isfinite(values)
    if finite.all():
        return None
    row, column = np.argwhere(~finite.reshape(len(values), -1))[0]
    return int(row), int(column)


def cell_explainer(frame, where: str, row_name: Callable[[int], str] | None = None) -> Explain:
    """``explain`` for a bad cell of ``frame``: its column, value and row, the row named by
    ``row_name(position)`` (default: its index label, and its position when they differ)."""
    original = {str(c): c for c in frame.columns}

    def index_label(row: int) -> str:
        label = frame.index[row]
        label = label.item() if isinstance(label, np.generic) else label
        return f"index {label!r}" + ("" if label == row else f" (row {row})")

    def explain(row: int, column: str | None) -> str:
        value = frame[original[column]].iloc[row]
        if row_name is not None:
            return f"{where}: column {column!r} is {_shown(value)} at {row_name(row)}"
        return (f"{where}: column {column!r} is {_shown(value)} at {index_label(row)}; "
                "drop or fill such rows first (e.g. df.dropna())")

    return explain


def _shown(value) -> str:
    if isinstance(value, (float, np.floating)) and math.isnan(value):
        return "NaN (a missing value)"
    if isinstance(value, (float, np.floating)) and math.isinf(value):
        return str(float(value))
    return f"{value!r}, beyond float32's range"  # finite, yet inf once converted to float32


def _raise_first_text_cell(frame, original: dict, names: list[str], explain: Explain) -> None:
    """A DataError for the first row holding text where a number belongs (object columns only:
    a stray word in a file's numeric column, or a column of words)."""
    first = None
    for name in names:
        column = frame[original[name]]
        if column.dtype.kind in "biuf":
            continue
        for row, value in enumerate(column.to_numpy()):
            if first is not None and row >= first[0]:
                break
            if not _is_finite_number(value):
                first = (row, name)
                break
    if first is not None:
        raise DataError(explain(*first))


def _is_finite_number(value) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def _numeric(frame, where: str, role: str) -> np.ndarray:
    bad = [str(c) for c, t in frame.dtypes.items() if not (t.kind in "biuf")]
    if bad:
        raise DataError(
            f"{where}: {role} columns must be numbers; {', '.join(repr(b) for b in bad)} "
            f"{'is' if len(bad) == 1 else 'are'} not (encode them, e.g. df[col].astype('category').cat.codes)"
        )
    return frame.to_numpy(dtype=np.float32)


def labels_from_columns(values: np.ndarray, names: list[str], where: str) -> torch.Tensor:
    """[n, len(names)] label values -> int64 class indices [n] or float32 targets [n, k]."""
    values = np.asarray(values)
    if values.ndim == 2 and values.shape[1] == 1:
        values = values[:, 0]
    kind = values.dtype.kind
    if kind == "O" or kind in "USM":
        raise DataError(
            f"{where}: label column {', '.join(map(repr, names))} holds {values.dtype} values, not numbers; "
            "map classes to integers first, e.g. df[col].astype('category').cat.codes"
        )
    if values.ndim == 1 and kind in "biu":
        return torch.from_numpy(values.astype(np.int64))
    if values.ndim == 1:  # one float column: a regression target
        return torch.from_numpy(values.astype(np.float32).reshape(-1, 1))
    return torch.from_numpy(values.astype(np.float32))


def dict_arrays(batch: dict, label, features, where: str):
    """A dict of columns (a Hugging Face batch, a collated dict) -> (features, labels).

    ``label`` defaults to "label"; ``features`` to every other key. Several scalar feature
    columns become the columns of one [n, k] matrix; a single column keeps its own shape
    (an image stays [n, h, w])."""
    label = "label" if label is None else label
    feature_names, label_names = split_columns(list(batch), label, features, where)
    if len(feature_names) == 1:
        x = _as_array(batch[feature_names[0]], where, feature_names[0])
    else:
        parts = [_as_array(batch[n], where, n) for n in feature_names]
        x = np.stack([p.reshape(len(p), -1) for p in parts], axis=1).reshape(len(parts[0]), -1)
    y = np.stack([_as_array(batch[n], where, n) for n in label_names], axis=1)
    return x.astype(np.float32, copy=False), labels_from_columns(y, label_names, where)


def _as_array(value, where: str, name: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.numpy()
    try:
        array = np.asarray(value)
        if array.dtype == object:  # ragged lists, PIL images: stack example by example
            array = np.stack([np.asarray(v) for v in value])
    except (ValueError, TypeError) as exc:
        raise DataError(f"{where}: column {name!r} cannot be read as an array of numbers ({exc})") from None
    if array.dtype.kind not in "biuf":
        raise DataError(f"{where}: column {name!r} holds {array.dtype} values, not numbers")
    return array
