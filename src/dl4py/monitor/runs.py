"""Run directories and sweep folders read as plain JSON-able data for ``dl4py ui`` and ``dl4py report``.

Nothing here writes: the page shows the files training writes (no second store).
``metrics.jsonl`` is read from a byte offset, so a page polling a long run gets only the
lines added since its last poll; a torn last line (a run still writing it) waits for its
newline, and records of kinds the page does not draw are left out.

    folder = RunFolder(Path("runs/lenet"))
    chunk = folder.metrics(offset=0)       # chunk.records, chunk.offset for the next poll
    info = folder.info()                   # status, result, environment, model summary, config
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from dl4py.errors import ConfigError

# The kinds the page draws (see the contract of metrics.jsonl in docs/monitoring.md).
KINDS = frozenset({"static", "stats", "epoch", "iteration", "evaluation"})
# One poll reads at most this much of a file, so a page opened on a long run fills in over
# a few quick polls instead of one huge answer.
MAX_READ_BYTES = 4 << 20
STATIC_SEARCH_BYTES = 1 << 16
RUN_FILES = ("metrics.jsonl", "result.json", "config.yaml", "environment.json")
SWEEP_FILE = "sweep.json"
# result.json's per-epoch copies are in metrics.jsonl already; the page needs the figures.
_RESULT_LEFT_OUT = frozenset({"history", "epoch_summaries"})


@dataclass
class MetricsChunk:
    records: list[dict] = field(default_factory=list)
    offset: int = 0  # where the next read starts: just after the last whole line read
    reset: bool = False  # the file is shorter than the offset asked for: it was replaced, start over
    more: bool = False  # more whole lines wait past MAX_READ_BYTES: poll again at once

    def to_dict(self) -> dict:
        return {"records": self.records, "offset": self.offset, "reset": self.reset, "more": self.more}


def read_metrics(path: Path, offset: int = 0, max_bytes: int | None = MAX_READ_BYTES) -> MetricsChunk:
    """The whole records of ``path`` from byte ``offset`` on (none if it does not exist yet)."""
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return MetricsChunk(offset=0, reset=offset > 0)
    reset = size < offset
    start = 0 if reset else offset
    length = size - start if max_bytes is None else min(size - start, max_bytes)
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(length)
    cut = length < size - start  # the read stopped at max_bytes: more lines wait
    end = data.rfind(b"\n") + 1  # a torn last line waits for its newline
    if end == 0 and cut:  # one line longer than a read: take it whole
        with open(path, "rb") as f:
            f.seek(start)
            data = f.readline()
        end = len(data) if data.endswith(b"\n") else 0
    records = [r for r in map(_parse_line, data[:end].splitlines()) if r is not None]
    return MetricsChunk(records, start + end, reset, cut)


def _parse_line(line: bytes) -> dict | None:
    try:
        # NaN and infinities (a diverged loss) become null: the browser's JSON has neither.
        record = json.loads(line, parse_constant=lambda name: None)
    except ValueError:  # a line torn by a crash, then appended to by --resume
        return None
    return record if isinstance(record, dict) and record.get("kind") in KINDS else None


def read_json(path: Path) -> dict | None:
    """A JSON object file, or None when it is missing, half-written or not an object."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"), parse_constant=lambda name: None)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and any((path / name).is_file() for name in RUN_FILES)


def is_sweep_dir(path: Path) -> bool:
    return (path / SWEEP_FILE).is_file()


