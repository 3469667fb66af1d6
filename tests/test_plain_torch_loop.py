"""dl4py's single-device fit is a plain PyTorch training loop, in every precision policy.

Each test builds a network twice: as a dl4py MultiLayerNetwork, and as a ``torch.nn.Sequential``
written out by hand that starts from the dl4py network's initial weights. Both train on the
same batches; then their weights are compared. The hand-written loop is each policy's
textbook recipe: ``torch.autocast`` and a ``GradScaler`` (mixed-fp16, mixed-bf16); a 16-bit
model whose float32 master copies the optimizer steps, with a GradScaler for float16 (half,
bfloat16); the model in float64 (double). On the CPU the same operations in the same order
give the same bits; on CUDA they agree within ``tolerance(device)``.

Both sides use torch's for-loop optimizer (``fused_optimizer=off``: the fused kernels differ
from it by a rounding) and the default memory format (``channels_last=off``: on CUDA another
layout picks other cuDNN kernels); test_fast_path.py compares those settings with these.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F

from dl4py import (
    Adam,
    ArrayDataSetIterator,
    ConvolutionLayer,
    DenseLayer,
    InputType,
    MultiLayerNetwork,
    Nesterovs,
    NetworkConfig,
    OutputLayer,
    Sgd,
    SubsamplingLayer,
)
from dl4py.backend.cuda_environment import environment
from dl4py.backend.precision import NAMES

from devices import backend_for, on_devices, tolerance

L2 = 1e-3


def _mlp(updater) -> NetworkConfig:
    return NetworkConfig(layers=[DenseLayer(n_out=16, activation="relu"), OutputLayer(n_out=3)],
                         input_type=InputType.feed_forward(6), updater=updater, seed=4, l2=L2)


def _mlp_twin() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _conv(updater) -> NetworkConfig:
    return NetworkConfig(
        layers=[ConvolutionLayer(n_out=4, kernel_size=(3, 3), activation="relu"),
                SubsamplingLayer(pooling_type="max", kernel_size=(2, 2), stride=(2, 2)),
                DenseLayer(n_out=16, activation="tanh"), OutputLayer(n_out=3)],
        input_type=InputType.convolutional_flat(8, 8, 1), updater=updater, seed=3, l2=L2,
    )


def _conv_twin() -> torch.nn.Sequential:
    return torch.nn.Sequential(
        torch.nn.Unflatten(1, (1, 8, 8)), torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2, 2),
        torch.nn.Flatten(), torch.nn.Linear(36, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3),
    )


def _data(n: int, features: int):
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(n, features, generator=gen) * 2 - 1
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0.3).long()


def _optimizer(updater, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The updater as torch's own optimizer, by hand: L2 on weights (matrices), none on biases."""
    groups = [{"params": [p for p in params if p.dim() > 1], "weight_decay": L2},
              {"params": [p for p in params if p.dim() == 1], "weight_decay": 0.0}]
    if isinstance(updater, Nesterovs):
        return torch.optim.SGD(groups, lr=updater.learning_rate, momentum=updater.momentum, nesterov=True,
                               foreach=False)
    if isinstance(updater, Sgd):
        return torch.optim.SGD(groups, lr=updater.learning_rate, foreach=False)
    return torch.optim.Adam(groups, lr=updater.learning_rate, foreach=False)


def _plain_loop(twin, net, updater, x, y, epochs: int, batch: int, scaler):
    """Train ``twin`` as the PyTorch documentation's recipe for ``net``'s precision policy;
    returns the parameters the optimizer stepped (the float32 masters where there are some)."""
    policy, device = net.precision, net.device
    masters = twin.to(device)  # float32 as built
    model = masters
    if policy.master_weights:  # a 16-bit model for forward and backward
        model = copy.deepcopy(masters).to(policy.param_dtype)
    elif policy.name == "double":
        model = masters = masters.double()
    optimizer = _optimizer(updater, list(masters.parameters()))
    autocast = (torch.autocast(device.type, dtype=policy.autocast_dtype) if policy.autocast_dtype
                else contextlib.nullcontext())
    x, y = x.to(device, policy.param_dtype), y.to(device)
    for _ in range(epochs):
        for start in range(0, len(x), batch):
            optimizer.zero_grad(set_to_none=True)
            with autocast:
                scores = model(x[start:start + batch])
            loss = F.cross_entropy(scores.float() if scores.dtype != torch.float64 else scores,
                                   y[start:start + batch])
            (loss if scaler is None else scaler.scale(loss)).backward()
            if model is not masters:  # the 16-bit gradients become the masters'
                for low, high in zip(model.parameters(), masters.parameters()):
                    high.grad, low.grad = low.grad.float(), None
            if scaler is None:
                optimizer.step()
            else:
                scaler.step(optimizer)  # skipped where a gradient overflowed
                scaler.update()
            with torch.no_grad():
                for low, high in zip(model.parameters(), masters.parameters()):
                    low.copy_(high)
    return list(masters.parameters())


