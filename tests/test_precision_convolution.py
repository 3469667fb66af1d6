"""16-bit convolutions on CPUs without native 16-bit arithmetic (nn/convolution.py): LeNet in
bfloat16 avoids PyTorch's slow kernel, each convolution is the float32 one rounded and agrees
with PyTorch's own 16-bit kernel, and under autocast the float32 path computes what autocast would."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dl4py import MultiLayerNetwork, RunConfig

LENET = RunConfig.from_file(Path(__file__).resolve().parents[1] / "examples" / "lenet_mnist.yaml").network


def _upcasting(dtype):
    from dl4py.nn.convolution import upcasts_on_cpu

    return pytest.mark.skipif(not upcasts_on_cpu(dtype), reason=f"this CPU has native {dtype} convolutions, "
                                                                "so PyTorch's own kernel runs")


def _conv_ops(step) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        step()
    return {event.name for event in profile.events() if "conv" in event.name}


@_upcasting(torch.bfloat16)
@pytest.mark.parametrize("precision", ["bfloat16", "mixed-bf16"])
def test_16bit_lenet_convolves_in_float32_not_in_the_slow_kernel(precision):
    net = MultiLayerNetwork(LENET, precision=precision).init()
    reference = MultiLayerNetwork(LENET, precision="float").init()
    conv = net.module[0].op
    assert isinstance(conv, torch.nn.Conv2d) and list(net.module.state_dict()) == list(reference.module.state_dict())
    gen = torch.Generator().manual_seed(0)
    x, y = torch.rand(40, 784, generator=gen), torch.randint(0, 10, (40,), generator=gen)
    ops = _conv_ops(lambda: net.fit((x, y), batch_size=40, verbose=0))
    assert "aten::mkldnn_convolution" in ops and "aten::convolution_backward" in ops, ops
    assert not any("slow_conv" in name or "thnn_conv" in name for name in ops), ops
    assert conv.weight.dtype == (torch.bfloat16 if precision == "bfloat16" else torch.float32)


def _conv_cases():
    from dl4py.nn.convolution import Conv1d, Conv2d, ConvTranspose2d

    return {
        "conv2d": (lambda: Conv2d(4, 6, 3, stride=2, padding=1, groups=2), (40, 4, 9, 9)),
        "dilated conv2d": (lambda: Conv2d(3, 5, 3, padding=2, dilation=2, bias=False), (40, 3, 8, 8)),
        "conv1d": (lambda: Conv1d(5, 7, 3, padding=1), (40, 5, 20)),
        "conv_transpose2d": (lambda: ConvTranspose2d(6, 4, 4, stride=2, padding=1), (40, 6, 7, 7)),
    }


def _run(module, x, grad):
    x = x.clone().requires_grad_()
    y = module(x)
    y.backward(grad.to(y.dtype))
    return [y, x.grad] + [p.grad for p in module.parameters()]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", ["conv2d", "dilated conv2d", "conv1d", "conv_transpose2d"])
def test_a_16bit_convolution_is_the_float32_one_rounded_and_agrees_with_the_16bit_kernel(case, dtype, monkeypatch):
    from dl4py.nn import convolution
    from dl4py.nn.convolution import upcasts_on_cpu

    monkeypatch.setattr(convolution, "CHUNK_BYTES", 2**15)  # several chunks of these 40 examples
    make, shape = _conv_cases()[case]
    gen = torch.Generator().manual_seed(3)
    torch.manual_seed(3)
    wide = make()  # float32 reference: the same module class, float32 path
    ours = make().to(dtype)
    ours.load_state_dict(wide.state_dict())
    wide.load_state_dict(ours.state_dict())  # the float32 module holds the 16-bit values exactly
    kernel = getattr(torch.nn, type(ours).__name__)(*_args(ours)).to(dtype)  # PyTorch's own 16-bit kernel
    kernel.load_state_dict(ours.state_dict())
    x = torch.randn(shape, generator=gen).to(dtype)
    out_shape = wide(x.float()).shape
    grad = torch.randn(out_shape, generator=gen).to(dtype)
    expected = _run(wide, x.float(), grad.float())
    got = _run(ours, x, grad)
    slow = _run(kernel, x, grad)
    eps = torch.finfo(dtype).eps
    for name, g, e, s in zip(["result", "input gradient", "weight gradient", "bias gradient"], got, expected, slow):
        assert g.dtype == dtype and g.shape == e.shape, name
        scale = e.abs().max().item()
        if upcasts_on_cpu(dtype):
            if name in ("result", "input gradient"):  # each element is one float32 sum, rounded once
                assert torch.equal(g, e.to(dtype)), name
            else:  # summed over the chunks in float32, then rounded
                assert (g.float() - e).abs().max().item() <= eps * scale, name
        # Within 16-bit rounding of PyTorch's own 16-bit kernel (which sums partly in 16 bits).
        assert (g.float() - s.float()).abs().max().item() <= 8 * eps * scale, name


def _args(conv):
    """The constructor arguments of a convolution module, for its plain torch twin."""
    return (conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding) + (
        (conv.output_padding, conv.groups, conv.bias is not None, conv.dilation)
        if conv.transposed else (conv.dilation, conv.groups, conv.bias is not None))


@_upcasting(torch.bfloat16)
def test_under_autocast_the_float32_path_computes_what_autocast_would():
    from dl4py.nn.convolution import Conv2d

    torch.manual_seed(4)
    plain, ours = torch.nn.Conv2d(3, 8, 3), Conv2d(3, 8, 3)
    ours.load_state_dict(plain.state_dict())
    x = torch.randn(36, 3, 10, 10)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = plain(x), ours(x)
        ops = _conv_ops(lambda: ours(x).float().sum().backward())
    assert not any("slow_conv" in name or "thnn_conv" in name for name in ops), ops
    assert got.dtype == expected.dtype == torch.bfloat16
    assert (got.float() - expected.float()).abs().max() <= torch.finfo(torch.bfloat16).eps * expected.abs().max()
    expected.float().sum().backward()
    ours.zero_grad()
    got.float().sum().backward()
    assert ours.weight.grad.dtype == torch.float32  # the float parameters get float gradients
    for a, b in ((ours.weight.grad, plain.weight.grad), (ours.bias.grad, plain.bias.grad)):
        assert (a - b).abs().max() <= 8 * torch.finfo(torch.bfloat16).eps * b.abs().max()
