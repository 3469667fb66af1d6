"""DepthwiseConvolution2D, SeparableConvolution2D, Cropping2D/1D, ZeroPadding1DLayer, CnnLossLayer,
Same-mode pooling and 1-D windows, and the MAE loss: outputs against plain torch/numpy references,
gradients, shapes, configs, errors, masks, memory and ONNX export."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from dl4py.config import (
    Adam,
    CnnLossLayer,
    Convolution1DLayer,
    ConvolutionLayer,
    Cropping1D,
    Cropping2D,
    DepthwiseConvolution2D,
    GlobalPoolingLayer,
    InputType,
    NetworkConfig,
    OutputLayer,
    RnnOutputLayer,
    SeparableConvolution2D,
    Subsampling1DLayer,
    SubsamplingLayer,
    ZeroPadding1DLayer,
)
from dl4py.errors import ConfigError, DataError
from dl4py.nn import MultiLayerNetwork
from dl4py.nn.builder import build_module
from dl4py.nn.output_loss import OutputLoss

from devices import backend_for, on_devices


def _conf(input_type, *layers):
    builder = NetworkConfig.builder().seed(7).updater(Adam(learning_rate=0.01))
    for layer in layers:
        builder.layer(layer)
    return builder.input_type(input_type).build()


def _net(conf, device="cpu"):
    return MultiLayerNetwork(conf, backend=backend_for(device), precision="double").init()


def _module(conf):
    """The network's layers in double, without a network (some of these have no parameters to train)."""
    return build_module(conf, torch.Generator().manual_seed(0)).double()


