"""The coordinator's side of a fit, written once for the worker pool and the Spark driver
(``parallel/coordinator.py``): its three promises, with the ranks played by a function. No
processes: the pool's and Spark's own tests run the same code with real ranks."""

from __future__ import annotations

import pytest
import torch

from dl4py import ArrayDataSetIterator, MultiLayerNetwork
from dl4py.nn.serialization import model_bytes
from dl4py.parallel.coordinator import Coordinator, RanksEnded
from dl4py.parallel.events import EventReplay
from dl4py.parallel.messages import EpochEnded
from dl4py.train import TrainingListener
from dl4py.train.loop import TrainingInterrupted

from toy import mlp, toy  # noqa: E402


class Events(TrainingListener):
    """What the coordinator's listeners heard, with the model's iteration count at the fit's end."""

    def __init__(self):
        self.heard = []

    def on_fit_start(self, model):
        self.heard.append("start")

    def on_epoch_end(self, model, summary):
        self.heard.append("epoch_end")

    def on_fit_end(self, model, interrupted):
        self.heard.append(("end", interrupted, model.iteration_count))


@pytest.fixture(scope="module")
def trained():
    """Rank 0's state after one epoch of 4 batches, and that epoch's summary."""
    x, y = toy(64)
    model = MultiLayerNetwork(mlp(), backend="cpu")
    history = model.fit(ArrayDataSetIterator(x, y, batch_size=16, shuffle=False), epochs=1, verbose=0)
    return model_bytes(model), history.summaries[0]


def _coordinated():
    model = MultiLayerNetwork(mlp(), backend="cpu").init()
    events = Events()
    replay = EventReplay(model, [events])
    coordinator = Coordinator(model, replay)
    coordinator.save()
    return model, events, replay, coordinator


def _parameters(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.module.parameters()]


def test_a_fit_that_fails_after_an_epoch_end_puts_the_model_back_and_ends_the_listeners(trained):
    state, summary = trained
    model, events, replay, coordinator = _coordinated()
    before = _parameters(model)

    def ranks():  # rank 0's first epoch reaches the listeners, then a rank fails
        replay.handle(EpochEnded(summary, state))
        assert model.iteration_count == 4
        raise RuntimeError("worker 1 failed")

    with pytest.raises(RuntimeError, match="worker 1 failed"):
        coordinator.run(ranks)
    assert events.heard == ["start", "epoch_end", ("end", False, 4)]  # ended as they were, no checkpoint
    assert model.iteration_count == 0
    assert all(torch.equal(p, q) for p, q in zip(_parameters(model), before))


def test_a_fit_that_ends_leaves_rank_0s_state_in_the_model_before_the_listeners_end(trained):
    state, _ = trained
    model, events, _, coordinator = _coordinated()
    assert coordinator.run(lambda: RanksEnded("the launcher's result", state)) == "the launcher's result"
    assert events.heard == ["start", ("end", False, 4)]
    assert model_bytes(model) == state


def test_ranks_stopped_by_a_signal_give_the_interrupted_end_then_the_launchers_error(trained):
    state, _ = trained
    model, events, _, coordinator = _coordinated()

    def stopped():  # made once the model holds rank 0's state, as the pool's message is
        return TrainingInterrupted(f"stopped by SIGTERM at iteration {model.iteration_count}")

    with pytest.raises(TrainingInterrupted, match="stopped by SIGTERM at iteration 4$"):
        coordinator.run(lambda: RanksEnded(None, state, stopped))
    assert events.heard == ["start", ("end", True, 4)]  # a CheckpointListener keeps its checkpoint