def _stepped(net) -> torch.nn.Module:
    """The module whose parameters the updater steps (the float32 masters where there are some)."""
    return net.stepped_module


def _twin_of(net, twin: torch.nn.Sequential) -> torch.nn.Sequential:
    """``twin`` (the same layers by hand, in the same order) holding ``net``'s initial weights."""
    weights = (p.detach().float().cpu() for p in _stepped(net).parameters())
    twin.load_state_dict(dict(zip(twin.state_dict(), weights)))
    return twin


def _skipped(scaler, initial: float) -> int:
    """Steps a GradScaler skipped: each halved its scale (it grows only after 2000 clean steps)."""
    if scaler is None:
        return 0
    return round(torch.log2(torch.tensor(initial / scaler.get_scale())).item())


def _needs(device: str, precision: str) -> None:
    if device == "cuda" and "bf" in precision and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bfloat16 needs a GPU of compute capability 8.0 or later")


def _compare(net, expected: list[torch.Tensor], device: str) -> None:
    """Equal on the CPU; on CUDA within ``tolerance``."""
    for (name, a), b in zip(_stepped(net).named_parameters(), expected):
        torch.testing.assert_close(a.detach().cpu(), b.detach().cpu(), **tolerance(device), msg=name)


@on_devices
@pytest.mark.parametrize("precision", NAMES)
def test_every_precision_policy_steps_as_the_pytorch_recipe(precision, device):
    _needs(device, precision)
    updater = Nesterovs(learning_rate=0.1, momentum=0.9)
    x, y = _data(96, 6)
    with environment().temporarily(fused_optimizer="off", channels_last="off"):
        net = MultiLayerNetwork(_mlp(updater), backend=backend_for(device), precision=precision).init()
    twin = _twin_of(net, _mlp_twin())
    scaler = torch.amp.GradScaler(device) if net.precision_state.scales_loss else None  # both at the default scale
    expected = _plain_loop(twin, net, updater, x, y, epochs=3, batch=16, scaler=scaler)
    net.fit(ArrayDataSetIterator(x, y, batch_size=16, shuffle=False), epochs=3, verbose=0)
    _compare(net, expected, device)
    assert net.update_count == 18 - _skipped(scaler, 2.0**16)






@on_devices
@pytest.mark.parametrize("precision", ["half", "mixed-fp16"])
def test_steps_skipped_for_an_overflow_are_skipped_as_the_pytorch_recipe_skips_them(precision, device):
    # A loss scale of 2**24 overflows fp16 gradients until the scaler has halved it enough:
    # the first steps are skipped, on both sides alike, and the rest applied.
    updater = Nesterovs(learning_rate=0.1, momentum=0.9)
    x, y = _data(96, 6)
    with environment().temporarily(fused_optimizer="off", channels_last="off"):
        net = MultiLayerNetwork(_mlp(updater), backend=backend_for(device), precision=precision).init()
    net.precision_state.set_loss_scale(2.0**24)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**24)
    expected = _plain_loop(_twin_of(net, _mlp_twin()), net, updater, x, y, epochs=3, batch=16, scaler=scaler)
    net.fit(ArrayDataSetIterator(x, y, batch_size=16, shuffle=False), epochs=3, verbose=0)
    _compare(net, expected, device)
    skipped = _skipped(scaler, 2.0**24)
    assert net.precision_state.loss_scale == scaler.get_scale() and 0 < skipped < 18
    assert net.update_count == 18 - skipped


@on_devices
@pytest.mark.parametrize("updater", [Sgd(0.1), Nesterovs(learning_rate=0.05, momentum=0.9), Adam(learning_rate=0.01)],
                         ids=["sgd", "nesterovs", "adam"])
def test_a_convolutional_network_steps_as_a_plain_pytorch_loop(updater, device):
    x, y = _data(96, 64)
    with environment().temporarily(fused_optimizer="off", channels_last="off"):
        net = MultiLayerNetwork(_conv(updater), backend=backend_for(device)).init()
    expected = _plain_loop(_twin_of(net, _conv_twin()), net, updater, x, y, epochs=3, batch=16, scaler=None)
    net.fit(ArrayDataSetIterator(x, y, batch_size=16, shuffle=False), epochs=3, verbose=0)
    _compare(net, expected, device)