class RunFolder:
    """One run directory as the page sees it. The model summary is worked out once."""

    def __init__(self, path: Path, name: str | None = None, label: str | None = None):
        self.path = Path(path)
        self.name = name or self.path.name
        self.label = label  # a sweep's experiment: its swept values
        self._model: dict | None = None

    def metrics(self, offset: int = 0, max_bytes: int | None = MAX_READ_BYTES) -> MetricsChunk:
        return read_metrics(self.path / "metrics.jsonl", offset, max_bytes)

    def info(self) -> dict:
        """What the page shows beside the metrics: status, result figures, environment, model, config."""
        result = read_json(self.path / "result.json")
        return {
            "name": self.name, "label": self.label, "status": self._status(result),
            "result": {k: v for k, v in (result or {}).items() if k not in _RESULT_LEFT_OUT},
            "environment": read_json(self.path / "environment.json"),
            "model": self._model_summary(),
            "config": _read_text(self.path / "config.yaml"),
        }

    def _status(self, result: dict | None) -> str:
        """result.json's status, written when a run ends however it ends; "running" before
        that, and again once a resumed run appends to metrics.jsonl after it."""
        metrics = _mtime(self.path / "metrics.jsonl")
        if result is None or not isinstance(result.get("status"), str):
            return "running" if metrics is not None else ("starting" if self.path.is_dir() else "pending")
        ended = _mtime(self.path / "result.json")
        return "running" if metrics is not None and ended is not None and metrics > ended else result["status"]

    def _model_summary(self) -> dict | None:
        """The summary table from ``config.yaml``, for a run whose metrics have no StatsListener
        ``static`` record (which tells it too, a TorchModel's included, and wins on the page).
        Building the table the first time costs torch a second; the record costs nothing."""
        if self._model is None and self._has_static_record():
            self._model = {}
        if self._model is None and (self.path / "config.yaml").is_file():
            try:
                from dl4py.config import RunConfig
                from dl4py.nn.summary import summary_table

                table, parameters = summary_table(RunConfig.from_file(self.path / "config.yaml").network)
                self._model = {"summary": table, "parameters": parameters}
            except Exception:  # a config this version cannot build: the page shows the config text
                self._model = {}
        return self._model or None

    def _has_static_record(self) -> bool:
        """Whether metrics.jsonl starts with a ``static`` record (written at fit start, so the
        first lines hold it)."""
        chunk = read_metrics(self.path / "metrics.jsonl", 0, max_bytes=STATIC_SEARCH_BYTES)
        return any(record["kind"] == "static" for record in chunk.records)


def _mtime(path: Path) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


class SweepFolder:
    """A sweep folder: its plan, the ranked table as ``results.csv`` has it, one RunFolder per experiment."""

    def __init__(self, path: Path):
        from dl4py.sweep.plan import Plan

        self.path = Path(path)
        data = read_json(self.path / SWEEP_FILE)
        try:
            self.plan = Plan.from_dict(data)
        except (TypeError, KeyError, ValueError, AttributeError):
            raise ConfigError(str(self.path / SWEEP_FILE), "cannot be read as a sweep plan") from None
        short = _short_keys(self.plan.keys)
        self.runs = [RunFolder(self.path / e.name, e.name, e.label(short)) for e in self.plan.experiments]

    def info(self) -> dict:
        from dl4py.sweep import results as table
        from dl4py.sweep.runner import OUTCOMES

        metric = self.plan.metric
        outcomes = read_json(self.path / OUTCOMES) or {}
        rows = table.collect_rows(self.plan, self.path, outcomes, metric)
        extra = {}  # every rankable figure the runs have, so any of them can sort the table
        for row in rows:
            result = read_json(self.path / row["experiment"] / "result.json") or {}
            extra[row["experiment"]] = {k: result.get(k) for k in table.METRICS
                                        if k != metric and _is_number(result.get(k))}
        columns = [m for m in table.METRICS if m != metric and any(m in e for e in extra.values())]
        labels = {run.name: run.label for run in self.runs}
        return {
            "name": self.path.name, "metric": metric,
            "higher_is_better": table.METRICS[metric], "keys": self.plan.keys, "columns": columns,
            "rows": [{**row, **extra[row["experiment"]], "label": labels.get(row["experiment"]),
                      "values": {k: _value(row[k]) for k in self.plan.keys}} for row in rows],
        }


def _short_keys(keys: list[str]) -> dict:
    from dl4py.sweep.plan import short_keys

    return short_keys(keys)


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


def open_folders(paths: list[Path]) -> tuple[list[RunFolder], SweepFolder | None]:
    """The run directories named, or the one sweep folder; a path that is neither is a
    ConfigError naming it."""
    runs, sweeps = [], []
    for path in map(Path, paths):
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


def _names(paths: list[Path]) -> list[str]:
    """Each run's folder name; with the parent's too where two runs share a name."""
    names = [p.name or str(p) for p in paths]
    return [f"{p.resolve().parent.name}/{n}" if names.count(n) > 1 else n for p, n in zip(paths, names)]


def thin(records: list[dict], limit: int) -> list[dict]:
    """At most ``limit`` records, evenly spread, the last one kept (a report's long run)."""
    if len(records) <= limit:
        return records
    step = (len(records) - 1) / (limit - 1)
    return [records[round(i * step)] for i in range(limit)]
