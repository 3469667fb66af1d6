"""Run directories and sweep folders read as plain JSON-able data for ``dl4py ui`` and ``dl4py report``.

Nothing here writes: the page shows the files training writes (no second store).
``metrics.jsonl`` is read from a byte offset, so a page polling a long run gets only the
lines added since its last poll; a torn last line (a run still writing it) waits for its
newline, and records of kinds the page does not draw are left out. Whatever the files
hold, memory stays bounded (``bounded.py``): a line over ``MAX_LINE_BYTES`` is skipped and
named, each kind of record is thinned to ``SERIES_POINTS`` evenly spread ones (the last
kept), and the small files are read only up to their limits.

    folder = RunFolder(Path("runs/lenet"))
    chunk = folder.metrics(offset=0)       # chunk.records, chunk.offset for the next poll
    info = folder.info()                   # status, result, environment, model summary, config
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from dl4py.config import RunConfig
from dl4py.errors import ConfigError
from dl4py.folders import LOCK_FILE
from dl4py.monitor.bounded import (MAX_FILE_BYTES, MAX_LINE_BYTES, MAX_TEXT_BYTES, SERIES_POINTS, Series,
                                   lines_before, read_capped, size_text, whole_lines)
from dl4py.nn.summary import summary_table
from dl4py.sweep import results as sweep_results
from dl4py.sweep.plan import Plan, short_keys
from dl4py.sweep.runner import OUTCOMES

log = logging.getLogger("dl4py")

# The kinds the page draws (see the contract of metrics.jsonl in docs/monitoring.md).
KINDS = frozenset({"static", "stats", "epoch", "iteration", "evaluation"})
# The page shows the last of these alone; the others are series, thinned to SERIES_POINTS.
LAST_ONLY = frozenset({"static", "evaluation"})
# One poll reads at most this much of a file (whole lines), so a page opened on a long run
# fills in over a few quick polls instead of one long one.
MAX_READ_BYTES = 4 << 20
STATIC_SEARCH_BYTES = 1 << 16
METRICS = "metrics.jsonl"
RUN_FILES = (METRICS, "result.json", "config.yaml", "environment.json")
SWEEP_FILE = "sweep.json"
# result.json's per-epoch copies are in metrics.jsonl already; the page needs the figures.
_RESULT_LEFT_OUT = frozenset({"history", "epoch_summaries"})
_SKIPPED_NAMED = 3  # over-long lines named one by one; the rest are counted
# NaN and infinities (a diverged loss) become null: the browser's JSON has neither. One
# decoder for every line: json.loads(..., parse_constant=) builds one per call, half the cost.
_DECODER = json.JSONDecoder(parse_constant=lambda name: None)


@dataclass
class MetricsChunk:
    records: list[dict] = field(default_factory=list)
    offset: int = 0  # where the next read starts: just after the last whole line read
    reset: bool = False  # the file is shorter than the offset asked for: it was replaced, start over
    more: bool = False  # more whole lines wait past MAX_READ_BYTES: poll again at once
    seen: dict[str, int] = field(default_factory=dict)  # records read of each series kind, kept or not
    skipped: list[tuple[int, int]] = field(default_factory=list)  # (line number, bytes), the first few
    skipped_count: int = 0  # lines over MAX_LINE_BYTES, all of them
    source: str = METRICS  # what the skipped lines are lines of, for the note

    def skip_note(self, where: str) -> str | None:
        """One sentence naming the skipped lines of file ``where``, or None."""
        if not self.skipped_count:
            return None
        named = ", ".join(f"line {line} ({size_text(size)})" for line, size in self.skipped)
        others = self.skipped_count - len(self.skipped)
        return (f"{where}: {named}{f' and {others} more lines' if others else ''} over the "
                f"{size_text(MAX_LINE_BYTES)} a record may be: skipped")

    def to_dict(self) -> dict:
        note = self.skip_note(self.source)
        return {"records": self.records, "offset": self.offset, "reset": self.reset, "more": self.more,
                "seen": self.seen, "notes": [note] if note else []}


def read_metrics(path: Path, offset: int = 0, max_bytes: int | None = MAX_READ_BYTES,
                 points: int = SERIES_POINTS) -> MetricsChunk:
    """The whole records of ``path`` from byte ``offset`` on (none if it does not exist yet),
    read in small pieces: lines up to about ``max_bytes`` (None: to the end), at most
    ``points`` records of each series kind (evenly spread, the last one kept) and the last
    ``static`` and ``evaluation`` records."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return MetricsChunk(offset=0, reset=offset > 0)
    with f:
        size = os.fstat(f.fileno()).st_size
        reset = size < offset
        start = 0 if reset else offset
        f.seek(start)
        chunk = MetricsChunk(offset=start, reset=reset)
        _, read, full = take_records(whole_lines(f), chunk, max_bytes, points)
        chunk.offset = start + read
        chunk.more = full and chunk.offset < size
    if chunk.skipped:
        before = lines_before(path, start)
        chunk.skipped = [(before + line, length) for line, length in chunk.skipped]
    return chunk


