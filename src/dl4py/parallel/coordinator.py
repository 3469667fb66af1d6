"""The coordinating process's side of a fit whose ranks train elsewhere, written once for
the worker pool (``wrapper.py``) and the Spark driver (``spark/trainer.py``).

    coordinator = Coordinator(model, replay)           # replay: the fit's EventReplay
    job.model = coordinator.save()                     # the state every rank starts from
    result = coordinator.run(lambda: RanksEnded(...))  # the listeners around the ranks

Who does what: the launcher starts the ranks, relays their events to ``replay`` and says
how they ended (``RanksEnded``); the coordinator owns the model and the listeners' fit
start and end. Its promises, the same for every launcher:

- a fit that fails, in a rank or here (a listener, a signal), ends the listeners without a
  checkpoint (``on_fit_end(model, False)``) and leaves the model as it was before the fit;
- a fit that ends takes rank 0's trained state into the model before ``on_fit_end``;
- ranks that stopped together on a signal after a whole round (the pool's workers) give the
  listeners their interrupted end (a CheckpointListener keeps its checkpoint), and then the
  launcher's ``TrainingInterrupted``, which names the model's counters as they are then.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dl4py.nn.serialization import model_bytes, restore_state
from dl4py.parallel.events import EventReplay
from dl4py.train.loop import TrainingInterrupted


@dataclass
class RanksEnded:
    """How the ranks of a fit ended, as the launcher read it."""

    result: object  # the launcher's own: the pool's reports, Spark's rank 0 result
    state: bytes | str  # rank 0's trained model (a saved file's bytes or path)
    # The ranks stopped together on a signal: the error to raise after the listeners'
    # interrupted end (made then, from the model holding rank 0's state).
    interrupted: Callable[[], TrainingInterrupted] | None = None


class Coordinator:
    """One fit's model and listeners (``replay`` runs them) around the ranks that train it."""

    def __init__(self, model, replay: EventReplay):
        self.model, self.replay = model, replay
        self.before: bytes | str | None = None

    def save(self, path: str | Path | None = None) -> bytes | str:
        """The model as of this fit's start, which every rank starts from and a failed fit
        puts back: its saved file at ``path`` (returned as a string), or the file's bytes."""
        if path is None:
            self.before = model_bytes(self.model)
        else:
            self.model.save(path)
            self.before = str(path)
        return self.before

    def run(self, ranks: Callable[[], RanksEnded]):
        """Start the listeners, train (``ranks``: the launcher's part, which raises what
        ended the fit when it failed), end them; return the ranks' ``result``."""
        if self.before is None:
            raise RuntimeError("Coordinator.run before save: a failed fit would have no state to put back")
        # As Model.fit: a listener failing at its start fails the fit before anything trains.
        self.replay.fit_start()
        failed = True
        try:
            ended = ranks()
            failed = False
        finally:
            if failed:  # the promise of every failure: the model as it was before this fit
                self.replay.abandon(self.before)
        restore_state(self.model, ended.state)
        if ended.interrupted is not None:  # the listeners' interrupted end runs here, which owns the run directory
            self.replay.fit_end(True)
            raise ended.interrupted()
        self.replay.fit_end(False)
        return ended.result
