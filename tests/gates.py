"""Forward passes that wait until a test lets them through, so tests of queues, merging and
shutdown decide what is in flight with events instead of sleeping and hoping.

``Gate``: a door forward passes wait at (``pass_through``) while it is closed, counting who
arrived; ``GatedModule`` puts one in front of a module and records each batch's rows in the
order the forward passes ran. ``wait_for`` waits, with a bound, for a condition on the code's
own state (a queue's length, a server's requests in flight) and fails naming it.
"""

from __future__ import annotations

import threading
import time

from torch import nn

# Longer than any test here should take: past it a forward pass fails instead of hanging.
BOUND_SECONDS = 60.0


class Gate:
    """Open or closed; a forward pass that meets it closed waits until it opens."""

    def __init__(self, open: bool = True):
        self._open = threading.Event()
        self._arrived = threading.Condition()
        self.arrivals = 0
        if open:
            self._open.set()

    def __deepcopy__(self, memo):
        return self  # ParallelInference's replicas are deep copies: they share the one gate

    def open(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._open.clear()

    def pass_through(self) -> None:
        with self._arrived:
            self.arrivals += 1
            self._arrived.notify_all()
        if not self._open.wait(BOUND_SECONDS):
            raise RuntimeError(f"the test left the gate closed for {BOUND_SECONDS:g} s")

    def wait_for_arrivals(self, count: int) -> None:
        """Until ``count`` forward passes have reached the gate since it was made."""
        with self._arrived:
            reached = self._arrived.wait_for(lambda: self.arrivals >= count, BOUND_SECONDS)
        assert reached, f"{self.arrivals} forward passes reached the gate, not {count}"


class GatedModule(nn.Module):
    """``inner`` behind ``gate``; ``batches`` lists the rows of each forward pass, in order."""

    def __init__(self, inner: nn.Module, gate: Gate):
        super().__init__()
        self.inner, self.gate = inner, gate
        self.batches: list[int] = []

    def forward(self, x):
        self.batches.append(int(x.shape[0]))
        self.gate.pass_through()
        return self.inner(x)


def wait_for(condition, what: str) -> None:
    """Poll ``condition()`` until it holds; fail naming ``what`` after the bound."""
    deadline = time.monotonic() + BOUND_SECONDS
    while not condition():
        assert time.monotonic() < deadline, f"never happened within {BOUND_SECONDS:g} s: {what}"
        time.sleep(0.002)