def take_records(lines, chunk: MetricsChunk, max_bytes: int | None = MAX_READ_BYTES,
                 points: int = SERIES_POINTS) -> tuple[int, int, bool]:
    """Fill ``chunk``'s records, ``seen`` and skipped lines from ``(line, length)`` pairs
    (``whole_lines``: line None for one over ``MAX_LINE_BYTES``), each series kind thinned
    to ``points``, until about ``max_bytes`` were read (None: all of them). The skipped
    lines are numbered from 1 at the first pair. Returns the lines taken, their bytes, and
    whether ``max_bytes`` stopped the reading."""
    series = {kind: Series(1 if kind in LAST_ONLY else points) for kind in KINDS}
    taken = read = 0
    full = False
    for order, (line, length) in enumerate(lines):
        taken += 1
        read += length
        if line is None:
            chunk.skipped_count += 1
            if len(chunk.skipped) < _SKIPPED_NAMED:
                chunk.skipped.append((order + 1, length))
        elif (record := _parse_line(line)) is not None:
            series[record["kind"]].add(order, record, length)
        if max_bytes is not None and read >= max_bytes:
            full = True
            break
    chunk.records = [record for _, record in sorted((kept for s in series.values() for kept in s.kept()),
                                                    key=lambda kept: kept[0])]  # file order
    chunk.seen = {kind: s.seen for kind, s in series.items() if kind not in LAST_ONLY}
    return taken, read, full


def _parse_line(line: bytes) -> dict | None:
    try:
        record = _DECODER.decode(line.decode("utf-8"))
    except ValueError:  # a line torn by a crash, then appended to by --resume; not UTF-8
        return None
    if not isinstance(record, dict) or record.get("kind") not in KINDS:
        return None
    record.pop("histograms", None)  # the page draws none (TensorBoard and W&B do): its polls stay small
    return record


def read_json(path: Path, notes: dict[str, str] | None = None) -> dict | None:
    """A JSON object file, or None when it is missing, half-written, not an object or over
    ``MAX_FILE_BYTES`` (then a note joins ``notes``)."""
    data = read_capped(path, MAX_FILE_BYTES, notes)
    try:
        value = _DECODER.decode(data.decode("utf-8")) if data is not None else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and any((path / name).is_file() for name in RUN_FILES)


def is_sweep_dir(path: Path) -> bool:
    return (path / SWEEP_FILE).is_file()


class RunFolder:
    """One run directory as the page sees it. The model summary is worked out once."""

    def __init__(self, path: Path, name: str | None = None, label: str | None = None,
                 metrics_path: Path | None = None):
        self.path = Path(path)
        self.name = name or self.path.name
        self.label = label  # a sweep's experiment: its swept values
        # A FileStatsStorage attached to the UI may write a file of another name.
        self.metrics_path = Path(metrics_path) if metrics_path is not None else self.path / METRICS
        self.key = str(self.metrics_path)  # which run the page holds at a place in its list
        self._model: dict | None = None
        # What was logged already: each poll (and a reload) reads the same files again.
        self._told_files: set[str] = set()
        self._told_line = 0

    def metrics(self, offset: int = 0, max_bytes: int | None = MAX_READ_BYTES,
                points: int = SERIES_POINTS) -> MetricsChunk:
        """``metrics.jsonl`` from ``offset`` (``read_metrics``); skipped lines are logged once."""
        chunk = read_metrics(self.metrics_path, offset, max_bytes, points)
        if chunk.skipped and chunk.skipped[-1][0] > self._told_line:
            log.warning("dl4py: %s", chunk.skip_note(str(self.metrics_path)))
            self._told_line = chunk.skipped[-1][0]
        return chunk

    def info(self) -> dict:
        """What the page shows beside the metrics: status, result figures, environment, model,
        config, and ``notes``: the files left out for their size."""
        notes: dict[str, str] = {}
        result = read_json(self.path / "result.json", notes)
        environment = read_json(self.path / "environment.json", notes)
        config = _read_text(self.path / "config.yaml", notes)
        for name, note in notes.items():
            if name not in self._told_files:
                log.warning("dl4py: %s: %s", self.path, note)
                self._told_files.add(name)
        return {
            "name": self.name, "label": self.label, "status": self._status(result),
            "result": {k: v for k, v in (result or {}).items() if k not in _RESULT_LEFT_OUT},
            "environment": environment, "model": self._model_summary(config is not None), "config": config,
            "notes": list(notes.values()),
        }

    def _status(self, result: dict | None) -> str:
        """result.json's status, written when a run ends however it ends; "running" before
        that, and again once a resumed run appends to metrics.jsonl after it."""
        metrics = _mtime(self.metrics_path)
        if result is None or not isinstance(result.get("status"), str):
            return "running" if metrics is not None else ("starting" if self.path.is_dir() else "pending")
        ended = _mtime(self.path / "result.json")
        return "running" if metrics is not None and ended is not None and metrics > ended else result["status"]

    def _model_summary(self, config_readable: bool) -> dict | None:
        """The summary table from ``config.yaml``, for a run whose metrics have no StatsListener
        ``static`` record (which tells it too, a TorchModel's included, and wins on the page).
        Building the table the first time costs torch a second; the record costs nothing."""
        if self._model is None and self._has_static_record():
            self._model = {}
        if self._model is None and config_readable:
            try:
                table, parameters = summary_table(RunConfig.from_file(self.path / "config.yaml").network)
                self._model = {"summary": table, "parameters": parameters}
            except Exception:  # a config this version cannot build: the page shows the config text
                self._model = {}
        return self._model or None

    def _has_static_record(self) -> bool:
        """Whether metrics.jsonl starts with a ``static`` record (written at fit start, so the
        first lines hold it)."""
        chunk = read_metrics(self.metrics_path, 0, max_bytes=STATIC_SEARCH_BYTES)
        return any(record["kind"] == "static" for record in chunk.records)