def _randn(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ---- depthwise and separable convolution --------------------------------------------------------
def _depthwise_reference(x, weights_dl4j, bias, stride, padding, dilation):
    """DL4J's depthwise_conv2d from its weight layout [kH, kW, c, dm]: output channel c*dm + m is
    input channel c convolved with kernel [:, :, c, m], one F.conv2d per channel."""
    kh, kw, channels, dm = weights_dl4j.shape
    outputs = []
    for c in range(channels):
        for m in range(dm):
            kernel = weights_dl4j[:, :, c, m].reshape(1, 1, kh, kw)
            outputs.append(F.conv2d(x[:, c:c + 1], kernel, stride=stride, padding=padding, dilation=dilation))
    out = torch.cat(outputs, dim=1)
    return out if bias is None else out + bias.reshape(1, -1, 1, 1)


@pytest.mark.parametrize("dm, kernel, stride, padding, dilation", [
    (1, (3, 3), (1, 1), (0, 0), (1, 1)),
    (2, (3, 2), (2, 1), (1, 0), (1, 2)),
    (3, (2, 2), (1, 2), (1, 1), (2, 1)),
])
def test_depthwise_is_dl4js_per_channel_convolution_in_dl4js_channel_order(dm, kernel, stride, padding, dilation):
    conf = _conf(InputType.convolutional(9, 8, 3),
                 DepthwiseConvolution2D(depth_multiplier=dm, kernel_size=kernel, stride=stride, padding=padding,
                                        dilation=dilation, activation="identity"), CnnLossLayer())
    module = _module(conf)
    op = module[0].op
    weights_dl4j = _randn(kernel[0], kernel[1], 3, dm, seed=1)
    bias = _randn(3 * dm, seed=2)
    with torch.no_grad():  # DL4J's [kH, kW, c, dm] -> the module's [c*dm, 1, kH, kW]
        op.weight.copy_(weights_dl4j.permute(2, 3, 0, 1).reshape(3 * dm, 1, *kernel))
        op.bias.copy_(bias)
    assert set(module.state_dict()) == {"0.op.weight", "0.op.bias"}
    assert op.groups == 3 and tuple(op.weight.shape) == (3 * dm, 1) + kernel
    x = _randn(2, 3, 9, 8, seed=3)
    want = _depthwise_reference(x, weights_dl4j, bias, stride, padding, dilation)
    got = module(x)
    assert tuple(got.shape[1:]) == conf.layer_shapes()[0].output.dims
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_separable_is_depthwise_then_one_by_one():
    conf = _conf(InputType.convolutional(7, 6, 2),
                 SeparableConvolution2D(n_out=4, depth_multiplier=3, kernel_size=(3, 2), stride=(2, 1), padding=1,
                                        dilation=(1, 2), activation="tanh"), CnnLossLayer())
    net = _net(conf)
    op = net.module[0].op
    assert {k: tuple(v.shape) for k, v in net.module.state_dict().items()} == {
        "0.op.depthwise.weight": (6, 1, 3, 2), "0.op.pointwise.weight": (4, 6, 1, 1), "0.op.pointwise.bias": (4,)}
    with torch.no_grad():
        op.pointwise.bias.copy_(_randn(4, seed=5))
    x = _randn(3, 2, 7, 6, seed=4)
    # DL4J's depthwise weight [dm, c, kH, kW] as the per-channel reference takes it, [kH, kW, c, dm]
    dl4j_depthwise = op.depthwise.weight.detach().reshape(2, 3, 3, 2).permute(1, 0, 2, 3)
    depthwise = _depthwise_reference(x, dl4j_depthwise.permute(2, 3, 1, 0), None, (2, 1), (1, 1), (1, 2))
    pointwise = torch.einsum("nchw,oc->nohw", depthwise, op.pointwise.weight.detach()[:, :, 0, 0])
    want = torch.tanh(pointwise + op.pointwise.bias.detach().reshape(1, -1, 1, 1))
    got = net.module(x)
    assert tuple(got.shape[1:]) == conf.layer_shapes()[0].output.dims == (4, 4, 6)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_weights_start_with_dl4js_fans_and_no_bias_where_none_is_asked():
    conf = _conf(InputType.convolutional(6, 6, 16),
                 DepthwiseConvolution2D(depth_multiplier=4, kernel_size=3, weight_init="relu", has_bias=False),
                 CnnLossLayer())
    weight = _module(conf)[0].op.weight
    assert _module(conf)[0].op.bias is None
    # DL4J's fan in of a depthwise kernel is c * kH * kW = 144 (not torch's 9 of one channel).
    assert weight.std().item() == pytest.approx((2.0 / 144) ** 0.5, rel=0.1)


# ---- cropping and 1-D zero padding ---------------------------------------------------------------------
def test_cropping_and_zero_padding_are_slices_and_zeros():
    conf = _conf(InputType.convolutional(7, 9, 2), Cropping2D(cropping=(1, 2, 0, 3)), CnnLossLayer())
    x = _randn(2, 2, 7, 9)
    assert torch.equal(_module(conf)(x), x[:, :, 1:5, 0:6])
    assert Cropping2D(cropping=(1, 2)).cropping == (1, 1, 2, 2) and Cropping2D(cropping=3).cropping == (3, 3, 3, 3)

    seq = _conf(InputType.recurrent(3), Cropping1D(cropping=(2, 1)), ZeroPadding1DLayer(padding=(1, 3)),
                RnnOutputLayer(n_out=2))
    module = _module(seq)
    for time in (4, 7):
        x = _randn(2, time, 3, seed=time)
        cropped = module[0](x)
        assert torch.equal(cropped, x[:, 2:time - 1])
        padded = module[1](cropped)
        assert torch.equal(padded, torch.cat([torch.zeros(2, 1, 3, dtype=x.dtype), x[:, 2:time - 1],
                                              torch.zeros(2, 3, 3, dtype=x.dtype)], dim=1))
    assert Cropping1D(cropping=2).cropping == (2, 2) and ZeroPadding1DLayer(padding=1).padding == (1, 1)


def test_a_layer_that_changes_the_length_refuses_a_mask_naming_the_layer():
    for layer in (Cropping1D(cropping=(1, 0)), ZeroPadding1DLayer(padding=(0, 1))):
        net = _net(_conf(InputType.recurrent(3), Convolution1DLayer(n_out=3, kernel_size=1), layer,
                         RnnOutputLayer(n_out=2)))
        net.set_mask(torch.ones(2, 5, dtype=torch.float64))
        with pytest.raises(DataError, match=r"network\.layers\[1\]: this layer changes the sequence length"):
            net.module(_randn(2, 5, 3))


def test_a_sequence_cropped_to_nothing_is_named():
    net = _net(_conf(InputType.recurrent(3), Cropping1D(cropping=(2, 2)), RnnOutputLayer(n_out=2)))
    with pytest.raises(DataError, match=r"network\.layers\[0\]: cropping 2 \+ 2 steps leaves nothing"):
        net.module(_randn(1, 4, 3))


# ---- Same mode -------------------------------------------------------------------------------------------
def _same_reference_1d(x, kernel, stride, pooling):
    """numpy: DL4J's Same mode over the last axis, each window over its real elements only."""
    size = x.shape[-1]
    out_size = -(-size // stride)
    before = max((out_size - 1) * stride + kernel - size, 0) // 2
    out = []
    for o in range(out_size):
        start = o * stride - before
        window = x[..., max(start, 0):min(start + kernel, size)]
        out.append(window.max(axis=-1) if pooling == "max" else window.mean(axis=-1))
    return np.stack(out, axis=-1)


def _same_reference_2d(x, kernel, stride, pooling):
    h, w = x.shape[2:]
    out_h, out_w = -(-h // stride[0]), -(-w // stride[1])
    top = max((out_h - 1) * stride[0] + kernel[0] - h, 0) // 2
    left = max((out_w - 1) * stride[1] + kernel[1] - w, 0) // 2
    out = np.zeros(x.shape[:2] + (out_h, out_w))
    for i in range(out_h):
        for j in range(out_w):
            r, c = i * stride[0] - top, j * stride[1] - left
            window = x[:, :, max(r, 0):min(r + kernel[0], h), max(c, 0):min(c + kernel[1], w)]
            out[:, :, i, j] = window.max(axis=(2, 3)) if pooling == "max" else window.mean(axis=(2, 3))
    return out


@pytest.mark.parametrize("pooling", ["max", "avg"])
@pytest.mark.parametrize("kernel, stride", [((3, 3), (1, 1)), ((2, 3), (2, 2)), ((3, 2), (2, 1)), ((4, 4), (3, 2))])
@pytest.mark.parametrize("height, width", [(7, 6), (8, 9)])
def test_same_pooling_lets_no_padding_win_or_count(pooling, kernel, stride, height, width):
    conf = _conf(InputType.convolutional(height, width, 2),
                 SubsamplingLayer(pooling_type=pooling, kernel_size=kernel, stride=stride, convolution_mode="same"),
                 CnnLossLayer())
    x = _randn(3, 2, height, width) - 5.0  # all negative: a zero of padding would win a max
    got = _module(conf)(x)
    assert tuple(got.shape[1:]) == conf.layer_shapes()[0].output.dims
    np.testing.assert_allclose(got.numpy(), _same_reference_2d(x.numpy(), kernel, stride, pooling), rtol=1e-12)


@pytest.mark.parametrize("pooling", ["max", "avg"])
@pytest.mark.parametrize("kernel, stride", [(3, 1), (2, 2), (3, 2), (4, 3)])
def test_same_pooling_1d_follows_each_length(pooling, kernel, stride):
    conf = _conf(InputType.recurrent(3),
                 Subsampling1DLayer(pooling_type=pooling, kernel_size=kernel, stride=stride, convolution_mode="same"),
                 RnnOutputLayer(n_out=2))
    module = _module(conf)
    for time in (5, 6, 7, 1):
        x = _randn(2, time, 3, seed=time) - 5.0
        got = module[0](x)
        want = _same_reference_1d(x.transpose(1, 2).numpy(), kernel, stride, pooling).transpose(0, 2, 1)
        assert got.shape[1] == -(-time // stride)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-12)


@pytest.mark.parametrize("kernel, stride, dilation", [(3, 1, 1), (4, 2, 1), (2, 3, 2), (5, 2, 1)])
def test_same_convolution_1d_pads_zeros_as_dl4j(kernel, stride, dilation):
    conf = _conf(InputType.recurrent(3), Convolution1DLayer(n_out=2, kernel_size=kernel, stride=stride,
                                                            dilation=dilation, activation="identity",
                                                            convolution_mode="same"), RnnOutputLayer(n_out=2))
    net = _net(conf)
    conv = net.module[0].op.op
    assert set(net.module[0].state_dict()) == {"op.op.weight", "op.op.bias"}  # as in truncate mode
    for time in (6, 7, 2):
        x = _randn(2, time, 3, seed=time)
        span = dilation * (kernel - 1) + 1
        out = -(-time // stride)
        total = max((out - 1) * stride + span - time, 0)
        padded = F.pad(x.transpose(1, 2), (total // 2, total - total // 2))
        want = F.conv1d(padded, conv.weight, conv.bias, stride=stride, dilation=dilation).transpose(1, 2)
        torch.testing.assert_close(net.module[0](x), want, rtol=1e-12, atol=1e-12)
        assert want.shape[1] == out


@pytest.mark.parametrize("pooling", ["max", "avg"])
def test_same_windows_over_a_masked_batch_give_each_sequence_alone(pooling):
    conf = _conf(InputType.recurrent(3),
                 Subsampling1DLayer(pooling_type=pooling, kernel_size=4, stride=1, convolution_mode="same"),
                 Convolution1DLayer(n_out=2, kernel_size=3, convolution_mode="same", activation="identity"),
                 RnnOutputLayer(n_out=2))
    net = _net(conf)
    lengths, time = [6, 4, 2], 6
    seqs = [_randn(1, n, 3, seed=n) - 5.0 for n in lengths]
    x = torch.full((3, time, 3), 100.0, dtype=torch.float64)
    mask = torch.zeros(3, time, dtype=torch.float64)
    for i, s in enumerate(seqs):
        x[i, :lengths[i]] = s[0]
        mask[i, :lengths[i]] = 1
    net.set_mask(mask)
    batch = net.module[1](net.module[0](x))
    net.set_mask(None)
    for i, s in enumerate(seqs):
        alone = net.module[1](net.module[0](s))
        torch.testing.assert_close(batch[i, :lengths[i]], alone[0], rtol=1e-12, atol=1e-12)
        assert torch.all(batch[i, lengths[i]:] == 0)
    stride_two = MultiLayerNetwork(_conf(InputType.recurrent(3), Subsampling1DLayer(kernel_size=2, convolution_mode="same"),
                            RnnOutputLayer(n_out=2)), precision="double").init()
    stride_two.set_mask(mask)
    with pytest.raises(DataError, match=r"network\.layers\[0\]: this window changes the sequence length"):
        stride_two.module(x)


# ---- losses ---------------------------------------------------------------------------------------------
def test_mae_is_dl4js_mean_absolute_error():
    out = _net(_conf(InputType.feed_forward(4), OutputLayer(n_out=3, loss="mae")))
    scores, labels = _randn(5, 3, seed=1), _randn(5, 3, seed=2)
    # LossMAE: per example sum |y - p| / n_out, then the mean over the examples
    want = np.mean(np.abs(labels.numpy() - scores.numpy()).sum(axis=1) / 3)
    assert out.loss(scores, labels).item() == pytest.approx(want, rel=1e-12)
    seq = _net(_conf(InputType.recurrent(4), RnnOutputLayer(n_out=3, loss="mae", activation="tanh")))
    scores, labels = _randn(2, 5, 3, seed=3), _randn(2, 5, 3, seed=4)
    want = np.mean(np.abs(labels.numpy() - np.tanh(scores.numpy())))
    assert seq.loss(scores, labels).item() == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("activation, loss", [("softmax", "mcxent"), ("identity", "mae"), ("sigmoid", "mse"),
                                              ("softmax", "negativeloglikelihood")])
def test_cnn_loss_is_dl4js_score_summed_over_pixels(activation, loss):
    layer = CnnLossLayer(activation=activation, loss=loss)
    scores = _randn(2, 3, 4, 5, seed=1)
    labels = torch.softmax(_randn(2, 3, 4, 5, seed=2), dim=1)
    s, y = scores.numpy(), labels.numpy()
    if activation == "softmax":
        p = np.exp(s) / np.exp(s).sum(axis=1, keepdims=True)
    elif activation == "sigmoid":
        p = 1 / (1 + np.exp(-s))
    else:
        p = s
    if loss in ("mcxent", "negativeloglikelihood"):
        per_pixel = -(y * np.log(p)).sum(axis=1)
    else:
        per_pixel = (np.abs(y - p) if loss == "mae" else (y - p) ** 2).mean(axis=1)
    # CnnLossLayer.computeScore: the 2-D score of all [n*h*w, c] rows, summed, over the minibatch size
    want = per_pixel.sum() / 2
    assert OutputLoss(layer)(scores, labels).item() == pytest.approx(want, rel=1e-10)
    # In a network: the output is the input's shape, the activation applied
    net = _net(_conf(InputType.convolutional(4, 5, 2), ConvolutionLayer(n_out=3, kernel_size=1), layer))
    x = _randn(2, 2, 4, 5, seed=3)
    output = net.output(x)
    torch.testing.assert_close(output, OutputLoss(layer).activate(net.module(x)))
    assert output.shape == scores.shape
    if activation == "softmax":  # over the channels, at every pixel
        torch.testing.assert_close(output.sum(dim=1), torch.ones(2, 4, 5, dtype=torch.float64))


def test_cnn_loss_takes_no_dense_fields_and_must_be_last():
    layer = CnnLossLayer()
    assert (layer.activation, layer.resolved_activation(), layer.loss) == (None, "identity", "mcxent")
    assert layer.to_dict() == {"type": "cnn_loss", "activation": None, "loss": "mcxent"}
    assert not layer.has_params
    with pytest.raises(ConfigError, match=r"network\.layers\[0\]\.n_out: unknown field for CnnLossLayer"):
        NetworkConfig.from_dict({"input_type": {"type": "convolutional", "height": 2, "width": 2, "channels": 1},
                                 "layers": [{"type": "cnn_loss", "n_out": 3}]})
    with pytest.raises(ConfigError, match=r"network\.layers\[0\]: an output layer must be the last layer"):
        _conf(InputType.convolutional(4, 4, 1), CnnLossLayer(), GlobalPoolingLayer(), OutputLayer(n_out=2))
    with pytest.raises(ConfigError, match=r"network\.layers\[1\]: cnn_loss needs convolutional input"):
        _conf(InputType.convolutional(4, 4, 1), GlobalPoolingLayer(), CnnLossLayer())


# ---- gradients ------------------------------------------------------------------------------------------
GRADIENT_CASES = {
    "depthwise_separable": lambda: _conf(
        InputType.convolutional(7, 6, 2),
        DepthwiseConvolution2D(depth_multiplier=2, kernel_size=(3, 2), stride=(2, 1), padding=1, activation="tanh"),
        SeparableConvolution2D(n_out=3, depth_multiplier=2, kernel_size=2, dilation=(1, 2), activation="sigmoid"),
        CnnLossLayer(activation="softmax")),
    "same_pooling_crop": lambda: _conf(
        InputType.convolutional(7, 8, 2), ConvolutionLayer(n_out=3, kernel_size=2, activation="tanh"),
        SubsamplingLayer(pooling_type="avg", kernel_size=3, stride=2, convolution_mode="same"),
        SubsamplingLayer(kernel_size=2, stride=1, convolution_mode="same"), Cropping2D(cropping=(1, 0, 0, 1)),
        CnnLossLayer(loss="mae")),
    "same_windows_1d": lambda: _conf(
        InputType.recurrent(3), Convolution1DLayer(n_out=4, kernel_size=4, stride=2, convolution_mode="same",
                                                   activation="tanh"),
        ZeroPadding1DLayer(padding=(1, 2)), Subsampling1DLayer(pooling_type="avg", kernel_size=3, stride=2,
                                                               convolution_mode="same"),
        Subsampling1DLayer(kernel_size=2, stride=1, convolution_mode="same"), Cropping1D(cropping=(1, 0)),
        RnnOutputLayer(n_out=3, loss="mae")),
}


@on_devices
@pytest.mark.parametrize("name", sorted(GRADIENT_CASES))
def test_gradients_match_finite_differences(name, device):
    conf = GRADIENT_CASES[name]()
    net = _net(conf, device)
    shape = tuple(9 if d is None else d for d in conf.input_type.example_shape())
    x = _randn(3, *shape, seed=1).to(device)
    with torch.no_grad():
        out = net.module(x)
    y = (torch.softmax(_randn(*out.shape, seed=2), dim=1) if out.dim() == 4 else _randn(*out.shape, seed=2)).to(device)
    names = [n for n, _ in net.module.named_parameters()]

    def loss(features, *params):
        return net.loss(functional_call(net.module, dict(zip(names, params)), (features,)), y)

    params = tuple(p.detach().clone().requires_grad_(True) for p in net.module.parameters())
    # On CUDA, pooling's backward over overlapping windows adds with atomics: two backwards
    # differ in the last bits (same_pooling_crop did on an H200), as in test_layers_extra.py.
    assert torch.autograd.gradcheck(loss, (x.requires_grad_(True),) + params, eps=1e-6, atol=1e-5, fast_mode=True,
                                    nondet_tol=1e-12 if device == "cuda" else 0.0)


# ---- shapes and config as data ------------------------------------------------------------------------------
@on_devices
@pytest.mark.parametrize("name", sorted(GRADIENT_CASES))
def test_output_shapes_match_inferred_shapes(name, device):
    conf = GRADIENT_CASES[name]()
    net = _net(conf, device)
    for time in (9, 10, 13):
        shape = tuple(time if d is None else d for d in conf.input_type.example_shape())
        x = _randn(2, *shape).to(device)
        for shapes, module in zip(conf.layer_shapes(), net.module):
            x = module(x)
            if shapes.output.kind == "rnn" and shapes.output.dims[0] is None:
                assert x.shape[2] == shapes.output.dims[1]
            else:
                assert tuple(x.shape[1:]) == shapes.output.dims, (name, shapes.index)
    fixed = _conf(InputType.recurrent(3, 10), *GRADIENT_CASES["same_windows_1d"]().layers)
    assert [s.output.dims[0] for s in fixed.layer_shapes()] == [5, 8, 4, 4, 3, 3]


@pytest.mark.parametrize("name", sorted(GRADIENT_CASES))
def test_yaml_and_json_round_trip(name):
    conf = GRADIENT_CASES[name]()
    assert NetworkConfig.from_yaml(conf.to_yaml()) == conf
    assert NetworkConfig.from_json(conf.to_json()) == conf


def test_yaml_names_and_short_forms():
    conf = NetworkConfig.from_yaml("""
input_type: {type: convolutional, height: 9, width: 9, channels: 2}
layers:
  - {type: DepthwiseConvolution2D, depth_multiplier: 2, kernel_size: 3}
  - {type: subsampling, kernel_size: 3, stride: 2, convolution_mode: Same}
  - {type: cropping2d, cropping: [1, 0]}
  - {type: CnnLoss, activation: SOFTMAX, loss: MAE}
""")
    assert conf.layers[1].convolution_mode == "same" and conf.layers[2].cropping == (1, 1, 0, 0)
    assert (conf.layers[3].activation, conf.layers[3].loss) == ("softmax", "mae")
    assert [str(s.output) for s in conf.layer_shapes()] == ["4x7x7", "4x4x4", "4x2x4", "4x2x4"]


# ---- errors -------------------------------------------------------------------------------------------------
CNN = {"type": "convolutional", "height": 5, "width": 5, "channels": 2}
SEQ = {"type": "recurrent", "size": 3, "length": 6}


@pytest.mark.parametrize("input_type, layer, key, words", [
    (CNN, {"type": "depthwise_convolution2d", "depth_multiplier": 0}, "depth_multiplier", "must be positive"),
    (CNN, {"type": "depthwise_convolution2d", "kernel_size": 6}, "kernel_size", "spans 6"),
    (CNN, {"type": "depthwise_convolution2d", "padding": -1}, "padding", "zero or more"),
    (CNN, {"type": "depthwise_convolution2d", "l2": -1}, "l2", "zero or more"),
    (CNN, {"type": "separable_convolution2d", "n_out": 0}, "n_out", "must be positive"),
    (CNN, {"type": "separable_convolution2d"}, "n_out", "required"),
    (CNN, {"type": "separable_convolution2d", "n_out": 2, "dilation": [1, 0]}, "dilation", "must be positive"),
    (CNN, {"type": "cropping2d", "cropping": [1, 2, 3]}, "cropping", "list of 4"),
    (CNN, {"type": "cropping2d", "cropping": [-1, 0]}, "cropping", "zero or more"),
    (CNN, {"type": "cropping2d", "cropping": [2, 3, 0, 0]}, "cropping", "crops away the whole input"),
    (SEQ, {"type": "cropping1d", "cropping": [3, 3]}, "cropping", "crops away the whole sequence of 6"),
    (SEQ, {"type": "cropping1d", "cropping": [1, 2, 3]}, "cropping", "list of 2"),
    (SEQ, {"type": "zero_padding1d", "padding": -2}, "padding", "zero or more"),
    (CNN, {"type": "subsampling", "convolution_mode": "same", "padding": 1}, "padding", "must be 0 in"),
    (CNN, {"type": "subsampling", "convolution_mode": "causal"}, "convolution_mode", "one of 'truncate', 'same'"),
    (SEQ, {"type": "subsampling1d", "convolution_mode": "same", "padding": 1}, "padding", "must be 0 in"),
    (SEQ, {"type": "convolution1d", "n_out": 2, "convolution_mode": "same", "padding": 1}, "padding", "must be 0 in"),
])
def test_bad_fields_are_named_by_key_path(input_type, layer, key, words):
    last = {"type": "cnn_loss"} if input_type is CNN else {"type": "rnn_output", "n_out": 2}
    with pytest.raises(ConfigError) as error:
        NetworkConfig.from_dict({"input_type": input_type, "layers": [layer, last]})
    assert str(error.value).startswith(f"network.layers[0].{key}"), str(error.value)
    assert words in str(error.value), str(error.value)


@pytest.mark.parametrize("input_type, layer, words", [
    (SEQ, {"type": "depthwise_convolution2d"}, "cannot take recurrent input"),
    (CNN, {"type": "cropping1d", "cropping": 1}, "cropping1d needs recurrent input"),
    (CNN, {"type": "zero_padding1d", "padding": 1}, "zero_padding1d needs recurrent input"),
])
def test_a_layer_given_the_wrong_input_is_named(input_type, layer, words):
    with pytest.raises(ConfigError) as error:
        NetworkConfig.from_dict({"input_type": input_type, "layers": [layer, {"type": "rnn_output", "n_out": 2}]})
    assert str(error.value).startswith("network.layers[0]:") and words in str(error.value), str(error.value)


# ---- memory and export ----------------------------------------------------------------------------------------
MEMORY_CASES = {
    "cnn": lambda: _conf(InputType.convolutional(11, 10, 3),
                         DepthwiseConvolution2D(depth_multiplier=2, kernel_size=3, activation="relu"),
                         SubsamplingLayer(kernel_size=3, stride=2, convolution_mode="same"),
                         SeparableConvolution2D(n_out=5, depth_multiplier=2, kernel_size=3, padding=1,
                                                activation="tanh"),
                         SubsamplingLayer(pooling_type="avg", kernel_size=2, stride=2, convolution_mode="same"),
                         Cropping2D(cropping=(1, 0)), GlobalPoolingLayer(pooling_type="avg"), OutputLayer(n_out=3)),
    "cnn_fitting_windows": lambda: _conf(InputType.convolutional(8, 8, 4),
                                         SubsamplingLayer(kernel_size=2, stride=2, convolution_mode="same"),
                                         SubsamplingLayer(pooling_type="avg", kernel_size=2, stride=2,
                                                          convolution_mode="same"),
                                         GlobalPoolingLayer(), OutputLayer(n_out=3, loss="mae")),
    # Each one layer's tensors the most of the step: the separable convolution's depthwise result,
    # Same average pooling's quotient, the cropped copy.
    "separable": lambda: _conf(InputType.convolutional(24, 24, 3),
                               SeparableConvolution2D(n_out=2, depth_multiplier=6, kernel_size=3, activation="relu"),
                               GlobalPoolingLayer(pooling_type="avg"), OutputLayer(n_out=3)),
    "same_average": lambda: _conf(InputType.convolutional(24, 24, 2), ConvolutionLayer(n_out=8, kernel_size=1),
                                  SubsamplingLayer(pooling_type="avg", kernel_size=3, stride=1,
                                                   convolution_mode="same"),
                                  GlobalPoolingLayer(pooling_type="avg"), OutputLayer(n_out=3)),
    "crop": lambda: _conf(InputType.convolutional(24, 24, 2), ConvolutionLayer(n_out=8, kernel_size=1),
                          Cropping2D(cropping=(1, 2)), ConvolutionLayer(n_out=8, kernel_size=1),
                          GlobalPoolingLayer(pooling_type="avg"), OutputLayer(n_out=3)),
    # The CNN loss layer's scores and labels are [c, h, w] per example (cross entropies exact;
    # mse and mae are counted as the classification losses are: 1.055 and 0.864 of the peak).
    "cnn_loss": lambda: _conf(InputType.convolutional(32, 32, 3),
                              ConvolutionLayer(n_out=4, kernel_size=3, padding=1, activation="relu"),
                              ConvolutionLayer(n_out=3, kernel_size=3, padding=1, activation="identity"),
                              CnnLossLayer(activation="softmax", loss="mcxent")),
    "sequence": lambda: _conf(InputType.recurrent(6, 21),
                              Convolution1DLayer(n_out=8, kernel_size=4, stride=2, convolution_mode="same",
                                                 activation="relu"),
                              ZeroPadding1DLayer(padding=(1, 2)),
                              Subsampling1DLayer(pooling_type="avg", kernel_size=3, stride=2, convolution_mode="same"),
                              Subsampling1DLayer(kernel_size=2, stride=1, convolution_mode="same"),
                              Cropping1D(cropping=(1, 0)), RnnOutputLayer(n_out=3, loss="mae")),
}


@pytest.mark.parametrize("name", sorted(MEMORY_CASES))
def test_memory_estimate_is_within_5_percent_of_the_measured_peak(name):
    from dl4py.memory import estimate
    from dl4py.memory.measure import measure_training_step

    conf = MEMORY_CASES[name]()
    net = MultiLayerNetwork(conf, backend="cpu").init()
    g = torch.Generator().manual_seed(5)
    x = torch.randn((16,) + tuple(conf.input_type.example_shape()), generator=g)
    with torch.no_grad():
        out = net.module(x)
    y = torch.randint(0, 3, (16,), generator=g) if out.dim() == 2 else torch.randn(out.shape, generator=g)
    measured = measure_training_step(net, x, y)
    assert estimate(conf, 16, device="cpu").peak_bytes == pytest.approx(measured.peak_bytes, rel=0.05)


@pytest.mark.parametrize("name", ["cnn", "sequence"])
def test_onnx_export_answers_as_output(name, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    from dl4py.export import export

    layers = list(MEMORY_CASES[name]().layers)
    if name == "cnn":
        layers = layers[:5] + [CnnLossLayer(activation="softmax")]  # the loss layer's softmax in the file
    conf = _conf(MEMORY_CASES[name]().input_type, *layers)
    net = MultiLayerNetwork(conf, backend="cpu").init()
    path = export(net, tmp_path / "model.onnx")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch in (1, 3):
        x = torch.randn((batch,) + tuple(conf.input_type.example_shape()), generator=torch.Generator().manual_seed(2))
        got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
        np.testing.assert_allclose(got, net.output(x).numpy(), rtol=0, atol=1e-5)


def test_the_new_convolutions_are_dl4pys_16bit_aware_convolutions():
    from dl4py.nn.convolution import Conv1d, Conv2d

    conf = GRADIENT_CASES["depthwise_separable"]()
    wide = MultiLayerNetwork(conf, backend="cpu", precision="float").init()
    narrow = MultiLayerNetwork(conf, backend="cpu", precision="bfloat16").init()
    separable = narrow.module[1].op
    assert all(isinstance(m, Conv2d) for m in (narrow.module[0].op, separable.depthwise, separable.pointwise))
    assert isinstance(_module(GRADIENT_CASES["same_windows_1d"]())[0].op.op, Conv1d)
    x = torch.randn(4, 2, 7, 6, generator=torch.Generator().manual_seed(1))
    # The same weights (same seed), rounded to bfloat16: the outputs within its rounding.
    torch.testing.assert_close(narrow.output(x).float(), wide.output(x), rtol=0, atol=2e-2)


def test_a_cnn_loss_network_trains_on_per_pixel_targets_and_names_wrong_labels():
    """Labels [n, c, h, w] (the output's shape), as DL4J's CnnLossLayer takes them: fit learns a
    per-pixel mapping; labels of another shape or integer labels are one DataError naming it."""
    conf = NetworkConfig(layers=[ConvolutionLayer(n_out=2, kernel_size=3, padding=1, activation="identity"),
                                 CnnLossLayer(loss="mae")], input_type=InputType.convolutional(6, 6, 1), seed=1,
                         updater=Adam(learning_rate=0.05))
    net = MultiLayerNetwork(conf).init()
    x = torch.randn(64, 1, 6, 6, generator=torch.Generator().manual_seed(3))
    history = net.fit(x, torch.cat([x, -x], dim=1), epochs=5, verbose=0)
    assert history.history["loss"][-1] < 0.6 * history.history["loss"][0]
    evaluation = net.evaluate((x, torch.cat([x, -x], dim=1)))  # every pixel a row of 2 columns, as DL4J
    out = net.output(x)
    assert evaluation.mean_absolute_error(0) == pytest.approx(float((out[:, 0] - x[:, 0]).abs().mean()), rel=1e-5)
    with pytest.raises(DataError, match=r"labels have shape \[32, 3, 6, 6\] \(torch\.float32\) but cnn_loss needs "
                                        r"float targets \[32, 2, 6, 6\]"):
        net.fit(x, torch.randn(64, 3, 6, 6), verbose=0)
    with pytest.raises(DataError, match=r"a cnn_loss layer takes float targets \[n, channels, height, width\]"):
        net.fit(x, torch.zeros(64, 2, 6, 6, dtype=torch.int64), verbose=0)
