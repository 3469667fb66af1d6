"""Ctrl-C or SIGTERM during training: finish the current step, then stop with the model consistent.

A KeyboardInterrupt raised in the middle of ``optimizer.step()`` could leave some
parameters updated and others not; deferring it to a step boundary avoids that.
SIGTERM (``kill``, a batch scheduler, a sweep that died) is handled the same way: by
default it would end the process at once, losing the partial epoch and orphaning any
worker processes. A second signal of either kind interrupts at once, except in a parallel
rank (``escalate=False``), which only ever asks: whoever launched it ends it if need be.
"""

from __future__ import annotations

import signal
import threading

HANDLED = (signal.SIGINT, signal.SIGTERM)


class DeferredInterrupt:
    """``with DeferredInterrupt() as interrupt: ... if interrupt.requested: stop``.

    ``cause`` names what asked ("Ctrl-C" or "SIGTERM"), for the message that says so. With
    ``escalate=False`` a second signal asks again rather than raising KeyboardInterrupt."""

    def __init__(self, escalate: bool = True):
        self.requested = False
        self.cause: str | None = None
        self.escalate = escalate
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "DeferredInterrupt":
        # Signal handlers can only be installed from the main thread; elsewhere the
        # signals keep their meaning and only ``requested`` set by hand stops the loop.
        if threading.current_thread() is threading.main_thread():
            for sig in HANDLED:
                self._previous[sig] = signal.getsignal(sig)
                signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested and self.escalate:
            raise KeyboardInterrupt
        self.requested = True
        self.cause = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name

    def clear(self) -> None:
        """Forget a request (a pool's worker, as each fit begins: one sent between fits is
        the coordinator's to act on)."""
        self.requested, self.cause = False, None

    def __exit__(self, *exc):
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        return False