def _mtime(path: Path) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def _read_text(path: Path, notes: dict[str, str]) -> str | None:
    data = read_capped(path, MAX_TEXT_BYTES, notes)
    try:
        return data.decode("utf-8") if data is not None else None
    except UnicodeDecodeError:
        return None


class SweepFolder:
    """A sweep folder: its plan, the ranked table as ``results.csv`` has it, one RunFolder per experiment."""

    def __init__(self, path: Path):
        self.path = Path(path)
        too_big: dict[str, str] = {}
        data = read_json(self.path / SWEEP_FILE, too_big)
        try:
            self.plan = Plan.from_dict(data)
        except (TypeError, KeyError, ValueError, AttributeError):
            why = f" ({too_big[SWEEP_FILE]})" if too_big else ""
            raise ConfigError(str(self.path / SWEEP_FILE), f"cannot be read as a sweep plan{why}") from None
        short = short_keys(self.plan.keys)
        self.runs = [RunFolder(self.path / e.name, e.name, e.label(short)) for e in self.plan.experiments]

    def info(self) -> dict:
        metric = self.plan.metric
        outcomes = read_json(self.path / OUTCOMES) or {}
        rows = sweep_results.collect_rows(self.plan, self.path, outcomes, metric)
        extra = {}  # every rankable figure the runs have, so any of them can sort the table
        for row in rows:
            result = read_json(self.path / row["experiment"] / "result.json") or {}
            extra[row["experiment"]] = {k: result.get(k) for k in sweep_results.METRICS
                                        if k != metric and _is_number(result.get(k))}
        columns = [m for m in sweep_results.METRICS if m != metric and any(m in e for e in extra.values())]
        labels = {run.name: run.label for run in self.runs}
        return {
            "name": self.path.name, "metric": metric,
            "higher_is_better": sweep_results.METRICS[metric], "keys": self.plan.keys, "columns": columns,
            "rows": [{**row, **extra[row["experiment"]], "label": labels.get(row["experiment"]),
                      "values": {k: _value(row[k]) for k in self.plan.keys}} for row in rows],
        }


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _value(text):
    """A swept value as a number when it reads as one (``0.02``, ``1.0e-05``), else its text."""
    try:
        value = yaml.safe_load(text) if isinstance(text, str) else text
    except yaml.YAMLError:
        return text
    if isinstance(value, str):
        try:
            value = float(value)  # PyYAML reads 1e-3 as text
        except ValueError:
            return text
    return value if _is_number(value) else text


def open_folders(paths: list[Path], waiting: bool = False) -> tuple[list[RunFolder], SweepFolder | None]:
    """The run directories named, or the one sweep folder; a path that is neither is a
    ConfigError naming it. ``waiting`` (the live UI): a path that does not exist yet, or an
    empty folder (but for the lock of the training that made it), is a run about to start
    (``dl4py train ... & dl4py ui RUN``), shown as pending until its files appear."""
    runs, sweeps = [], []
    for path in map(Path, paths):
        if waiting and (not path.exists() or (path.is_dir() and _holds_nothing(path))):
            runs.append(path)
            continue
        if not path.exists():
            raise ConfigError(str(path), "no such run directory or sweep folder")
        if is_sweep_dir(path):
            sweeps.append(SweepFolder(path))
        elif is_run_dir(path):
            runs.append(path)
        else:
            raise ConfigError(str(path), "is neither a run directory (no metrics.jsonl, result.json or config.yaml) "
                                         f"nor a sweep folder (no {SWEEP_FILE})")
    if sweeps and (runs or len(sweeps) > 1):
        raise ConfigError(str(sweeps[0].path), "is a sweep folder: show it alone (its runs are in it), "
                                               "or name run directories only")
    if sweeps:
        return sweeps[0].runs, sweeps[0]
    return [RunFolder(path, name) for path, name in zip(runs, _names(runs))], None


def _holds_nothing(folder: Path) -> bool:
    return all(entry.name == LOCK_FILE for entry in folder.iterdir())


def _names(paths: list[Path]) -> list[str]:
    """Each run's folder name; with the parent's too where two runs share a name."""
    names = [p.name or str(p) for p in paths]
    return [f"{p.resolve().parent.name}/{n}" if names.count(n) > 1 else n for p, n in zip(paths, names)]
