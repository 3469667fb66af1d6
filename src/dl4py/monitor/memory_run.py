"""An ``InMemoryStatsStorage`` as the live page sees a run (``UIServer.attach``), beside ``RunFolder``.

Its ``records`` list plays the part of ``metrics.jsonl``: a poll's offset is a record's
index instead of a byte's, and each record is read as the JSON line a ``FileStatsStorage``
would have written for it, through the same reader (``runs.take_records``). So the same
bounds hold: a record over ``MAX_LINE_BYTES`` is skipped and named, one poll reads about
``MAX_READ_BYTES`` of records, each kind is thinned to ``SERIES_POINTS``, and a NaN
becomes null. Training appends to the list while the server reads it: a record is read
once it is in the list, and records are never changed after.

    run = MemoryRun(storage, "in-memory 1")
    chunk = run.metrics(offset=0)          # chunk.offset: the index of the next record to read
"""

from __future__ import annotations

import json
from itertools import islice

from dl4py.monitor.bounded import MAX_LINE_BYTES, SERIES_POINTS
from dl4py.monitor.runs import MAX_READ_BYTES, MetricsChunk, take_records
from dl4py.monitor.storage import InMemoryStatsStorage

PENDING, IN_MEMORY = "pending", "in memory"  # the run table's status: no record yet, records


class MemoryRun:
    """``storage``'s records, served as a run named ``name``; ``key`` tells it from the run that
    had its place on the page before (a detach, an attach)."""

    def __init__(self, storage: InMemoryStatsStorage, name: str, key: str):
        self.storage, self.name, self.key = storage, name, key
        self.label = None

    def metrics(self, offset: int = 0, max_bytes: int | None = MAX_READ_BYTES,
                points: int = SERIES_POINTS) -> MetricsChunk:
        """The records from index ``offset`` on, bounded as ``runs.read_metrics`` bounds a file."""
        records = self.storage.records
        count = len(records)  # the ones appended while this poll reads wait for the next
        reset = offset > count  # the list was emptied or replaced: start over
        start = 0 if reset else offset
        chunk = MetricsChunk(offset=start, reset=reset, source="records in memory")
        taken, _, full = take_records(_as_lines(islice(records, start, count)), chunk, max_bytes, points)
        chunk.offset = start + taken
        chunk.more = full and chunk.offset < count
        chunk.skipped = [(start + number, length) for number, length in chunk.skipped]
        return chunk

    def info(self) -> dict:
        """What the run table shows: no result, config or environment files (the "static"
        record tells the model and the environment)."""
        return {"name": self.name, "label": None, "status": IN_MEMORY if self.storage.records else PENDING,
                "result": {}, "environment": None, "model": None, "config": None, "notes": []}


def _as_lines(records):
    """``(line, length)`` as ``bounded.whole_lines`` yields them: each record's JSON line, or
    None for one over ``MAX_LINE_BYTES``. A value JSON has no form for (a NumPy number a
    user's own record holds) is written as its text, as the page would show it."""
    for record in records:
        line = (json.dumps(record, default=str) + "\n").encode("utf-8")
        yield (None if len(line) > MAX_LINE_BYTES else line), len(line)
