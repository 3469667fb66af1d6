"""Average pooling with padding: the same gradients on CUDA, channels-last or not, as on the CPU.

PyTorch's CUDA backward of a padded average pooling is wrong for channels-last inputs
(pytorch/pytorch#188344); dl4py's pooling modules (nn/pooling.py) hand that kernel a
contiguous input. The CUDA cases show it on the path users take: a convolutional network on
CUDA runs channels-last by default, and a 1-D pooling's transposed sequence is channels-last
to PyTorch.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dl4py.config import (
    ConvolutionLayer,
    InputType,
    OutputLayer,
    RnnOutputLayer,
    Subsampling1DLayer,
    SubsamplingLayer,
)
from dl4py.nn import MultiLayerNetwork
from dl4py.nn.pooling import AvgPool1d, AvgPool2d
from test_layers_conv_extra import _conf


NETWORKS = {
    "2-D after a convolution": (
        lambda: _conf(InputType.convolutional(6, 6, 2), ConvolutionLayer(n_out=4, kernel_size=(3, 3), padding=(1, 1)),
                      SubsamplingLayer(pooling_type="avg", kernel_size=(3, 3), stride=(1, 1), padding=(1, 1)),
                      OutputLayer(n_out=3)),
        (4, 2, 6, 6)),
    "1-D over a sequence": (
        lambda: _conf(InputType.recurrent(4), Subsampling1DLayer(pooling_type="avg", kernel_size=3, stride=1,
                                                                 padding=1), RnnOutputLayer(n_out=3)),
        (4, 5, 4)),
}


def _gradients(conf, device: str, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    net = MultiLayerNetwork(conf, backend="gpu" if device == "cuda" else "cpu", precision="double").init()
    x = x.to(device).requires_grad_(True)
    loss = net.loss(net.module(x), y.to(device))
    loss.backward()
    grads = {name: p.grad.detach().cpu() for name, p in net.module.named_parameters()}
    grads["input"] = x.grad.detach().cpu()
    return grads


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(NETWORKS))
def test_a_padded_average_pooling_has_the_cpus_gradients_on_cuda(name):
    make, shape = NETWORKS[name]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    conf = make()
    with torch.no_grad():
        out = MultiLayerNetwork(conf, precision="double").init().module(x)
    y = torch.softmax(torch.randn(*out.shape, generator=g, dtype=torch.float64), dim=1)
    on_cpu, on_cuda = _gradients(conf, "cpu", x, y), _gradients(conf, "cuda", x, y)
    for key in on_cpu:
        assert torch.allclose(on_cuda[key], on_cpu[key], rtol=1e-9, atol=1e-12), key


@pytest.mark.parametrize("pool, plain, shape", [
    (AvgPool1d(3, 1, 1), nn.AvgPool1d(3, 1, 1), (2, 3, 7)),
    (AvgPool2d(3, 2, 1), nn.AvgPool2d(3, 2, 1), (2, 3, 7, 5)),
    (AvgPool2d(2, 2, 0), nn.AvgPool2d(2, 2, 0), (2, 3, 6, 4)),
])
def test_dl4pys_average_pooling_is_torchs_on_the_cpu(pool, plain, shape):
    """In channels-last (as a convolutional network now runs on a CPU too), against torch's
    pooling of the same values in NCHW: the property CUDA's kernel breaks with padding."""
    x = torch.randn(*shape, dtype=torch.float64).contiguous(
        memory_format=torch.channels_last if len(shape) == 4 else torch.contiguous_format).requires_grad_(True)
    x2 = x.detach().clone(memory_format=torch.contiguous_format).requires_grad_(True)
    out, expected = pool(x), plain(x2)
    assert torch.equal(out, expected)
    out.sum().backward()
    expected.sum().backward()
    assert torch.equal(x.grad, x2.grad)
