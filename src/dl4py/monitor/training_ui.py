"""``dl4py train --ui``: the training UI served from the training process, on the run it trains.

The server is bound before anything is read (a port in use is an error at once, not after
the data has loaded), shows the run directory from the moment it is made (``show``, which
``train_run`` calls), and serves from a daemon thread while the main thread trains. When
training ends the server stops, once an open page has had its next poll (so it shows the
run's end: its status, the test scores); with ``keep`` it serves on until Ctrl-C after a
completed run. Only the process that writes the run directory runs it: ParallelWrapper's
workers never do, and under torchrun rank 0 alone (``train_run`` calls ``show`` there only).

    with TrainingUI(port=None, keep=False, announce=print) as ui:
        result = train_run(config, on_run_dir=ui.show)
        ui.completed()                     # with keep: serves until Ctrl-C
"""

from __future__ import annotations

import threading
from pathlib import Path

from dl4py.monitor.server import POLL_MS, UIServer

# How long the end waits for an open page's next poll: one poll period, and as much again
# for a poll that is slow to read.
_LAST_POLL_SECONDS = 2 * POLL_MS / 1000


class TrainingUI:
    """The UI server of one ``dl4py train --ui``: ``port`` None is 9000, or a free port when
    9000 is taken; ``announce`` prints a line for the user."""

    def __init__(self, port: int | None, keep: bool, announce):
        self.keep, self.announce = keep, announce
        self.server = UIServer.empty(port)
        self._shown = False

    def show(self, run_dir: Path) -> None:
        """Serve ``run_dir`` (made, maybe empty yet) and say where, once."""
        self.server.attach(run_dir)
        if not self._shown:
            self.server.start()
            ending = "serves on until Ctrl-C once training completes" if self.keep else "stops when training ends"
            self.announce(f"dl4py train: the training UI at {self.server.url} ({ending})")
            self._shown = True

    def completed(self) -> None:
        """Training completed: with ``keep``, serve until Ctrl-C (or SIGTERM, which the CLI
        turns into one); else nothing (the server stops on leaving the ``with``)."""
        if not (self.keep and self._shown):
            return
        self.announce(f"dl4py train: training ended; the UI serves on at {self.server.url} (Ctrl-C to stop)")
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass

    def close(self) -> None:
        """Stop the server, once an open page has seen the run's last state."""
        try:
            if self._shown and self.server.page_open():
                self.server.wait_for_next_poll(_LAST_POLL_SECONDS)
        finally:
            self.server.stop()

    def __enter__(self) -> TrainingUI:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
