"""A rank that does not arrive is named within ``timeout``: every rank's watchdog.

Each rank's watchdog thread publishes, every tick, where its rank is: the phase
(``phase.PHASE``), the collectives it has entered, since when neither changed, and a
heartbeat. The board is read by whoever judges: in a pool, a shared array the coordinator
reads (``SharedBoard``; it raises WorkerError and kills the workers); under torchrun, keys in
the rendezvous store that every rank's watchdog reads (``StoreBoard``). One rule judges
(``missing``): once a rank has waited at collective k for longer than ``timeout``, the rank
that has not entered k is named (the furthest behind, or one not heard from), with the
phase it is in. Under torchrun the rank that finds it writes the line to the store; every
rank prints it and exits with ``HANG_EXIT_CODE``, its child processes killed first.

torch's own timeout on the process group (``backstop``) is longer, so that the watchdog
speaks first: torch would raise in the waiting ranks without naming the missing one.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple

from dl4py.parallel.phase import PHASE, collectives_entered, describe

log = logging.getLogger("dl4py")

HANG_EXIT_CODE = 124  # as timeout(1): the process ended because a wait ran past its bound
MOST_SECONDS_PER_TICK = 1.0


class Record(NamedTuple):
    """One rank's entry on the board (numbers only: the pool's board is an array of them)."""

    collectives: int  # entered so far; -1: unknown
    phase: int  # index in phase.PHASES
    epoch: int  # -1: none
    round: int
    since: float  # wall clock: when the collectives or the phase last changed
    beat: float  # wall clock: when this was published


FIELDS = len(Record._fields)


@dataclass(frozen=True)
class Missing:
    rank: int
    reason: str  # "did not arrive at collective 12 within timeout=3 s: ...", without the rank's name


def missing(records: list[Record | None], now: float, timeout: float, noun: str = "rank") -> Missing | None:
    """The rank that keeps others waiting, judged from every rank's record (None: never
    published): some rank has entered the most collectives and made no progress since for
    longer than ``timeout``, and another has not entered as many, or has gone silent. None
    while nobody waits that long: ranks all computing, however slowly, are never named."""
    heard = {rank: record for rank, record in enumerate(records) if record is not None}
    if not heard:
        return None
    furthest = max(record.collectives for record in heard.values())
    waiting = [rank for rank, record in heard.items()
               if record.collectives == furthest and now - record.since > timeout and now - record.beat <= timeout]
    if not waiting:
        return None
    late = [rank for rank in range(len(records)) if rank not in waiting and (
        rank not in heard or heard[rank].collectives < furthest or now - heard[rank].beat > timeout)]
    if not late:
        return None
    rank = min(late, key=lambda r: (r in heard, heard[r].collectives if r in heard else -1, r))
    record, waiter = heard.get(rank), heard[waiting[0]]
    where = "the process group" if furthest == 0 else f"collective {furthest}" if furthest > 0 else "a collective"
    if record is None:
        state = "nothing was heard from it (it died or never started: see its own output)"
    elif now - record.beat > timeout:
        state = (f"nothing was heard from it for {now - record.beat:.0f} s (it died or froze), last in "
                 f"{describe(record.phase, record.epoch, record.round)}")
    else:
        state = f"it is still in {describe(record.phase, record.epoch, record.round)}"
        if 0 <= record.collectives < furthest:
            state += f", at collective {record.collectives}"
    waits = (f"{noun} {waiting[0]} has waited {now - waiter.since:.0f} s, in "
             f"{describe(waiter.phase, waiter.epoch, waiter.round)}")
    return Missing(rank, f"did not arrive at {where} within timeout={timeout:g} s: {state}; {waits}")


def backstop(timeout: float) -> timedelta:
    """torch's timeout on the process group: past the watchdog's bound and its ticks."""
    return timedelta(seconds=timeout + max(5.0, timeout / 4))


class SharedBoard:
    """The pool's board: a row of numbers per worker in shared memory, written by each
    worker's watchdog thread and read by the coordinator (a torn read blurs one look only)."""

    def __init__(self, ctx, world: int):
        self.world = world
        self._cells = ctx.RawArray("d", world * FIELDS)

    def open(self) -> None:
        pass

    def write(self, rank: int, record: Record) -> None:
        self._cells[rank * FIELDS:(rank + 1) * FIELDS] = [float(value) for value in record]

    def read(self, rank: int) -> Record | None:
        row = self._cells[rank * FIELDS:(rank + 1) * FIELDS]
        if row[-1] == 0:  # no heartbeat yet
            return None
        return Record(*(int(value) for value in row[:4]), row[4], row[5])

    def records(self) -> list[Record | None]:
        return [self.read(rank) for rank in range(self.world)]

    def close(self, rank: int) -> None:
        pass


