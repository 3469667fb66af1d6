"""Named columns -> features and labels: the rules a DataFrame, a Hugging Face dataset, a
dict batch and a streamed CSV/Parquet chunk share, so each names its mistakes the same way.

Labels follow `DataSet`: an integer (or bool) column is class indices, one float column a
regression target ``[n, 1]``, several label columns a float target ``[n, k]``.
"""

from __future__ import annotations

import numpy as np
import torch

from dl4py.errors import DataError

__all__ = ["frame_arrays", "dict_arrays", "labels_from_columns", "optional_import"]


def optional_import(module: str, extra: str, what: str):
    """Import an optional dependency, or raise a DataError naming the extra to install."""
    import importlib

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


def frame_arrays(frame, label, features, where: str, need_label: bool = True):
    """A pandas DataFrame -> (features float32 [n, k], labels or None)."""
    columns = [str(c) for c in frame.columns]
    if need_label and label is None:
        raise DataError(
            f"{where}: name the label column, e.g. fit(df, label=\"y\") (columns: {', '.join(columns[:20])})"
        )
    feature_names, label_names = split_columns(columns, label, features, where)
    # Names are matched as text (a DataFrame made from an array has integer column names).
    original = {str(c): c for c in frame.columns}
    x = _numeric(frame[[original[n] for n in feature_names]], where, "feature")
    y = None if label_names is None else labels_from_columns(
        frame[[original[n] for n in label_names]].to_numpy(), label_names, where)
    return x, y


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
