"""CsvDataSetIterator: a numeric CSV file read once into memory (DL4J's CSVRecordReader +
RecordReaderDataSetIterator in one object)."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from dl4py.data.columns import first_non_finite
from dl4py.data.iterators import ArrayDataSetIterator, _int, _non_negative_int, _positive_int
from dl4py.errors import DataError

__all__ = ["CsvDataSetIterator"]


class CsvDataSetIterator(ArrayDataSetIterator):
    """Rows of numbers; column ``label_index`` is the label, all others are float32 features.

    With ``num_classes`` the label must be an integer in ``[0, num_classes)`` (int64
    class indices); without it the label is a float regression target ``[n, 1]``.
    ``skip_lines`` skips a header; blank lines are ignored. Errors name the file, the
    1-based line (counting skipped lines) and the 1-based column.

    >>> it = CsvDataSetIterator("iris.csv", batch_size=32, num_classes=3)  # doctest: +SKIP
    """

    def __init__(
        self,
        path,
        batch_size: int,
        label_index: int = -1,
        num_classes: int | None = None,
        skip_lines: int = 0,
        delimiter: str = ",",
        shuffle: bool = True,
        seed: int = 0,
        limit: int | None = None,
        drop_last: bool = False,
    ):
        self.path = Path(path)
        self._source = str(self.path)
        skip_lines = _non_negative_int(skip_lines, "skip_lines")
        if not isinstance(delimiter, str) or not delimiter:
            raise ValueError(f"delimiter must be a non-empty str, got {delimiter!r}")
        if num_classes is not None:
            num_classes = _positive_int(num_classes, "num_classes")

        table = _read_table(self.path, skip_lines, delimiter)
        _check_finite(table, self.path, skip_lines)
        label_index = _int(label_index, "label_index")
        n_cols = table.shape[1]
        if n_cols < 2:
            raise DataError(f"{self.path}: {n_cols} column; need at least one feature column and the label")
        if not -n_cols <= label_index < n_cols:
            raise ValueError(f"label_index={label_index} is out of range for {self.path}'s {n_cols} columns")
        col = label_index % n_cols
        raw_labels = table[:, col]
        features = np.delete(table, col, axis=1).astype(np.float32)

        if num_classes is None:
            labels = raw_labels.astype(np.float32).reshape(-1, 1)
        else:
            bad = (raw_labels != np.round(raw_labels)) | (raw_labels < 0) | (raw_labels >= num_classes)
            if bad.any():
                row = int(np.argmax(bad))
                line = _data_lines(self.path, skip_lines)[row]
                raise DataError(
                    f"{self.path}: line {line}, column {col + 1}: label {raw_labels[row]:g} is not an "
                    f"integer in [0, {num_classes})"
                )
            labels = raw_labels.astype(np.int64)

        self.label_index = label_index
        self._label_column, self._skip_lines = col, skip_lines
        super().__init__(
            features, labels, batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last,
            limit=limit, num_classes=num_classes,
        )


    def locate(self, index: int) -> str:
        # Line numbers are found only now, for a message: loading stays one fast read.
        line = _data_lines(self.path, self._skip_lines)[index]
        return f"{self.path}: line {line}, column {self._label_column + 1}"


def _read_table(path: Path, skip_lines: int, delimiter: str) -> np.ndarray:
    if not path.is_file():
        raise DataError(f"{path}: no such file" if not path.exists() else f"{path}: not a file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the empty-file warning becomes our own error below
            table = np.loadtxt(
                path, delimiter=delimiter, skiprows=skip_lines, comments=None, ndmin=2,
                dtype=np.float64, encoding="utf-8-sig",
            )
    except (ValueError, UnicodeDecodeError) as e:
        # numpy's message counts rows its own way; find the exact line and column ourselves.
        _raise_first_bad_cell(path, skip_lines, delimiter)
        raise DataError(f"{path}: cannot be read as numeric CSV: {e}") from None
    if table.shape[0] == 0:
        raise DataError(f"{path}: no data rows (empty file, or all {skip_lines} lines skipped)")
    return table


def _check_finite(table: np.ndarray, path: Path, skip_lines: int) -> None:
    """numpy reads "nan" and "inf" as numbers; training on them would only end in a NaN loss."""
    bad = first_non_finite(table)
    if bad is not None:
        row, col = bad
        line = _data_lines(path, skip_lines)[row]
        raise DataError(f"{path}: line {line}, column {col + 1}: {table[row, col]:g} is not a finite number")


def _raise_first_bad_cell(path: Path, skip_lines: int, delimiter: str) -> None:
    """Scan the file slowly (only after a failed fast read) and report its first bad cell."""
    width = None
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        for line_no, line in enumerate(f, 1):
            if line_no <= skip_lines or not line.strip():
                continue
            cells = line.rstrip("\r\n").split(delimiter)
            if width is None:
                width = len(cells)
            elif len(cells) != width:
                raise DataError(
                    f"{path}: line {line_no}: {len(cells)} columns, expected {width} as in the first data row"
                )
            for col, cell in enumerate(cells, 1):
                try:
                    float(cell)
                except ValueError:
                    raise DataError(
                        f"{path}: line {line_no}, column {col}: {cell.strip()!r} is not a number"
                    ) from None


def _data_lines(path: Path, skip_lines: int) -> list[int]:
    """1-based line number of each data row (skipped and blank lines excluded)."""
    with open(path, encoding="utf-8-sig") as f:
        return [i for i, line in enumerate(f, 1) if i > skip_lines and line.strip()]