class StoreBoard:
    """The torchrun ranks' board: a key per rank in the rendezvous store, and one key
    holding the line that ends the job. ``connect`` makes the store, in the watchdog's thread."""

    END = "end"

    def __init__(self, connect, world: int):
        self._connect, self.world, self._store = connect, world, None

    def open(self) -> None:
        self._store = self._connect()

    def write(self, rank: int, record: Record) -> None:
        self._store.set(f"rank{rank}", json.dumps(record))

    def records(self) -> list[Record | None]:
        found = []
        for rank in range(self.world):
            key = f"rank{rank}"  # checked first: a get waits for a key that is not there
            found.append(Record(*json.loads(self._store.get(key))) if self._store.check([key]) else None)
        return found

    def end(self, line: str) -> None:
        self._store.set(self.END, line)

    def ended(self) -> str | None:
        return self._store.get(self.END).decode() if self._store.check([self.END]) else None

    def close(self, rank: int) -> None:
        if self._store is not None:
            self._store.delete_key(f"rank{rank}")


class Watchdog:
    """Publishes this rank's record every tick. With ``judge`` (under torchrun: no
    coordinator does) it also reads the board once its own rank has made no progress for
    ``timeout`` seconds, and ends this process when a rank is missing."""

    def __init__(self, rank: int, board, timeout: float, judge: bool):
        self.rank, self.board, self.timeout, self.judge = rank, board, timeout, judge
        self.tick = min(MOST_SECONDS_PER_TICK, timeout / 5)
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"dl4py-watchdog-{rank}", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._halt.set()
        self._thread.join(timeout=self.tick + 5)

    def _run(self) -> None:
        try:
            self.board.open()
        except Exception as exc:  # the store's host is unreachable: torch's own timeout remains
            log.warning("rank %d: the watchdog cannot reach the rendezvous store (%s); a rank that does not "
                        "arrive is left to torch's timeout", self.rank, exc)
            return
        last, since = None, time.time()
        while True:
            now, count = time.time(), collectives_entered()
            progress = (count, PHASE.snapshot())
            if progress != last:
                last, since = progress, now
            record = Record(-1 if count is None else count, *progress[1], since, now)
            try:
                self.board.write(self.rank, record)
                if self.judge:
                    self._judge(record, now)
            except Exception as exc:  # the store went away with its host: the job is ending
                log.debug("rank %d: the watchdog lost the rendezvous store: %s", self.rank, exc)
                return
            if self._halt.wait(self.tick):
                try:
                    self.board.close(self.rank)
                except Exception:  # a store going away as the job ends
                    pass
                return

    def _judge(self, record: Record, now: float) -> None:
        line, found_here = self.board.ended(), False
        if line is None and now - record.since > self.timeout:
            found = missing(self.board.records(), now, self.timeout)
            if found is not None:
                line, found_here = f"rank {found.rank} {found.reason}", True
                self.board.end(line)
        if line is not None and not self._halt.is_set():
            say_whole_line(f"dl4py: rank {self.rank} stops: {line}")
            if found_here:  # this process may host the store: the others read the line first
                time.sleep(2 * self.tick)
            end_process(HANG_EXIT_CODE)


def say_whole_line(text: str) -> None:
    """One write of the line with its newline: every rank shares torchrun's stderr, and
    print's two writes (the text, then the newline) let two ranks' lines run together."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def end_process(code: int) -> None:
    """End this process from any thread, now: its child processes (a DataLoader's workers)
    are killed first, and no clean-up runs that could wait on the missing rank."""
    for child in multiprocessing.active_children():
        child.kill()
    sys.stderr.flush()
    os._exit(code)
