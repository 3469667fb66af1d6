"""Gradient accumulation (``training.accumulate_batches``): k batches of b examples make the
update one batch of k*b examples would, on the same data in the same order.

The equality tests train a network twice on an MNIST slice: with batches of 32, and with
batches of 8 and ``accumulate_batches=4``. 204 examples make 7 updates an epoch, the last
from a window of two batches (8 and 4 examples) that the epoch's end cuts short: each also
checks the weighting, the flush and the rescaling of a short last window. Then: an fp16
overflow, Ctrl-C and resume, a listener's stop, two workers sharing gradients, the config.
"""

from __future__ import annotations

import copy
import signal

import pytest
import torch

from dl4py import (
    Adam,
    ArrayDataSetIterator,
    DenseLayer,
    InputType,
    MnistDataSetIterator,
    MultiLayerNetwork,
    NetworkConfig,
    OutputLayer,
    Sgd,
)
from dl4py.config.run import RunConfig
from dl4py.config.schedules import ExponentialSchedule
from dl4py.errors import ConfigError
from dl4py.monitor import InMemoryStatsStorage, StatsListener
from dl4py.train import TrainingInterrupted, TrainingListener

from devices import backend_for, on_devices, tolerance

EXAMPLES, SMALL, K = 204, 8, 4
BATCHES = -(-EXAMPLES // SMALL)  # 26 an epoch
UPDATES = -(-EXAMPLES // (SMALL * K))  # 7 an epoch


def _config(updater, **settings) -> NetworkConfig:
    return NetworkConfig(
        layers=[DenseLayer(n_out=24, activation="tanh"), OutputLayer(n_out=10)],
        input_type=InputType.feed_forward(784), updater=updater, seed=5, **settings,
    )


def _data(batch: int, examples: int = EXAMPLES) -> MnistDataSetIterator:
    return MnistDataSetIterator(batch, train=True, seed=3, limit=examples)  # the same order whatever the batch size


def _trained(updater, batch, precision="float", epochs=1, accumulate=None, listeners=(), **settings):
    net = MultiLayerNetwork(_config(updater, **settings), backend="cpu", precision=precision)
    net.fit(_data(batch), epochs=epochs, verbose=0, accumulate_batches=accumulate, listeners=listeners)
    return net


def _gap(a: MultiLayerNetwork, b: MultiLayerNetwork) -> float:
    """The largest relative gap between two networks' parameters (the float32 masters where
    there are some): max |a - b| / max |a| per parameter tensor, in float64."""
    def params(net):
        return list(net.stepped_module.parameters())

    return max(((x.double() - y.double()).abs().max() / x.double().abs().max()).item()
               for x, y in zip(params(a), params(b)))


@pytest.mark.parametrize("updater, tolerance", [
    (Sgd(0.1, schedule=ExponentialSchedule(unit="iteration", gamma=0.9)), 1e-6),  # "iteration" = per update
    (Adam(0.01), 1e-5),  # Adam divides by sqrt(v): float32 rounding in near-zero gradients grows
], ids=["sgd-scheduled", "adam"])
def test_four_batches_of_eight_update_as_one_batch_of_thirty_two(updater, tolerance, mnist):
    big = _trained(updater, SMALL * K, epochs=2)
    storage = InMemoryStatsStorage()
    small = _trained(updater, SMALL, epochs=2, accumulate=K, listeners=[StatsListener(storage, frequency=4)])
    assert _gap(big, small) < tolerance
    # Counters: iterations count batches, updates count updates; the schedule read the updates.
    assert small.iteration_count == 2 * BATCHES and big.iteration_count == 2 * UPDATES
    assert small.update_count == big.update_count == 2 * UPDATES
    assert small.epoch_count == 2
    if updater.schedule is not None:
        assert small.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.9 ** (2 * UPDATES - 1))
        # The stats listener counts batches too, and sees an update on a window's last batch
        # only: batches 4, 8, ..., 24 of each epoch (its 26th is flushed after the listeners ran).
        records = storage.updates
        assert [r["iteration"] for r in records] == list(range(4, 2 * BATCHES + 1, 4))
        ends = {i for i in range(1, 2 * BATCHES + 1) if ((i - 1) % BATCHES + 1) % K == 0}
        moved = {r["iteration"]: r["layers"]["0_DenseLayer"]["update_ratio"] > 0 for r in records}
        assert moved == {i: i in ends for i in moved} and any(moved.values()) and not all(moved.values())
        plain = _trained(updater, SMALL, epochs=2)  # batches of 8 without accumulation
        assert _gap(big, plain) > 1e-2  # what accumulation closes: the tolerance above means something


@pytest.mark.parametrize("precision, tolerance", [
    ("bfloat16", 2e-2),  # 16-bit forward and backward; the float32 masters sum the window
    ("mixed-bf16", 2e-2),  # bf16 autocast: products rounded to 8 significant bits
    ("mixed-fp16", 5e-3),  # loss scaling: scaled once per batch, unscaled and stepped once per window
])
def test_low_precisions_accumulate_like_one_big_batch(precision, tolerance, mnist):
    # Batches of 8 without accumulation end more than 1.0 away: these tolerances are the
    # precision's rounding, not the batching. SGD: Adam would magnify rounding noise in
    # gradients near 0 (the image borders') into whole steps.
    big = _trained(Sgd(0.1), SMALL * K, precision)
    small = _trained(Sgd(0.1), SMALL, precision, accumulate=K)
    assert _gap(big, small) < tolerance
    assert small.update_count == big.update_count == UPDATES


def test_an_overflow_in_one_batch_drops_the_whole_window_under_loss_scaling(mnist):
    net = MultiLayerNetwork(_config(Sgd(0.1)), backend="cpu", precision="mixed-fp16").init()
    net.set_accumulate_batches(2)
    x, y = _data(16).features[:16], _data(16).labels[:16]
    before = [p.detach().clone() for p in net.module.parameters()]
    spoiled = x[8:].clone()
    spoiled[0, 300] = 1e6  # overflows float16 in the first layer's product
    net.train_step(x[:8], y[:8])
    net.train_step(spoiled, y[8:])
    assert net.update_count == 0 and net.precision_state.loss_scale < 2.0 ** 16  # skipped, scale lowered
    assert all(torch.equal(a, b) for a, b in zip(before, net.module.parameters()))  # not even the clean batch
    net.train_step(x[:8], y[:8])
    net.train_step(x[8:], y[8:])
    assert net.update_count == 1
    assert not all(torch.equal(a, b) for a, b in zip(before, net.module.parameters()))


class _AtIteration(TrainingListener):
    """Runs ``action(model)`` once, after batch ``iteration`` of the fit."""

    def __init__(self, iteration, action):
        self.iteration, self.action = iteration, action

    def iteration_done(self, model, iteration, epoch, loss, batch_size):
        if iteration == self.iteration:
            self.action(model)


def test_ctrl_c_waits_for_the_window_and_a_resumed_run_continues_exactly(mnist):
    whole = _trained(Adam(0.01), SMALL, accumulate=K)
    net = MultiLayerNetwork(_config(Adam(0.01)), backend="cpu")
    ctrl_c = _AtIteration(6, lambda model: signal.raise_signal(signal.SIGINT))
    with pytest.raises(TrainingInterrupted):
        net.fit(_data(SMALL), verbose=0, accumulate_batches=K, listeners=[ctrl_c])
    # Asked for in the second window: it stopped when that window's update was applied.
    assert (net.iteration_count, net.update_count, net.batch_in_epoch) == (8, 2, 8)
    net.fit(_data(SMALL), verbose=0)  # resumed mid-epoch; the setting stayed with the model
    assert _gap(whole, net) == 0.0
    assert net.update_count == UPDATES


def test_a_stop_asked_for_by_a_listener_applies_the_open_window(mnist):
    net = MultiLayerNetwork(_config(Sgd(0.1)), backend="cpu")
    stop = _AtIteration(6, lambda model: model.request_stop("enough"))
    history = net.fit(_data(SMALL), verbose=0, accumulate_batches=K, listeners=[stop])
    assert (net.iteration_count, net.update_count) == (6, 2)  # batches 5 and 6 made an update of their own
    assert len(history) == 1 and not history[0].completed


def test_gradient_clipping_sees_the_accumulated_gradient(mnist):
    clip = dict(gradient_normalization="clip_l2_per_layer", gradient_normalization_threshold=0.05)
    big = _trained(Sgd(0.5), SMALL * K, **clip)
    small = _trained(Sgd(0.5), SMALL, accumulate=K, **clip)
    assert _gap(big, small) < 1e-6
    unclipped = _trained(Sgd(0.5), SMALL * K)
    assert _gap(big, unclipped) > 1e-2  # the threshold is low enough to clip


def _shared_gradient_steps(net, data, workers: int, k: int, epochs: int):
    """Replicas sharing gradients, stepped by hand: one module and updater. Round r deals
    batch ``r * workers + i`` to worker i (docs/parallel.md); every ``k`` rounds, and after
    an epoch's last round, each worker's gradient is the mean over the examples it saw in
    those rounds, and the update steps on the mean of the gradients of the workers that saw
    any. Nothing of dl4py's step, accumulation or collectives is used."""
    module = copy.deepcopy(net.module)
    optimizer = type(net.optimizer)(module.parameters(), **net.optimizer.defaults)
    params, batches, size = list(module.parameters()), len(data), data.batch_size
    rounds = -(-batches // workers)
    for epoch in range(epochs):
        order = data.epoch_order(epoch)
        seen = [[] for _ in range(workers)]
        for r in range(rounds):
            for worker, b in enumerate(range(r * workers, min((r + 1) * workers, batches))):
                seen[worker].append(order[b * size:(b + 1) * size])
            if (r + 1) % k and r != rounds - 1:
                continue
            grads = []
            for rows in (torch.cat(s) for s in seen if s):
                module.zero_grad(set_to_none=True)
                net.loss(module(data.features[rows]), data.labels[rows]).backward()
                grads.append([p.grad.clone() for p in params])
            for i, p in enumerate(params):
                p.grad = torch.stack([g[i] for g in grads]).mean(0)
            optimizer.step()
            seen = [[] for _ in range(workers)]
    return module


def test_two_workers_sharing_gradients_accumulate_two_rounds_per_update(mnist):
    # 196 examples in batches of 8: 25 batches, 13 rounds. Each epoch's last round has
    # worker 0's short batch of 4 alone, and ends a window that worker 1 only counts: the
    # two still meet in the same update, and worker 1's empty gradient is left out.
    from dl4py.parallel import ParallelWrapper

    mnist_slice = _data(8, 196)  # as arrays: the workers get 196 rows, not MNIST's files to read
    data = ArrayDataSetIterator(mnist_slice.features, mnist_slice.labels, batch_size=8, shuffle=True, seed=3)
    net = MultiLayerNetwork(_config(Adam(0.01)), backend="cpu").init()
    expected = _shared_gradient_steps(net, data, workers=2, k=2, epochs=2)
    ParallelWrapper(net, workers=2, parallelism={"kind": "data", "sync": "shared_gradients"}).fit(data, epochs=2, verbose=0,
                                                                          accumulate_batches=2)
    gaps = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(net.module.parameters(),
                                                                           expected.parameters())]
    assert max(gaps) < 1e-5, gaps
    assert net.iteration_count == 2 * 25 and net.update_count == 2 * 7


@pytest.mark.parametrize("value", [0, -1, "x"])
def test_a_bad_value_is_named(value):
    section = {"network": {"input_type": {"type": "feed_forward", "size": 4},
                           "layers": [{"type": "output", "n_out": 2}]},
               "training": {"accumulate_batches": value}}
    with pytest.raises(ConfigError, match=r"^training\.accumulate_batches: must be"):
        RunConfig.from_dict(section)
    with pytest.raises(ConfigError, match=r"^accumulate_batches: must be"):
        MultiLayerNetwork(_config(Sgd(0.1))).set_accumulate_batches(value)


def test_dl4py_train_accumulates_as_its_config_says(tmp_path, mnist):
    from dl4py.nn import load
    from dl4py.runner import train_run

    config = RunConfig.from_dict({
        "network": _config(Sgd(0.1)).to_dict(),
        "data": {"dataset": "mnist", "limit_train": 96, "limit_test": 32},
        "training": {"epochs": 1, "batch_size": 8, "accumulate_batches": 4, "score_every": 0},
        "logging": {"report": False},
    })
    result = train_run(config, output=tmp_path / "run", progress=False)
    model = load(tmp_path / "run" / "model.dl4py")
    assert result["status"] == "completed"
    assert (model.iteration_count, model.update_count) == (12, 3)


def test_the_run_config_sets_it_and_round_trips():
    config = RunConfig.from_dict({"network": _config(Sgd(0.1)).to_dict(), "training": {"accumulate_batches": 3}})
    assert config.training.accumulate_batches == 3
    assert RunConfig.from_dict(config.to_dict()) == config
    assert config.with_overrides(["training.accumulate_batches=5"]).training.accumulate_batches == 5
    assert RunConfig.from_dict({"network": _config(Sgd(0.1)).to_dict()}).training.accumulate_batches == 1


@on_devices
@pytest.mark.parametrize("precision, tolerance_on_cpu", [
    # about 4 times the gaps seen on a CPU: 1.9e-7, 4e-16, 6.4e-4 (fp16), 7.4e-3 (bf16)
    ("float", 1e-6), ("double", 1e-12), ("half", 3e-3), ("bfloat16", 3e-2), ("mixed-fp16", 3e-3), ("mixed-bf16", 3e-2),
])
def test_on_every_device_and_precision_four_batches_update_as_one(precision, tolerance_on_cpu, device):
    # Random rows, no MNIST (a GPU machine may lack it): 96 examples make 3 updates an epoch.
    if device == "cuda" and "bf" in precision and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bfloat16 needs a GPU of compute capability 8.0 or later")
    gen = torch.Generator().manual_seed(0)
    x, y = torch.rand(96, 40, generator=gen), torch.randint(0, 10, (96,), generator=gen)
    config = _config(Sgd(0.5)).replace(input_type=InputType.feed_forward(40))

    def trained(batch, accumulate=None):
        net = MultiLayerNetwork(config, backend=backend_for(device), precision=precision)
        net.fit(ArrayDataSetIterator(x, y, batch_size=batch, shuffle=False), epochs=2, verbose=0,
                accumulate_batches=accumulate)
        return net

    big, small = trained(SMALL * K), trained(SMALL, accumulate=K)
    # float32 on CUDA: other batch sizes take other matrix kernels, which sum in other orders
    allowed = max(tolerance_on_cpu, tolerance(device)["rtol"]) if device == "cuda" else tolerance_on_cpu
    assert _gap(big, small) < allowed
    assert small.update_count == big.update_count == 6 and small.iteration_count == 24
    assert _gap(big, trained(SMALL)) > 5 * allowed  # batches of 8 without accumulation: what it closes
