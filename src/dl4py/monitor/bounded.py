"""Reading a run's files in bounded memory, whatever they hold (for ``dl4py ui`` and ``dl4py report``).

- ``whole_lines``: a JSON-lines file line by line in reads of at most ``MAX_LINE_BYTES``; a
  longer line is stepped over in small reads and reported as skipped, never held whole;
- ``Series``: at most ``points`` records of one kind out of any number, evenly spread and the
  last one kept, within a byte budget: a 200 MB ``metrics.jsonl`` costs what 2,000 records cost;
- ``read_capped``: a small file (``result.json``, ``config.yaml``) whole, or nothing when it
  is over its limit, with a note saying so.

    series = Series(points=2000)
    for line, length in whole_lines(f):
        ...                                  # line is None: over MAX_LINE_BYTES, skipped
"""

from __future__ import annotations

from pathlib import Path

# A metrics record is a few kilobytes (a stats record of a 1,000-layer model about 200 KB);
# a longer line is not a record the page can draw.
MAX_LINE_BYTES = 1 << 20
# result.json, environment.json, sweep.json, outcomes.json: kilobytes in practice.
MAX_FILE_BYTES = 16 << 20
# config.yaml is sent to the page with every poll, as text.
MAX_TEXT_BYTES = 1 << 20
# Per series (one kind of record of one run): what a chart needs, and what a page can hold.
SERIES_POINTS = 2000
SERIES_BYTES = 8 << 20
_STEP = 1 << 16  # the reads that step over a skipped line


def whole_lines(f, max_line: int = MAX_LINE_BYTES):
    """``(line, length)`` for each whole line of binary file ``f`` from where it stands;
    ``line`` is None for a line over ``max_line`` bytes, which is read past in small pieces.
    A last line with no newline yet (a writer mid-line) is left for the next read."""
    while True:
        line = f.readline(max_line + 1)
        if line.endswith(b"\n"):
            yield line, len(line)
            continue
        if len(line) <= max_line:  # the end of the file, maybe inside a torn last line
            return
        length = len(line)
        while True:
            piece = f.readline(_STEP)
            if not piece:  # an over-long line still being written: wait for its end
                return
            length += len(piece)
            if piece.endswith(b"\n"):
                break
        yield None, length


def lines_before(path: Path, offset: int) -> int:
    """How many lines end before byte ``offset`` of ``path`` (counted in small reads)."""
    count = 0
    with open(path, "rb") as f:
        while offset > 0:
            data = f.read(min(offset, _STEP * 16))
            if not data:
                break
            count += data.count(b"\n")
            offset -= len(data)
    return count


class Series:
    """At most ``points`` of a stream of records, every ``stride``-th from the first, and the
    last one always; ``seen`` counts them all. Whenever the kept ones reach ``points`` or
    ``budget`` bytes of their lines, every other one goes and the stride doubles, so memory
    stays bounded however long the stream. ``points`` of 1: the last record alone."""

    def __init__(self, points: int = SERIES_POINTS, budget: int = SERIES_BYTES):
        self.points, self.budget = points, budget
        self.seen = 0
        self.stride = 1
        self._kept: list[tuple[int, dict, int]] = []  # (order, record, its line's bytes)
        self._bytes = 0
        self._last: tuple[int, dict] | None = None

    def add(self, order: int, record: dict, size: int) -> None:
        """``record``, the ``order``-th line of its file, whose line was ``size`` bytes."""
        index = self.seen
        self.seen += 1
        self._last = (order, record)
        if self.points < 2 or index % self.stride:
            return
        self._kept.append((order, record, size))
        self._bytes += size
        while len(self._kept) > 1 and (len(self._kept) >= self.points or self._bytes > self.budget):
            self._kept = self._kept[::2]  # indices 0, 2*stride, 4*stride, ...: the new stride's
            self.stride *= 2
            self._bytes = sum(size for _, _, size in self._kept)

    def kept(self) -> list[tuple[int, dict]]:
        """``(order, record)`` of the records kept, in order, the last one included."""
        kept = [(order, record) for order, record, _ in self._kept]
        if self._last is not None and (not kept or kept[-1][0] != self._last[0]):
            kept.append(self._last)
        return kept


def read_capped(path: Path, limit: int, notes: dict[str, str] | None = None) -> bytes | None:
    """The bytes of ``path``, or None when it is missing or over ``limit`` bytes (then
    ``notes[path.name]`` says so). Never reads more than ``limit`` + 1 bytes."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
            if len(data) > limit:
                size = f.seek(0, 2)
                if notes is not None:
                    notes[path.name] = f"{path.name} is {size_text(size)}, over the {size_text(limit)} " \
                                       "the page reads: left out"
                return None
    except OSError:
        return None
    return data


def size_text(size: int) -> str:
    """``157286400`` -> ``"150.0 MiB"``."""
    if size < 1024:
        return f"{size} bytes"
    return f"{size / 1024:.1f} KiB" if size < 1 << 20 else f"{size / (1 << 20):.1f} MiB"
