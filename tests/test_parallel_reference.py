"""ParallelWrapper's averaging mode against replicas stepped by hand in one process.

The reference shares no code with dl4py's parallel package. It deals the batches as
docs/parallel.md says (round ``r`` of an epoch gives batch ``r * W + i`` of the epoch's
shuffled order to worker ``i``; the last round may be short), steps a private copy of the
module and of the optimizer per worker, and after every ``k`` rounds and at the end of
each epoch replaces the parameters and the updater state (Nesterov's momentum buffers,
Adam's moments and step count) by their mean over the workers that trained since the
last average. With momentum or Adam the updater state matters: a wrapper that averaged
the parameters only would drift from it. On a GPU the two workers share cuda:0 (gloo) and the
replicas step there too.
"""

from __future__ import annotations

import copy

import pytest
import torch

from dl4py import (
    Adam,
    ArrayDataSetIterator,
    DenseLayer,
    InputType,
    MultiLayerNetwork,
    Nesterovs,
    NetworkConfig,
    OutputLayer,
)
from devices import backend_for, on_devices, tolerance
from dl4py.parallel import ParallelWrapper

from toy import toy  # noqa: E402

WORKERS, EPOCHS, BATCH = 2, 2, 8
EXAMPLES = 70  # 9 batches (the last of 6): 5 rounds, worker 1 sits the last one out


def _network(updater) -> NetworkConfig:
    # No dropout: its masks are seeded per worker, which this reference does not imitate.
    return NetworkConfig(
        layers=[DenseLayer(n_out=16, activation="tanh"), OutputLayer(n_out=3)],
        input_type=InputType.feed_forward(5), updater=updater, seed=7,
    )


def _state(module, optimizer) -> list[torch.Tensor]:
    """What is averaged: parameters, then each parameter's floating-point updater state by
    key (in torch's Adam the step count is a float tensor: it is averaged too, so after a
    short last round the replicas go on with the mean count)."""
    tensors = list(module.parameters())
    for param in module.parameters():
        state = optimizer.state[param]
        tensors += [state[key] for key in sorted(state) if state[key].is_floating_point()]
    return tensors


@torch.no_grad()
def _average(replicas, took_part: list[bool]) -> None:
    if not any(took_part):
        return
    for same in zip(*(_state(*replica) for replica in replicas)):
        mean = torch.stack([t for t, took in zip(same, took_part) if took]).mean(0)
        for t in same:
            t.copy_(mean)


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().cpu() - b.detach().cpu()).abs().max().item()


def _agree(got: torch.Tensor, want: torch.Tensor, device: str) -> bool:
    """Equal to the bit on a 2-core CPU; 1e-6 leaves room for rounding that differs with the
    number of threads (the workers run one each). On a GPU the tolerance of two float32 runs."""
    if device == "cpu":
        return _gap(got, want) <= 1e-6
    return torch.allclose(got.detach().cpu(), want.detach().cpu(), **tolerance(device))


def _reference(net: MultiLayerNetwork, data: ArrayDataSetIterator, frequency: int):
    """Worker replicas of ``net`` (before its fit) trained as the wrapper should; returns
    worker 0's module and optimizer (all are equal after the epoch's last average)."""
    replicas = []
    for _ in range(WORKERS):
        module = copy.deepcopy(net.module)
        optimizer = type(net.optimizer)(module.parameters(), **net.optimizer.defaults)
        replicas.append((module, optimizer))
    batches = len(data)
    rounds = -(-batches // WORKERS)
    for epoch in range(EPOCHS):
        order = data.epoch_order(epoch)
        took_part = [False] * WORKERS
        for r in range(rounds):
            for worker, (module, optimizer) in enumerate(replicas):
                b = r * WORKERS + worker
                if b >= batches:
                    continue
                rows = order[b * BATCH:(b + 1) * BATCH]
                optimizer.zero_grad(set_to_none=True)
                features, labels = data.features[rows].to(net.device), data.labels[rows].to(net.device)
                net.loss(module(features), labels).backward()
                optimizer.step()
                took_part[worker] = True
            if (r + 1) % frequency == 0 or r == rounds - 1:
                _average(replicas, took_part)
                took_part = [False] * WORKERS
    return replicas[0]


@on_devices
@pytest.mark.parametrize("frequency", [1, 3])  # 3: averages after rounds 3 and 5, 5 not a multiple of 3
@pytest.mark.parametrize("updater", [Nesterovs(learning_rate=0.05, momentum=0.9), Adam(learning_rate=0.01)],
                         ids=["nesterovs", "adam"])
def test_averaging_matches_replicas_stepped_by_hand(updater, frequency, device):
    x, y = toy(EXAMPLES, seed=2)
    data = ArrayDataSetIterator(x, y, batch_size=BATCH, shuffle=True, seed=3)
    net = MultiLayerNetwork(_network(updater), backend=backend_for(device)).init()
    module, optimizer = _reference(net, data, frequency)

    devices = {"devices": ["cuda:0"]} if device == "cuda" else {}  # two workers on one GPU
    ParallelWrapper(net, workers=WORKERS, averaging_frequency=frequency, **devices).fit(data, epochs=EPOCHS)

    assert net.iteration_count == EPOCHS * len(data)
    for (name, got), want in zip(net.module.named_parameters(), module.parameters()):
        assert got.device.type == device and _agree(got, want, device), (name, _gap(got, want))
    # The model keeps the averaged updater state too.
    keys = {"momentum_buffer"} if isinstance(updater, Nesterovs) else {"exp_avg", "exp_avg_sq", "step"}
    for got_param, want_param in zip(net.module.parameters(), module.parameters()):
        got, want = net.optimizer.state[got_param], optimizer.state[want_param]
        assert set(got) == set(want) == keys
        for key in keys:
            assert _agree(got[key], want[key], device), (key, _gap(got[key], want[key]))
