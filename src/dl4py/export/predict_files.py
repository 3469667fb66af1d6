"""What ``dl4py predict`` reads and writes: inputs from files, predictions as CSV or JSON.

Inputs, each checked against the model's input shape with errors naming the file:
- a CSV file of numbers (``skip_lines`` for a header, as ``CsvDataSetIterator``): one
  example per row, either the features alone or the features and a label column
  (``label_index``, default the last, as the CSV reader) which is dropped;
- a ``.npy`` array ``[n, *example_shape]`` (or ``[n, features]`` flat);
- a folder of images (PNG/JPEG, in sub-folders or not), each read as ``ImageFolderIterator``
  reads it (resized to the input's height and width, raw 0-255 pixels: the model's saved
  normalizer scales them), in sorted path order.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dl4py.config.input_type import Convolutional, InputType
from dl4py.data.csv import _read_table  # the CSV reader's own parsing and line-and-column errors
from dl4py.data.images import EXTENSIONS, read_image
from dl4py.errors import DataError


@dataclass
class PredictInput:
    """Features ``[n, *example_shape]`` (float32) and, for images, the file of each row."""

    features: np.ndarray
    names: list[str] = field(default_factory=list)


def read_input(path, example_shape: tuple[int, ...], input_type: InputType | None = None, *, label_index: int = -1,
               skip_lines: int = 0, delimiter: str = ",") -> PredictInput:
    """The examples in ``path`` (CSV, ``.npy`` or an image folder), shaped for the model.
    ``input_type``: the model's one input (``model.signature().input_type``), for image folders."""
    path = Path(path)
    if path.is_dir():
        return _images(path, example_shape, input_type)
    if not path.exists():
        raise DataError(f"{path}: no such file or directory")
    if path.suffix.lower() == ".npy":
        return PredictInput(_shaped(_npy(path), example_shape, path))
    return PredictInput(_csv(path, example_shape, label_index, skip_lines, delimiter))


def _npy(path: Path) -> np.ndarray:
    try:
        array = np.load(path, allow_pickle=False)  # never unpickle what a user hands us
    except (ValueError, OSError, EOFError) as exc:
        raise DataError(f"{path}: not a readable .npy array ({exc})") from None
    if not isinstance(array, np.ndarray) or array.dtype.kind not in "biuf":
        raise DataError(f"{path}: holds {getattr(array, 'dtype', type(array).__name__)} values; "
                        "predict needs numbers")
    return array


def _csv(path: Path, example_shape, label_index: int, skip_lines: int, delimiter: str) -> np.ndarray:
    table = _read_table(path, skip_lines, delimiter)
    width = math.prod(example_shape)
    columns = table.shape[1]
    if columns == width + 1:  # features and a label, as the training CSV had them
        if not -columns <= label_index < columns:
            raise DataError(f"{path}: label column {label_index} is out of range for its {columns} columns")
        table = np.delete(table, label_index % columns, axis=1)
    elif columns != width:
        raise DataError(f"{path}: {columns} columns, but the model takes {width} features per example "
                        f"(give {width} feature columns, or {width + 1} with the label)")
    return _shaped(table, example_shape, path)


def _shaped(array: np.ndarray, example_shape, path: Path) -> np.ndarray:
    width = math.prod(example_shape)
    if tuple(array.shape[1:]) != tuple(example_shape):
        if array.ndim >= 2 and math.prod(array.shape[1:]) == width:
            array = array.reshape(array.shape[0], *example_shape)  # flat rows of a 2-D input, or back
        else:
            shown = ", ".join(map(str, example_shape))
            raise DataError(f"{path}: array of shape {list(array.shape)}, but the model takes [n, {shown}] "
                            f"(or [n, {width}] flat)")
    if array.shape[0] == 0:
        raise DataError(f"{path}: no examples")
    array = array.astype(np.float32)
    if not np.isfinite(array).all():
        row = int(np.argwhere(~np.isfinite(array.reshape(array.shape[0], -1)))[0][0])
        raise DataError(f"{path}: example {row} (0-based) holds a NaN or infinite value")
    return array


def _images(root: Path, example_shape, input_type) -> PredictInput:
    if not isinstance(input_type, Convolutional):  # convolutional_flat too: images read, then flattened
        kind = "several inputs" if input_type is None else input_type.type_name
        raise DataError(f"{root}: an image folder needs a model with a convolutional input, this one takes {kind}")
    height, width, channels = input_type.height, input_type.width, input_type.channels
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in EXTENSIONS)
    if not files:
        raise DataError(f"{root}: holds no images ({', '.join(EXTENSIONS)})")
    pixels = np.stack([read_image(f, height, width, channels) for f in files]).astype(np.float32)
    names = [f.relative_to(root).as_posix() for f in files]
    return PredictInput(pixels.reshape(len(files), *example_shape), names)


# ---- predictions out ---------------------------------------------------------------------
def format_predictions(values: np.ndarray, kind: str, fmt: str, names: list[str] | None = None) -> str:
    """``values``: class indices ``[n]`` (``kind`` "classes"), or rows ``[n, k]``
    ("probabilities" or "values"), as CSV with a header or as a JSON object."""
    if fmt == "json":
        record = {"files": names} if names else {}
        record[{"classes": "predictions"}.get(kind, kind)] = values.tolist()
        return json.dumps(record) + "\n"
    out = io.StringIO()
    if kind == "classes":
        header, rows = ["prediction"], [[str(int(v))] for v in values]
    else:
        prefix = "p" if kind == "probabilities" else "y"
        header = [f"{prefix}{j}" for j in range(values.shape[1])]
        rows = [[format(float(v), ".9g") for v in row] for row in values]  # float32 round-trips in 9 digits
    if names:
        header, rows = ["file", *header], [[_csv_cell(n), *row] for n, row in zip(names, rows)]
    out.write(",".join(header) + "\n")
    for row in rows:
        out.write(",".join(row) + "\n")
    return out.getvalue()


def _csv_cell(text: str) -> str:
    return '"' + text.replace('"', '""') + '"' if any(c in text for c in ',"\n') else text


def predictions(model, features: np.ndarray, proba: bool, source, batch_size: int = 1024) -> tuple[np.ndarray, str]:
    """``(values, kind)`` by ``Model.predict``'s rule: a classifier's class indices ("classes"),
    or with ``proba`` its ``predict_proba`` ("probabilities"); a regressor's values ("values")."""
    try:
        # With --proba, predict on one example only says whether the model is a classifier.
        values = model.predict(features[:1] if proba else features, batch_size)
        if isinstance(values, list):
            raise DataError(f"dl4py predict takes a model with one output; this graph has {len(values)} "
                            "(use model.predict in Python: one array per output)")
        is_classifier = values.dtype.kind in "iu"  # predict gives int64 class indices, float values
        if proba and not is_classifier:
            raise DataError("--proba needs a classifier; this model's output is a regression (values)")
        if proba:
            return model.predict_proba(features, batch_size), "probabilities"
    except DataError as exc:
        raise DataError(f"{source}: {exc}") from None
    return values, "classes" if is_classifier else "values"
