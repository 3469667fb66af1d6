"""Ctrl-C during training: finish the current step, then stop with the model consistent.

A KeyboardInterrupt raised in the middle of ``optimizer.step()`` could leave some
parameters updated and others not; deferring it to a step boundary avoids that.
A second Ctrl-C interrupts at once.
"""

from __future__ import annotations

import signal
import threading


class DeferredInterrupt:
    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self) -> "DeferredInterrupt":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.getsignal(signal.SIGINT)
            signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        return False
