"""Where training statistics go (DL4J's ``StatsStorage``): a JSON-lines file or memory.

    storage = FileStatsStorage("runs/lenet/metrics.jsonl")
    model.fit(train, epochs=2, listeners=[StatsListener(storage)])

Every record is a plain JSON-able dict whose ``kind`` says what it is ("static", "stats",
"epoch", "iteration", "evaluation", ...). A storage stamps each record with ``time``:
seconds since the run began. ``FileStatsStorage`` is the one writer of ``metrics.jsonl``
(``MetricsLogger`` writes through it too): appended to the file of a resumed run, its
``time`` goes on from the file's last record. It opens the file for each record and closes
it at once, so no file stays open between records, after a fit or after a write of one's
own, and two writers of one file never hold half-written lines.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from dl4py.errors import StorageError


class StatsStorage:
    """The storage interface ``StatsListener`` writes to. A subclass overrides what it keeps:
    ``put_static`` (the model and environment, at each fit's start), ``put_update`` (a
    "stats" record every few iterations), ``put_epoch`` (an "epoch" record), ``put`` (a
    record of any other kind, e.g. "evaluation"; the typed ones come here by default).
    ``start`` runs at each fit's start (the first starts the clock of ``time``), ``flush``
    at each fit's end; ``close`` is the owner's to call when the run is over."""

    def put(self, record: dict) -> None:
        """A record of any kind. Storages that keep everything (a file, memory) keep it;
        others may ignore kinds they have no place for."""

    def put_static(self, record: dict) -> None:
        self.put(record)

    def put_update(self, record: dict) -> None:
        self.put(record)

    def put_epoch(self, record: dict) -> None:
        self.put(record)

    def start(self) -> None:
        """A fit begins."""

    def flush(self) -> None:
        """A fit ended: whatever is buffered should reach its destination now."""

    def close(self) -> None:
        """The run is over: release files, connections, writers."""

    def put_any(self, record: dict) -> None:
        """``record`` to the method its ``kind`` names."""
        kind = record.get("kind")
        if kind == "static":
            self.put_static(record)
        elif kind == "stats":
            self.put_update(record)
        elif kind == "epoch":
            self.put_epoch(record)
        else:
            self.put(record)


class _RunClock:
    """Seconds since the run began; ``offset``: the seconds it ran before (a resumed run)."""

    def __init__(self):
        self._t0: float | None = None

    def start(self, offset: float = 0.0) -> None:
        if self._t0 is None:
            self._t0 = time.time() - offset

    def stamp(self, record: dict, offset=lambda: 0.0) -> dict:
        """``record`` with ``time`` first (kept when it has one)."""
        if "time" in record:
            return record
        if self._t0 is None:
            self.start(offset())
        return {"time": round(time.time() - self._t0, 3), **record}


class FileStatsStorage(StatsStorage):
    """Appends each record as one JSON line to ``path`` (a run directory's ``metrics.jsonl``).
    Numbers that are not finite (a diverged loss) are written as null: the file stays
    strict JSON, which browsers and other tools parse."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._clock = _RunClock()

    def start(self) -> None:
        self._clock.start(last_time(self.path))

    def put(self, record: dict) -> None:
        record = self._clock.stamp(record, lambda: last_time(self.path))
        line = json.dumps(_finite(record), allow_nan=False) + "\n"
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # One write of the whole line in append mode: a reader (or a second writer) never
            # sees half a record, and the file is closed again before the next step.
            with self.path.open("a", encoding="utf-8") as f:
                f.write(line)
        except OSError as exc:  # disk full, read-only: a sentence naming the file
            raise StorageError("append to", self.path, exc) from exc

    def __repr__(self) -> str:
        return f"FileStatsStorage({str(self.path)!r})"


class InMemoryStatsStorage(StatsStorage):
    """Keeps every record in ``records``, in order (DL4J's name); ``static``, ``updates`` and
    ``epochs`` are the records of each kind. For tests, notebooks and one's own charts."""

    def __init__(self):
        self.records: list[dict] = []
        self._clock = _RunClock()

    def start(self) -> None:
        self._clock.start()

    def put(self, record: dict) -> None:
        self.records.append(self._clock.stamp(dict(record)))

    @property
    def static(self) -> list[dict]:
        return self.of_kind("static")

    @property
    def updates(self) -> list[dict]:
        return self.of_kind("stats")

    @property
    def epochs(self) -> list[dict]:
        return self.of_kind("epoch")

    def of_kind(self, kind: str) -> list[dict]:
        return [r for r in self.records if r.get("kind") == kind]

    def __repr__(self) -> str:
        return f"InMemoryStatsStorage({len(self.records)} records)"


def last_time(path: Path) -> float:
    """The ``time`` of the last whole record in ``path`` (0 for a new file)."""
    for tail in (1 << 16, 1 << 22, None):  # records are short: the tail holds the last one
        try:
            with open(path, "rb") as f:
                f.seek(0, 2)
                size = f.tell()
                f.seek(0 if tail is None else max(0, size - tail))
                lines = f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            return 0.0
        for line in reversed(lines):
            try:
                value = json.loads(line).get("time")
            except (ValueError, AttributeError):
                continue  # a torn last line (a crash mid-write), or a partial first one
            if isinstance(value, (int, float)):
                return float(value)
        if tail is None or size <= tail:
            return 0.0
    return 0.0


def _finite(value):
    """``value`` with every NaN or infinity (at any depth) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
