"""Layer families, forward and backward, on every device and in every precision policy: dense
layers, a convolution with batch normalization and max pooling, a strided convolution with
average pooling, stacked LSTMs, an LSTM's last step.

Each network runs one training-mode forward and backward as the training step does (the
policy's autocast, the loss in float32), on the device in the policy's dtypes, from the
weights of a float64 copy on the CPU. The output, the loss, the input's and the parameters'
gradients and batch normalization's running statistics must be the copy's within the
policy's rounding: the largest gap a small fraction of the tensor's largest element (for a
parameter's gradient, of the largest parameter gradient: a bias gradient that is a small sum
of cancelling terms keeps the rounding of those terms). Max pooling is left to the float32
tests (test_plain_torch_loop.py): a 16-bit rounding that changes which element is the maximum
moves its gradient to another pixel.
"""

from __future__ import annotations

import pytest
import torch

from dl4py import MultiLayerNetwork
from dl4py.config import (
    LSTM,
    BatchNormalization,
    ConvolutionLayer,
    DenseLayer,
    InputType,
    LastTimeStep,
    NetworkConfig,
    OutputLayer,
    RnnOutputLayer,
    Sgd,
    SubsamplingLayer,
)

from devices import backend_for, on_devices

FAMILIES = {  # name -> (input type, layers)
    "dense": (InputType.feed_forward(7), lambda: [
        DenseLayer(n_out=12, activation="relu"), DenseLayer(n_out=8, activation="tanh"), OutputLayer(n_out=3)]),
    "conv_batchnorm": (InputType.convolutional(9, 9, 2), lambda: [
        ConvolutionLayer(n_out=4, kernel_size=(3, 3), padding=(1, 1), activation="identity", has_bias=False),
        BatchNormalization(), SubsamplingLayer(pooling_type="avg", kernel_size=(2, 2), stride=(2, 2)),
        ConvolutionLayer(n_out=6, kernel_size=(2, 2), activation="tanh"), BatchNormalization(decay=0.8),
        DenseLayer(n_out=10, activation="tanh"), OutputLayer(n_out=3)]),
    "conv_strided": (InputType.convolutional_flat(12, 10, 1), lambda: [
        ConvolutionLayer(n_out=5, kernel_size=(3, 2), stride=(2, 2), activation="tanh"),
        SubsamplingLayer(pooling_type="avg", kernel_size=(2, 2), stride=(1, 1)),
        DenseLayer(n_out=8, activation="identity", has_bias=False), BatchNormalization(), OutputLayer(n_out=3)]),
    "lstm_stack": (InputType.recurrent(5, 7), lambda: [LSTM(n_out=8), LSTM(n_out=6), RnnOutputLayer(n_out=3)]),
    "lstm_last_step": (InputType.recurrent(4, 9), lambda: [LastTimeStep(LSTM(n_out=7)), OutputLayer(n_out=3)]),
}
# The largest gap allowed: about 3-10 times what the CPU shows for these batches. Float32 on
# CUDA gets float16's: cuDNN's TF32 convolutions keep its 10-bit mantissa.
GAP = {"float": 1e-5, "half": 1e-2, "mixed-fp16": 1e-2, "bfloat16": 6e-2, "mixed-bf16": 6e-2}
COMPUTES_IN = {"float": torch.float32, "half": torch.float16, "mixed-fp16": torch.float16,
               "bfloat16": torch.bfloat16, "mixed-bf16": torch.bfloat16}
_LOW = (torch.float16, torch.bfloat16)


def _pair(name: str, device: str, precision: str):
    """The network on ``device`` in ``precision`` and its float64 copy on the CPU, holding the
    same weights (the copy holds the device's roundings exactly)."""
    input_type, layers = FAMILIES[name]
    config = NetworkConfig(layers=layers(), input_type=input_type, updater=Sgd(0.1), seed=6)
    net = MultiLayerNetwork(config, backend=backend_for(device), precision=precision).init()
    reference = MultiLayerNetwork(config, backend="cpu", precision="double").init()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in reference.module.parameters():  # away from their initial zeros and ones
            p.add_(0.2 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        for ours, theirs in zip(net.module.state_dict().values(), reference.module.state_dict().values()):
            ours.copy_(theirs)
            theirs.copy_(ours)
    return net, reference


def _inputs(net, n: int = 6):
    gen = torch.Generator().manual_seed(2)
    shape = tuple(9 if d is None else d for d in net.config.input_type.example_shape())
    x = torch.randn((n,) + shape, generator=gen)
    last = net.config.layer_shapes()[-1]
    y = torch.randint(0, 3, (n, shape[0]) if isinstance(last.layer, RnnOutputLayer) else (n,), generator=gen)
    return x, y


def _forward_backward(net, x, y) -> tuple[dict[str, torch.Tensor], torch.dtype]:
    """What one training step's forward and backward make of ``x``, in float64 on the CPU,
    and the dtype the network's output was computed in."""
    module = net.module
    module.train()
    module.zero_grad(set_to_none=True)
    x = net.prepare_input(x.to(net.device)).detach().requires_grad_()
    with net.precision.forward_context(net.device):
        outputs = module(x)
    loss = net.loss(outputs.float() if outputs.dtype in _LOW else outputs, y.to(net.device))
    loss.backward()
    found = {"output": outputs, "loss": loss, "input gradient": x.grad}
    found.update({f"{name} gradient": p.grad for name, p in module.named_parameters()})
    found.update({name: b for name, b in module.named_buffers() if "running" in name})
    return {name: t.detach().double().cpu() for name, t in found.items()}, outputs.dtype


@on_devices
@pytest.mark.parametrize("precision", list(GAP))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_forward_and_backward_on_the_device_are_the_float64_ones_within_rounding(family, precision, device):
    if device == "cuda" and "bf" in precision and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bfloat16 needs a GPU of compute capability 8.0 or later")
    net, reference = _pair(family, device, precision)
    x, y = _inputs(net)
    got, dtype = _forward_backward(net, x, y)
    expected, _ = _forward_backward(reference, x.double(), y)
    assert dtype == COMPUTES_IN[precision]
    assert got.keys() == expected.keys()
    has_batchnorm = any(isinstance(layer, BatchNormalization) for layer in net.config.layers)
    assert any("running" in name for name in got) == has_batchnorm  # its running statistics compared too
    gap = GAP["half"] if (device, precision) == ("cuda", "float") else GAP[precision]
    gradients = max(v.abs().max().item() for name, v in expected.items() if _of_a_parameter(name))
    for name, value in expected.items():
        scale = gradients if _of_a_parameter(name) else value.abs().max().item()
        worst = (got[name] - value).abs().max().item()
        assert worst <= gap * scale, f"{name}: off by {worst:.3g}, {worst / scale:.3g} of {scale:.3g}"


def _of_a_parameter(name: str) -> bool:
    return name.endswith(" gradient") and name != "input gradient"
