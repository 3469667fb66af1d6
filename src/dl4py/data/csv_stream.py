"""One CSV file of a streamed table, read by pandas in chunks of rows, each mistake named by
its file, line and column.

pandas reads every column strictly: a row with more fields than the header stops it (with
``usecols`` it would drop them silently), a row with fewer gets NaN, which the chunk's
finite check finds. pandas cannot say which line, field or text is at fault, so the file is
read again with the csv module for that, only once something is wrong: a good chunk costs
what pandas alone costs.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import itertools
import math
from pathlib import Path
from typing import Iterator

from dl4py.data.columns import Explain, optional_import, split_columns
from dl4py.errors import DataError

__all__ = ["csv_header", "csv_frames"]


def csv_header(path: Path) -> list[str]:
    """The column names of a CSV file's header line, as pandas names them."""
    pd = optional_import("pandas", "data", "reading CSV files in chunks")
    try:
        return [str(c) for c in pd.read_csv(path, nrows=0).columns]
    except pd.errors.EmptyDataError:
        raise DataError(f"{path}: empty file; a streamed CSV file starts with a header line") from None


def csv_frames(path: Path, columns: list[str], chunk_rows: int) -> Iterator[tuple[object, Explain]]:
    """``(frame, explain)`` per chunk of ``chunk_rows`` rows; ``explain(row, column)`` words the
    bad cell at position ``row`` of that frame as a one-line message naming its line."""
    pd = optional_import("pandas", "data", "reading CSV files in chunks")
    header = csv_header(path)
    split_columns(header, None, columns, str(path))  # every file must have every column
    first = 0  # the file's data row (0-based, blank lines not counted) of the chunk's first row
    try:
        for frame in pd.read_csv(path, chunksize=chunk_rows):
            explain = functools.partial(_explain_cell, path, header, first)
            if not isinstance(frame.index, pd.RangeIndex):
                # pandas took the first data row's extra leading fields for an index
                raise DataError(_first_ragged_row(path, header) or explain(0, None))
            yield frame, explain
            first += len(frame)
    except pd.errors.ParserError as exc:  # a row with more fields than the header, or a broken quote
        reason = " ".join(str(exc).split())
        raise DataError(_first_ragged_row(path, header) or f"{path}: cannot be read as CSV: {reason}") from None


def _explain_cell(path: Path, header: list[str], first: int, row: int, column: str | None) -> str:
    number = first + row
    with contextlib.closing(_data_rows(path)) as rows:
        found = next(itertools.islice(rows, number, None), None)
    if found is None:  # the file changed, or the csv module splits it unlike pandas
        return f"{path}: data row {number + 1}, column {column!r}: not a finite number"
    line, fields = found
    if len(fields) != len(header):
        return _ragged(path, line, fields, header)
    if column is None:
        return f"{path}: line {line} does not fit the header's {len(header)} fields"
    return f"{path}: line {line}, column {column!r}: {_problem(fields[header.index(column)])}"


def _first_ragged_row(path: Path, header: list[str]) -> str | None:
    for line, fields in _data_rows(path):
        if len(fields) != len(header):
            return _ragged(path, line, fields, header)
    return None


def _ragged(path: Path, line: int, fields: list[str], header: list[str]) -> str:
    return f"{path}: line {line} has {len(fields)} fields, the header has {len(header)}"


def _problem(cell: str) -> str:
    if not cell.strip():
        return "the field is empty"
    try:
        value = float(cell)
    except ValueError:
        return f"{cell!r} is not a number"
    return f"{cell!r} is not a finite number" if not math.isfinite(value) else f"{cell!r} did not read as a number"


def _data_rows(path: Path) -> Iterator[tuple[int, list[str]]]:
    """``(line, fields)`` of each data row, ``line`` the one it starts on (a quoted field may
    span lines); blank lines are skipped, as pandas skips them."""
    try:
        with open(path, newline="", encoding="utf-8-sig", errors="replace") as f:
            reader = csv.reader(f)
            end, header_seen = 0, False
            for fields in reader:
                start, end = end + 1, reader.line_num
                if not fields or (len(fields) == 1 and not fields[0].strip()):
                    continue
                if header_seen:
                    yield start, fields
                header_seen = True
    except csv.Error:  # a field past csv's size limit: the caller's plainer message stands
        return
