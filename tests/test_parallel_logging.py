"""Spawned workers' log records reach the coordinator's handlers, and listeners count a
parallel fit in the model's units: every worker's batches (2, 4, 6, ... with two workers)."""

from __future__ import annotations

import io
import logging
import pickle
import queue
import re
import threading

import pytest

from dl4py import ArrayDataSetIterator, MultiLayerNetwork
from dl4py.parallel import ParallelWrapper
from dl4py.parallel.events import EventReplay, LogRelay, relay_logs
from dl4py.parallel.messages import LogRecord
from dl4py.train import PerformanceListener, ProgressBar, ScoreIterationListener, TrainingListener

from toy import mlp, toy  # noqa: E402

BATCH, BATCHES, WORKERS, EPOCHS = 16, 15, 2, 2  # 8 rounds an epoch, the last with one batch
EVERY = 3
AVERAGED = re.compile(r"\[worker 0\] epoch (\d+), round (\d+), iteration (\d+): averaged score [\d.]+ across (\d) workers")


@pytest.fixture
def dl4py_logger():
    """The "dl4py" logger, put back as it was (relay_logs sets up a worker's)."""
    logger = logging.getLogger("dl4py")
    saved = logger.level, list(logger.handlers), logger.propagate
    yield logger
    logger.level, logger.propagate = saved[0], saved[2]
    logger.handlers[:] = saved[1]


def test_a_parallel_fit_logs_every_round_and_counts_every_workers_batches(caplog):
    caplog.set_level(logging.INFO, logger="dl4py")  # the workers send what this level lets through
    x, y = toy(BATCH * BATCHES)
    score, bar = ScoreIterationListener(EVERY), io.StringIO()
    speed = PerformanceListener(frequency=4, report=False)
    ParallelWrapper(MultiLayerNetwork(mlp(), backend="cpu"), workers=WORKERS, averaging_frequency=3,
                    report_score_after_averaging=True).fit(
        ArrayDataSetIterator(x, y, batch_size=BATCH, seed=3), epochs=EPOCHS,
        listeners=[score, ProgressBar(EPOCHS, BATCHES, stream=bar, interval=0.0), speed])

    # Averaged after rounds 3, 6 and the epoch's last, 8; a round's iterations are its batches.
    averaged = [r for r in caplog.records if AVERAGED.match(r.getMessage())]
    assert [tuple(map(int, AVERAGED.match(r.getMessage()).groups())) for r in averaged] == [
        (epoch + 1, round_no, epoch * BATCHES + iteration, WORKERS)  # epochs and rounds counted from 1
        for epoch in range(EPOCHS) for round_no, iteration in ((3, 6), (6, 12), (8, 15))]
    assert all(r.name == "dl4py" and r.levelno == logging.INFO and r.worker == 0 for r in averaged)

    # Once for each multiple of EVERY passed, though the count moves by two.
    fired = [int(m.group(1)) for r in caplog.records if (m := re.match(r"Score at iteration (\d+) is", r.getMessage()))]
    assert fired == [i for i, _ in score.history] == [4, 6, 10, 12, 15, 19, 21, 25, 27, 30]
    assert len(fired) == EPOCHS * BATCHES // EVERY

    lines = bar.getvalue().split("\n")
    assert len(lines) == EPOCHS + 1 and lines[-1] == ""
    assert all(f"{BATCHES}/{BATCHES} " in line.rsplit("\r", 1)[-1] for line in lines[:-1]), lines
    assert speed.samples_per_second / speed.batches_per_second == pytest.approx(BATCH)


class Iterations(TrainingListener):
    def __init__(self):
        self.seen = []

    def iteration_done(self, model, iteration, epoch, loss, batch_size):
        self.seen.append(iteration)


def test_a_streamed_fit_counts_the_batches_of_the_workers_with_one_each_round(tmp_path):
    """Shards of a stream differ in length; a worker whose shard ran dry sits the round out."""
    from dl4py import TableDirectoryIterator
    from test_data_streaming import mlp as stream_mlp, write_tables

    table = TableDirectoryIterator(write_tables(tmp_path / "t", "parquet", row_group=100), label="y",
                                   batch_size=32, chunk_rows=64, shuffle_buffer=32, seed=2)
    shards = [sum(1 for _ in table.batches(0, rank, WORKERS)) for rank in range(WORKERS)]
    assert shards[0] > shards[1] > 0  # later rounds have worker 0's batch alone
    relayed = Iterations()
    ParallelWrapper(MultiLayerNetwork(stream_mlp(), backend="cpu"), workers=WORKERS, prefetch_buffer=2).fit(
        table, epochs=1, listeners=[relayed])
    assert relayed.seen == [sum(min(r + 1, n) for n in shards) for r in range(shards[0])]


def test_a_worker_sends_its_records_formatted_at_the_coordinators_level_and_never_waits(dl4py_logger, caplog):
    sent = queue.Queue()
    relay_logs(sent, 1, logging.INFO)
    unpicklable = threading.Lock()
    logging.getLogger("dl4py.data").debug("not made: below the coordinator's level %s", unpicklable)
    logging.getLogger("dl4py.data").warning("slow shard %d (%s)", 3, unpicklable)
    message = sent.get_nowait()
    assert sent.empty() and message == LogRecord(1, logging.WARNING, "dl4py.data", f"slow shard 3 ({unpicklable})")
    assert pickle.loads(pickle.dumps(message)) == message
    relay_logs(sent, 1, logging.WARNING)  # the next fit's level, in a worker that lives on
    logging.getLogger("dl4py").info("not made either")
    assert sent.empty() and sum(isinstance(h, LogRelay) for h in dl4py_logger.handlers) == 1

    caplog.set_level(logging.INFO, logger="dl4py")
    dl4py_logger.handlers[:], dl4py_logger.propagate = [], True  # back to the coordinator's
    EventReplay(None, []).handle(message)
    (record,) = caplog.records
    assert (record.name, record.levelno, record.worker) == ("dl4py.data", logging.WARNING, 1)
    assert record.getMessage() == f"[worker 1] slow shard 3 ({unpicklable})"

    full = queue.Queue(maxsize=1)
    full.put(None)
    handler = LogRelay(full, 0, logging.INFO)
    handler.handleError = lambda record: None  # a dropped record; logging would print why on stderr
    done = threading.Event()
    threading.Thread(target=lambda: (handler.handle(logging.makeLogRecord({"msg": "dropped", "levelno": logging.INFO})), done.set()),
                     daemon=True).start()
    try:
        assert done.wait(5), "a worker's log call waited on a full queue"
    finally:
        full.get_nowait()  # lets a put that waits go on: it holds the handler's lock, which logging's exit takes
