"""The driver's line to its ranks: rank 0's training events, and how each rank ends.

A Spark task hands the driver nothing but its result, and only when it ends. So each rank
connects back to the driver (at ``spark.driver.host``, which every executor reaches
already). Rank 0 sends what ``EventRelay`` sends a spawned ParallelWrapper's coordinator:
the driver runs the fit's listeners on them as training goes (``EventReplay``), so the
run directory is written where the driver runs, never on an executor. Every rank says
where it runs and how it ended (``reports.py``), so the driver can name the rank that
failed or died, and how, instead of Spark's "task failed", and stop the job at once. A
rank's connection that ends without its last word is itself news: ``RankLost``.

Connections are authenticated with a key only this job's ranks hold
(``multiprocessing.connection``'s HMAC challenge) before any message is unpickled.
"""

from __future__ import annotations

import queue
import secrets
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Listener

from dl4py.spark.reports import RankFailed, RankFinished, RankLost, RankStarted


class EventServer:
    """The driver's end. ``messages`` receives what the ranks send, in each rank's order."""

    def __init__(self, host: str, bind: str = ""):
        self.key = secrets.token_bytes(32)
        # By default every interface, as TorchDistributor's own log server: the executors
        # reach the driver by the address Spark gives them, whichever interface that is.
        self._listener = Listener((bind, 0), authkey=self.key)
        self._bind = bind or "127.0.0.1"
        self.port = self._listener.address[1]
        self.address = (host, self.port)
        self.messages: queue.Queue = queue.Queue()
        self._readers: list[threading.Thread] = []
        self._closing = False
        self._acceptor = threading.Thread(target=self._accept, name="dl4py-spark-events", daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except AuthenticationError:
                continue  # not one of this job's ranks
            except OSError:
                return
            if self._closing:
                conn.close()
                return
            reader = threading.Thread(target=self._read, args=(conn,), name="dl4py-spark-events-reader", daemon=True)
            self._readers.append(reader)
            reader.start()

    def _read(self, conn) -> None:
        started = last_word = None
        with conn:
            while True:
                try:
                    message = conn.recv()
                except (EOFError, OSError):  # the rank closed its end, or its process ended
                    break
                if isinstance(message, RankStarted):
                    started = message.processes
                elif isinstance(message, (RankFinished, RankFailed)):
                    last_word = message
                self.messages.put(message)
        if started is not None and last_word is None:
            # Looked at now, before anyone stops the job: what ended first is still gone alone.
            self.messages.put(RankLost(started, started.gone()))

    def close(self, timeout: float) -> None:
        """Stop accepting; wait up to ``timeout`` s for the open connections to end (they do
        when their rank's process has ended), so that every message sent is in ``messages``."""
        if self._closing:
            return
        self._closing = True
        try:  # a blocked accept() does not notice its listener closing: a connection of our own wakes it
            Client((self._bind, self.port), authkey=self.key).close()
        except OSError:
            pass
        deadline = time.monotonic() + timeout
        self._acceptor.join(max(0.0, deadline - time.monotonic()))
        self._listener.close()
        for reader in list(self._readers):
            reader.join(max(0.0, deadline - time.monotonic()))


class DriverLine:
    """A rank's end: ``put(message)`` sends it to the driver (an ``EventRelay``'s queue)."""

    def __init__(self, address: tuple[str, int], key: bytes):
        self._conn = Client(tuple(address), authkey=key)
        self._sending = threading.Lock()  # one message at a time, whichever thread sends

    def put(self, message) -> None:
        with self._sending:
            self._conn.send(message)

    def close(self) -> None:
        self._conn.close()


def send_once(address: tuple[str, int], key: bytes, message) -> bool:
    """One message on a connection of its own (a failure report); False when the driver
    cannot be reached, whose Spark job then fails with the task's own error."""
    try:
        line = DriverLine(address, key)
        try:
            line.put(message)
        finally:
            line.close()
        return True
    except (OSError, EOFError, AuthenticationError):
        return False
