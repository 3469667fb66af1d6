"""Loss scaling's skipped updates: counted, shown in History, and fatal when they never end.

A step whose gradients overflow fp16 is skipped by the loss scaler, which halves its scale.
A few skips are how dynamic loss scaling finds its scale; a run that skips every step trains
nothing while its loss line looks like any other, so N skips in a row (the policy's
``max_skipped_steps``, default 50) stop training with an error naming the loss scale."""

from __future__ import annotations

import pytest
import torch

from dl4py import ArrayDataSetIterator, DenseLayer, InputType, MultiLayerNetwork, NetworkConfig, OutputLayer, Sgd
from dl4py.backend import Precision
from dl4py.errors import TrainingError, WorkerError
from dl4py.parallel import ParallelWrapper

from devices import backend_for, on_devices

ROWS = 64


def overflowing_data():
    """Features so large that fp16 activations overflow: every step's gradients are not finite."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(ROWS, 6, generator=gen) * 1e30
    return x, (torch.arange(ROWS) % 3)


def network(device, precision):
    config = NetworkConfig(layers=[DenseLayer(n_out=8, activation="relu"), OutputLayer(n_out=3)],
                           input_type=InputType.feed_forward(6), updater=Sgd(0.1), seed=5)
    return MultiLayerNetwork(config, backend=backend_for(device), precision=precision).init()


@on_devices
@pytest.mark.parametrize("precision", ["mixed-fp16", "half"])
def test_a_loss_that_overflows_on_every_step_stops_at_the_fiftieth_skip_naming_the_loss_scale(precision, device):
    net = network(device, precision)
    weights = [p.detach().clone() for p in net.module.parameters()]
    with pytest.raises(TrainingError) as stopped:
        net.fit(overflowing_data(), epochs=1, batch_size=1, verbose=0)  # 64 steps: the 50th stops it
    message = str(stopped.value)
    assert "50 updates in a row were skipped" in message, message
    assert f"loss scale {2.0 ** 16 / 2 ** 50:g}" in message, message  # halved at each of the 50
    assert f"precision '{precision}'" in message and "\n" not in message
    assert net.iteration_count == 49 and net.update_count == 0  # the step that stopped it is not counted
    assert net.precision_state.skipped_steps == 50
    assert all(torch.equal(a, b) for a, b in zip(weights, net.module.parameters()))


@on_devices
def test_the_limit_is_the_policys_setting_and_an_applied_update_resets_the_run(device):
    # A loss scale of 2**60 overflows these (finite) gradients for dozens of halvings.
    net = network(device, Precision("mixed-fp16", max_skipped_steps=6))
    x = torch.randn(ROWS, 6, generator=torch.Generator().manual_seed(4))
    y = torch.arange(ROWS) % 3
    net.precision_state.set_loss_scale(2.0**60)
    history = net.fit((x[:5], y[:5]), epochs=1, batch_size=1, shuffle=False, verbose=0)
    assert history.history["skipped_steps"] == [5] and net.precision_state.skipped_in_a_row == 5
    net.precision_state.set_loss_scale(2.0**8)
    net.fit((x[:1], y[:1]), epochs=1, batch_size=1, verbose=0)  # applied: the run of skips ends
    assert net.update_count == 1 and net.precision_state.skipped_in_a_row == 0
    net.precision_state.set_loss_scale(2.0**60)
    net.fit((x[:5], y[:5]), epochs=1, batch_size=1, verbose=0)  # five more: 10 in all, never 6 in a row
    assert net.precision_state.skipped_steps == 10
    with pytest.raises(TrainingError, match="6 updates in a row were skipped"):
        net.fit((x[:5], y[:5]), epochs=1, batch_size=1, verbose=0)


@on_devices
def test_no_limit_leaves_the_verdict_to_the_nan_check(device):
    net = network(device, Precision("mixed-fp16", max_skipped_steps=0))
    with pytest.raises(TrainingError, match="NaN or infinite"):
        net.fit(overflowing_data(), epochs=1, batch_size=1, verbose=0)
    assert net.precision_state.skipped_steps == ROWS


def test_precisions_without_loss_scaling_count_nothing():
    net = network("cpu", "bfloat16")
    x, y = overflowing_data()
    history = net.fit((x[:8] * 0 + 1, y[:8]), epochs=1, batch_size=4, verbose=0)
    assert "skipped_steps" not in history.history and not net.precision_state.scales_loss


@pytest.mark.slow  # a pool of two workers starts
def test_parallel_workers_get_the_policy_object_and_stop_at_its_limit():
    # The policy travels to each worker as an object, its limit with it: both workers skip
    # every shared update, and the fit stops at the sixth, naming a worker.
    net = network("cpu", Precision("mixed-fp16", max_skipped_steps=6))
    with pytest.raises(WorkerError, match="6 updates in a row were skipped"):
        ParallelWrapper(net, workers=2, parallelism={"kind": "data", "sync": "shared_gradients"}).fit(
            ArrayDataSetIterator(*overflowing_data(), batch_size=4), epochs=1, verbose=0)
