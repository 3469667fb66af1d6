"""More DL4J layer types in the importer (``dl4py.import_dl4j``): 1-D convolution and pooling
(Same mode too), transposed 2-D convolution, self-attention, SimpleRnn and Bidirectional.

For each: a 1.0-dialect network written here with coefficients 1, 2, ..., N, and the place of
every value asserted against tensors written from DL4J's layout rules (its ``*ParamInitializer``
sources, not the importer's code); then the imported network's output against DL4J's equations
written out in numpy (libnd4j's conv1d, deconv2d, multi_head_dot_product_attention; the layers'
``activate``), in double precision, to 1e-10. DL4J's own files check what DL4J wrote: the 1-D
convolution's gradient arrays of ``CNN1dCharacterTestCase`` (1.0.0-beta7), and the output of
``SyntheticBidirectionalRNNGraph`` (1.0.0-beta4) reproduced from the laid-out parameters.
Refusals are one line naming the file, the layer index and the Java class. CPU only.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from dl4py import InputType
from dl4py.dl4j import (
    DL4JFileError,
    import_dl4j,
    param_slots,
    plan_import,
    read_array,
    read_dl4j_configuration,
    write_array,
)
from dl4py.dl4j.config_json import read_configuration
from dl4py.dl4j.param_layout import join_parameters, split_parameters
from test_dl4j_import import _activation, _layer, _network_zip
from dl4j_data import sigmoid

MODELS = Path(__file__).resolve().parents[1].parent / "shared" / "dl4j-models"
LAYERS = "org.deeplearning4j.nn.conf.layers."
MSE = {"@class": "org.nd4j.linalg.lossfunctions.impl.LossMSE"}
RTOL, ATOL = 1e-10, 1e-12
needs_dl4j_files = pytest.mark.skipif(not MODELS.is_dir(), reason=f"needs DL4J's files in {MODELS}")


def _rnn_output(n_in: int, n_out: int) -> dict:
    return _layer("RnnOutputLayer", nin=n_in, nout=n_out, activationFn=_activation("Identity"), lossFn=MSE)


def _dense_f(values: np.ndarray, n_in: int, n_out: int) -> np.ndarray:
    """DefaultParamInitializer's W: [nIn, nOut] in Fortran order."""
    return values.reshape(n_in, n_out, order="F")


def _per_step(h_ncw: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """RnnOutputLayer (identity) on DL4J's [batch, size, time]: dl4py's [batch, time, n_out]."""
    return np.einsum("bit,io->bto", h_ncw, w) + b


def _output(net, x_nwc: np.ndarray) -> np.ndarray:
    return net.output(torch.from_numpy(x_nwc)).numpy()


def _one_line(exc: pytest.ExceptionInfo) -> None:
    assert "\n" not in str(exc.value), str(exc.value)


# ---- 1-D convolution and pooling --------------------------------------------------------------------

def _conv1d(x: np.ndarray, w: np.ndarray, b: np.ndarray, stride: int, pad: int, dilation: int) -> np.ndarray:
    """libnd4j's conv1d (a conv2d over [time, 1]) on DL4J's [batch, channels, time]:
    out[o, t] = b[o] + sum over c, k of W[o, c, k] x[c, t * stride + k * dilation - pad]."""
    padded = np.pad(x, ((0, 0), (0, 0), (pad, pad)))
    span = (w.shape[2] - 1) * dilation + 1
    steps = (padded.shape[2] - span) // stride + 1
    out = np.empty((x.shape[0], w.shape[0], steps))
    for t in range(steps):
        window = padded[:, :, t * stride:t * stride + span:dilation]  # [batch, c, k]
        out[:, :, t] = np.einsum("bck,ock->bo", window, w) + b
    return out


def _conv1d_layer(n_in: int, n_out: int, kernel: int, **fields) -> dict:
    settings = dict(kernelSize=[kernel, 1], stride=[1, 1], padding=[0, 0], dilation=[1, 1],
                    convolutionMode="Truncate", activationFn=_activation("TanH"), hasBias=True)
    settings.update(fields)
    return _layer("Convolution1DLayer", nin=n_in, nout=n_out, **settings)


def test_a_1d_convolution_lays_out_bias_first_then_nout_nin_k_1_in_c_order(tmp_path):
    """ConvolutionParamInitializer on a Convolution1DLayer: b [nOut], then W [nOut, nIn, k, 1] in C
    order; nn.Conv1d's weight is [nOut, nIn, k]."""
    layers = [_conv1d_layer(3, 4, 3), _rnn_output(4, 2)]
    count = 4 + 4 * 3 * 3 + 4 * 2 + 2
    net = import_dl4j(_network_zip(tmp_path, layers, np.arange(1.0, count + 1)))
    state = {name: t.numpy() for name, t in net.module.state_dict().items()}
    assert [layer.type_name for layer in net.config.layers] == ["convolution1d", "rnn_output"]
    np.testing.assert_array_equal(state["0.op.op.bias"], [1, 2, 3, 4])
    weight = np.array([[[5 + (o * 3 + c) * 3 + k for k in range(3)] for c in range(3)] for o in range(4)])
    np.testing.assert_array_equal(state["0.op.op.weight"], weight)
    first = 5 + 36  # RnnOutputLayer: W [4, 2] Fortran order (W[i, j] = first + i + 4 j), then b
    np.testing.assert_array_equal(state["1.op.weight"], [[first + i + 4 * j for i in range(4)] for j in range(2)])
    np.testing.assert_array_equal(state["1.op.bias"], [first + 8, first + 9])
    assert set(state) == {"0.op.op.bias", "0.op.op.weight", "1.op.weight", "1.op.bias"}


@pytest.mark.parametrize("mode, stride, padding, dilation, expected_padding", [
    ("Truncate", 2, 1, 1, 1),
    ("Same", 1, 0, 2, 2),  # span 5: two steps of zeros each end, the length kept
    ("Strict", 1, 0, 1, 0),
])
def test_a_1d_convolution_computes_dl4j_s_conv1d(tmp_path, mode, stride, padding, dilation, expected_padding):
    n_in, n_out, kernel, steps = 3, 4, 3, 9
    layers = [_conv1d_layer(n_in, n_out, kernel, stride=[stride, 1], padding=[padding, 0],
                            dilation=[dilation, 1], convolutionMode=mode), _rnn_output(n_out, 2)]
    rng = np.random.default_rng(10)
    params = rng.normal(size=n_out + n_out * n_in * kernel + n_out * 2 + 2)
    bias, w = params[:n_out], params[n_out:n_out + n_out * n_in * kernel].reshape(n_out, n_in, kernel, 1)[..., 0]
    w_out, b_out = _dense_f(params[-10:-2], n_out, 2), params[-2:]
    net = import_dl4j(_network_zip(tmp_path, layers, params))
    assert net.config.input_type == InputType.recurrent(n_in) and net.config.layers[0].padding == expected_padding
    x = rng.normal(size=(2, n_in, steps))  # DL4J's [batch, size, time]
    hidden = np.tanh(_conv1d(x, w, bias, stride, expected_padding, dilation))
    np.testing.assert_allclose(_output(net, x.transpose(0, 2, 1)), _per_step(hidden, w_out, b_out),
                               rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("kernel, stride, steps", [(2, 1, 7), (3, 2, 10), (4, 3, 11), (3, 2, 9)])
def test_a_same_mode_1d_convolution_pads_as_dl4j_does(tmp_path, kernel, stride, steps):
    """Same mode that pads one end more than the other (an even window) or by the sequence's
    length (a stride above 1): dl4py's convolution_mode="same", DL4J's rule at run time: out =
    ceil(steps / stride), the padding that takes split with the smaller half first."""
    n_in, n_out = 3, 4
    layers = [_conv1d_layer(n_in, n_out, kernel, stride=[stride, 1], convolutionMode="Same"), _rnn_output(n_out, 2)]
    rng = np.random.default_rng(11)
    params = rng.normal(size=n_out + n_out * n_in * kernel + n_out * 2 + 2)
    bias, w = params[:n_out], params[n_out:n_out + n_out * n_in * kernel].reshape(n_out, n_in, kernel, 1)[..., 0]
    w_out, b_out = _dense_f(params[-10:-2], n_out, 2), params[-2:]
    net = import_dl4j(_network_zip(tmp_path, layers, params))
    assert net.config.layers[0].convolution_mode == "same" and net.config.layers[0].padding == 0
    x = rng.normal(size=(2, n_in, steps))
    out = -(-steps // stride)
    total = max((out - 1) * stride + kernel - steps, 0)
    padded = np.pad(x, ((0, 0), (0, 0), (total // 2, total - total // 2)))
    hidden = np.tanh(_conv1d(padded, w, bias, stride, 0, 1))
    assert hidden.shape[2] == out
    np.testing.assert_allclose(_output(net, x.transpose(0, 2, 1)), _per_step(hidden, w_out, b_out),
                               rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("pooling, include_padding", [("MAX", False), ("AVG", True)])
def test_1d_pooling_computes_dl4j_s_pooling_over_time(tmp_path, pooling, include_padding):
    """Subsampling1DLayer: a 2-D pooling over [time, 1], only the first value of each pair read
    (DL4J's builder leaves whatever was there in the second, [1, 2] in the real CNN1dCharacter file).
    Max pooling leaves padding out of the max; average pooling with avgPoolIncludePadInDivisor
    divides by the whole window."""
    steps = 8
    layers = [_conv1d_layer(2, 3, 1, activationFn=_activation("Identity")),
              _layer("Subsampling1DLayer", poolingType=pooling, kernelSize=[3, 1], stride=[2, 7], padding=[1, 0],
                     dilation=[1, 1], convolutionMode="Truncate", avgPoolIncludePadInDivisor=include_padding),
              _rnn_output(3, 2)]
    rng = np.random.default_rng(11)
    params = rng.normal(size=3 + 6 + 6 + 2)
    net = import_dl4j(_network_zip(tmp_path, layers, params))
    x = rng.normal(size=(2, 2, steps))
    conv = _conv1d(x, params[3:9].reshape(3, 2, 1), params[:3], 1, 0, 1)
    padded = np.pad(conv, ((0, 0), (0, 0), (1, 1)), constant_values=-np.inf if pooling == "MAX" else 0.0)
    windows = np.stack([padded[:, :, t * 2:t * 2 + 3] for t in range((steps + 2 - 3) // 2 + 1)], axis=2)
    pooled = windows.max(axis=3) if pooling == "MAX" else windows.mean(axis=3)
    np.testing.assert_allclose(_output(net, x.transpose(0, 2, 1)),
                               _per_step(pooled, _dense_f(params[9:15], 3, 2), params[15:]), rtol=RTOL, atol=ATOL)


@needs_dl4j_files
def test_cnn1d_character_s_gradients_are_laid_out_as_its_convolution_1d():
    """DL4J's own arrays (1.0.0-beta7): CNN1dCharacterTestCase saved each parameter's gradient
    (gradients/0_W.bin is [nOut 32, nIn 77, k 3, 1]) and the flat gradient vector, laid out as
    coefficients.bin is: the Convolution1DLayer's slots cut the flat vector into exactly those."""
    case = MODELS / "dl4j-integration-tests" / "CNN1dCharacterTestCase"
    conf, _ = _graph_layers(case / "Model_RANDOM_INIT_UNTRAINED.zip")
    flat = read_array(case / "flattenedGradients.bin")
    values = split_parameters(param_slots(conf, {0: "0.op.op"}), flat, "flattenedGradients.bin")
    weight = read_array(case / "gradients" / "0_W.bin")
    assert weight.shape == (32, 77, 3, 1)
    np.testing.assert_array_equal(values["0.op.op.weight"], weight[..., 0])
    np.testing.assert_array_equal(values["0.op.op.bias"], read_array(case / "gradients" / "0_b.bin").reshape(-1))
    np.testing.assert_array_equal(values["4.op.weight"], read_array(case / "gradients" / "out_W.bin").T)
    np.testing.assert_array_equal(values["4.op.bias"], read_array(case / "gradients" / "out_b.bin").reshape(-1))


# ---- transposed 2-D convolution ----------------------------------------------------------------

def _deconv2d(x: np.ndarray, w: np.ndarray, b: np.ndarray, stride, top_left, out_size, dilation=(1, 1)):
    """libnd4j's deconv2d: each input pixel (h, w) adds W[i, o, kh, kw] x[i] at output row
    h * sH + kh * dH - padH (col2im), columns alike; the output starts ``top_left`` in."""
    n, _, height, width = x.shape
    k_h, k_w = w.shape[2:]
    full = np.zeros((n, w.shape[1], (height - 1) * stride[0] + (k_h - 1) * dilation[0] + 1,
                     (width - 1) * stride[1] + (k_w - 1) * dilation[1] + 1))
    for h in range(height):
        for c in range(width):
            for kh in range(k_h):
                for kw in range(k_w):
                    full[:, :, h * stride[0] + kh * dilation[0], c * stride[1] + kw * dilation[1]] += \
                        x[:, :, h, c] @ w[:, :, kh, kw]
    top, left = top_left
    return full[:, :, top:top + out_size[0], left:left + out_size[1]] + b[None, :, None, None]


def _deconv_layer(n_in: int, n_out: int, kernel, stride, padding, mode: str) -> dict:
    return _layer("Deconvolution2D", nin=n_in, nout=n_out, kernelSize=list(kernel), stride=list(stride),
                  padding=list(padding), dilation=[1, 1], convolutionMode=mode, hasBias=True,
                  activationFn=_activation("Identity"))


def test_a_transposed_convolution_lays_out_bias_first_then_nin_nout_kh_kw(tmp_path):
    """DeconvolutionParamInitializer: b [nOut], then W [nIn, nOut, kH, kW] in C order, which is
    nn.ConvTranspose2d's weight as it is."""
    layers = [_deconv_layer(2, 3, (3, 2), (2, 1), (1, 0), "Truncate"),
              _layer("OutputLayer", nin=3 * 7 * 4, nout=2, activationFn=_activation("Identity"), lossFn=MSE)]
    count = 3 + 2 * 3 * 3 * 2 + 84 * 2 + 2
    net = import_dl4j(_network_zip(tmp_path, layers, np.arange(1.0, count + 1)),
                      input_type=InputType.convolutional(4, 3, 2))
    state = {name: t.numpy() for name, t in net.module.state_dict().items()}
    np.testing.assert_array_equal(state["0.op.bias"], [1, 2, 3])
    weight = np.zeros((2, 3, 3, 2))
    for i in range(2):
        for o in range(3):
            for h in range(3):
                for w in range(2):
                    weight[i, o, h, w] = 4 + ((i * 3 + o) * 3 + h) * 2 + w
    np.testing.assert_array_equal(state["0.op.weight"], weight)
    first = 4 + 36
    np.testing.assert_array_equal(state["1.op.weight"], [[first + i + 84 * j for i in range(84)] for j in range(2)])
    np.testing.assert_array_equal(state["1.op.bias"], [first + 168, first + 169])


@pytest.mark.parametrize("mode, kernel, stride, padding, out_size, top_left", [
    # Truncate: (in - 1) * stride + kernel - 2 * padding, the padding cropped from each side
    ("Truncate", (3, 2), (2, 1), (1, 0), (7, 4), (1, 0)),
    # Same: in * stride; libnd4j pads (span - stride) // 2 on the top and left
    ("Same", (4, 3), (2, 1), (0, 0), (8, 3), (1, 1)),
])
def test_a_transposed_convolution_computes_dl4j_s_deconv2d(tmp_path, mode, kernel, stride, padding, out_size,
                                                            top_left):
    n_in, n_out, height, width = 2, 3, 4, 3
    flat_size = n_out * out_size[0] * out_size[1]
    layers = [_deconv_layer(n_in, n_out, kernel, stride, padding, mode),
              _layer("OutputLayer", nin=flat_size, nout=2, activationFn=_activation("Identity"), lossFn=MSE)]
    rng = np.random.default_rng(12)
    n_w = n_in * n_out * kernel[0] * kernel[1]
    params = rng.normal(size=n_out + n_w + flat_size * 2 + 2)
    w = params[n_out:n_out + n_w].reshape(n_in, n_out, *kernel)
    net = import_dl4j(_network_zip(tmp_path, layers, params), input_type=InputType.convolutional(height, width, n_in))
    x = rng.normal(size=(2, n_in, height, width))
    deconv = _deconv2d(x, w, params[:n_out], stride, top_left, out_size)
    expected = deconv.reshape(2, -1) @ _dense_f(params[-2 - flat_size * 2:-2], flat_size, 2) + params[-2:]
    np.testing.assert_allclose(_output(net, x), expected, rtol=RTOL, atol=ATOL)


# ---- self-attention ----------------------------------------------------------------------------

def _attention(x: np.ndarray, wq, wk, wv, wo) -> np.ndarray:
    """libnd4j's multi_head_dot_product_attention on DL4J's [batch, nIn, time]: each head's
    projection p[b, h, d, t] = sum_i W[h, d, i] x[b, i, t]; weights = softmax over the keys of
    keys^T queries / sqrt(headSize); the heads' results, [time, head, d] flattened, times Wo."""
    q, k, v = (np.einsum("hdi,bit->bhdt", w, x) for w in (wq, wk, wv))
    scores = np.einsum("bhdk,bhdq->bhkq", k, q) / np.sqrt(q.shape[2])
    weights = np.exp(scores - scores.max(axis=2, keepdims=True))
    weights /= weights.sum(axis=2, keepdims=True)
    heads = np.einsum("bhdk,bhkq->bhdq", v, weights)  # [batch, head, d, time]
    n, h, d, steps = heads.shape
    return (heads.transpose(0, 3, 1, 2).reshape(n * steps, h * d) @ wo).reshape(n, steps, -1).transpose(0, 2, 1)


def _attention_layer(n_in: int, n_out: int, heads: int, head_size: int, project: bool, **fields) -> dict:
    return _layer("SelfAttentionLayer", nin=n_in, nout=n_out, nheads=heads, headSize=head_size,
                  projectInput=project, **fields)


def test_self_attention_s_projections_fill_the_fused_qkv_rows_and_the_output_projection(tmp_path):
    """SelfAttentionLayer (a SameDiff layer, parameters in 'c' order as defineParameters adds
    them): Wq, Wk, Wv [nHeads, headSize, nIn], then Wo [nHeads * headSize, nOut]. dl4py's qkv
    projection holds the query, key and value rows in that order, head by head; its out
    projection is Wo transposed."""
    heads, head_size, n_in, n_out = 2, 3, 4, 5
    layers = [_attention_layer(n_in, n_out, heads, head_size, True), _rnn_output(n_out, 2)]
    count = 3 * 24 + 30 + 10 + 2
    net = import_dl4j(_network_zip(tmp_path, layers, np.arange(1.0, count + 1)))
    state = {name: t.numpy() for name, t in net.module.state_dict().items()}
    rows = [[1 + 24 * which + (h * head_size + d) * n_in + i for i in range(n_in)]
            for which in range(3) for h in range(heads) for d in range(head_size)]
    np.testing.assert_array_equal(state["0.op.qkv.weight"], rows)
    wo = [[73 + r * n_out + o for r in range(heads * head_size)] for o in range(n_out)]  # Wo [6, 5] 'c', transposed
    np.testing.assert_array_equal(state["0.op.out.weight"], wo)
    assert set(state) == {"0.op.qkv.weight", "0.op.out.weight", "1.op.weight", "1.op.bias"}
    attention = net.config.layers[0]
    assert (attention.n_heads, attention.head_size, attention.project_input) == (2, 3, True)


def test_self_attention_s_head_size_0_is_nout_over_nheads(tmp_path):
    """DL4J's builder: headSize 0 means nOut / nHeads (the layer and its layout agree)."""
    layers = [_attention_layer(4, 6, 2, 0, True), _rnn_output(6, 2)]
    net = import_dl4j(_network_zip(tmp_path, layers, np.arange(1.0, 3 * 2 * 3 * 4 + 6 * 6 + 12 + 2 + 1)))
    assert net.module.state_dict()["0.op.qkv.weight"].shape == (18, 4)
    assert net.module.state_dict()["0.op.out.weight"].shape == (6, 6)


def test_self_attention_computes_dl4j_s_multi_head_dot_product_attention(tmp_path):
    heads, head_size, n_in, n_out, steps = 2, 3, 4, 5, 6
    adam = {"@class": "org.nd4j.linalg.learning.config.Adam", "learningRate": 0.01, "beta1": 0.9, "beta2": 0.999,
            "epsilon": 1e-8}
    layers = [_attention_layer(n_in, n_out, heads, head_size, True, updater=adam), _rnn_output(n_out, 2)]
    layers[1]["layer"]["iupdater"] = adam  # a SameDiff layer keeps its IUpdater in "updater", the others in "iupdater"
    rng = np.random.default_rng(13)
    params = rng.normal(size=3 * 24 + 30 + 10 + 2)
    wq, wk, wv = (params[24 * i:24 * (i + 1)].reshape(heads, head_size, n_in) for i in range(3))
    wo = params[72:102].reshape(heads * head_size, n_out)
    path = _network_zip(tmp_path, layers, params)
    assert not [line for line in plan_import(path).left_out if line.startswith("layer 0: updater")]
    net = import_dl4j(path)
    assert type(net.config.updater).__name__ == "Adam" and net.config.updater.learning_rate == 0.01
    x = rng.normal(size=(3, n_in, steps))
    expected = _per_step(_attention(x, wq, wk, wv, wo), _dense_f(params[102:112], n_out, 2), params[112:])
    np.testing.assert_allclose(_output(net, x.transpose(0, 2, 1)), expected, rtol=RTOL, atol=ATOL)


def test_self_attention_without_projection_scales_by_the_input_size(tmp_path):
    """projectInput false: libnd4j's dot_product_attention on the input itself, one head, scores
    divided by sqrt(nIn); no parameters."""
    n_in, steps = 4, 5
    layers = [_attention_layer(n_in, n_in, 1, 0, False), _rnn_output(n_in, 2)]
    rng = np.random.default_rng(14)
    params = rng.normal(size=n_in * 2 + 2)
    net = import_dl4j(_network_zip(tmp_path, layers, params))
    x = rng.normal(size=(2, n_in, steps))
    identity = np.eye(n_in).reshape(1, n_in, n_in)  # the input as its own single head
    expected = _per_step(_attention(x, identity, identity, identity, np.eye(n_in)), _dense_f(params[:8], n_in, 2),
                         params[8:])
    np.testing.assert_allclose(_output(net, x.transpose(0, 2, 1)), expected, rtol=RTOL, atol=ATOL)


# ---- SimpleRnn and Bidirectional: laid out exactly, DL4J's equations computed ------------------------------

def _simple_rnn_dl4j(x: np.ndarray, w, rw, b, act=np.tanh) -> np.ndarray:
    """SimpleRnn.activateHelper: out_t = act(x_t W + out_{t-1} RW + b), on [batch, nIn, time]."""
    out, h = [], None
    for t in range(x.shape[2]):
        z = x[:, :, t] @ w + b + (0 if h is None else h @ rw)
        h = act(z)
        out.append(h)
    return np.stack(out, axis=2)


def _lstm_dl4j(x: np.ndarray, w, rw, b, act=np.tanh) -> np.ndarray:
    """LSTMHelpers.activateHelper on [batch, nIn, time]: blocks 0 cell input, 1 forget, 2 output,
    3 input gate; c = f c + i act(z0), h = o act(c)."""
    n = rw.shape[0]
    h, c, out = np.zeros((x.shape[0], n)), np.zeros((x.shape[0], n)), []
    for t in range(x.shape[2]):
        z = x[:, :, t] @ w + h @ rw + b
        c = sigmoid(z[:, n:2 * n]) * c + sigmoid(z[:, 3 * n:]) * act(z[:, :n])
        h = sigmoid(z[:, 2 * n:3 * n]) * act(c)
        out.append(h)
    return np.stack(out, axis=2)


def _reversed(layer, x: np.ndarray, *params) -> np.ndarray:
    """BidirectionalLayer's backward copy: the layer on the time-reversed input, its output reversed back."""
    return layer(x[:, :, ::-1], *params)[:, :, ::-1]


def _recurrent_zip(tmp_path: Path, layer: dict, count: int, n_out: int) -> tuple[Path, np.ndarray]:
    params = np.random.default_rng(15).normal(size=count + n_out * 2 + 2)
    return _network_zip(tmp_path, [layer, _rnn_output(n_out, 2)], params), params


def test_simple_rnn_is_laid_out_as_nn_rnn_and_computes_dl4j_s_simple_rnn(tmp_path):
    """SimpleRnnParamInitializer: W [nIn, nOut], RW [nOut, nOut] (Fortran order), b; nn.RNN's
    weight_ih_l0 / weight_hh_l0 are W / RW transposed, b its first bias (the second zero). The
    imported network holds them and computes SimpleRnn.activateHelper (softsign here, which
    nn.RNN has not: dl4py's own step loop)."""
    n_in, n = 3, 4
    layer = _layer("recurrent.SimpleRnn", nin=n_in, nout=n, activationFn=_activation("SoftSign"), hasLayerNorm=False)
    path, params = _recurrent_zip(tmp_path, layer, n_in * n + n * n + n, n)
    net = import_dl4j(path, precision="double")
    assert net.config.layers[0].type_name == "simple_rnn" and net.config.layers[0].activation == "softsign"
    x_ncw = np.random.default_rng(18).normal(size=(2, n_in, 5))
    w, rw, b = _dense_f(params[:12], n_in, n), _dense_f(params[12:28], n, n), params[28:32]
    hidden = _simple_rnn_dl4j(x_ncw, w, rw, b, act=lambda v: v / (1 + np.abs(v)))
    w_out, b_out = _dense_f(params[32:40], n, 2), params[40:42]
    np.testing.assert_allclose(_output(net, x_ncw.transpose(0, 2, 1).copy()), _per_step(hidden, w_out, b_out),
                               rtol=RTOL, atol=ATOL)
    layer["layer"]["activationFn"] = _activation("TanH")
    path, params = _recurrent_zip(tmp_path, layer, n_in * n + n * n + n, n)
    conf = read_dl4j_configuration(path)
    slots = param_slots(conf)
    assert [(s.key, s.offset, s.count) for s in slots[:3]] == [("W", 0, 12), ("RW", 12, 16), ("b", 28, 4)]
    values = split_parameters(slots, params, "network.zip")
    w, rw, b = _dense_f(params[:12], n_in, n), _dense_f(params[12:28], n, n), params[28:32]
    np.testing.assert_array_equal(values["0.op.rnn.weight_ih_l0"], w.T)
    np.testing.assert_array_equal(values["0.op.rnn.weight_hh_l0"], rw.T)
    np.testing.assert_array_equal(values["0.op.rnn.bias_ih_l0"], b)
    np.testing.assert_array_equal(values["0.op.rnn.bias_hh_l0"], np.zeros(n))
    np.testing.assert_array_equal(join_parameters(slots, values), params)
    rnn = nn.RNN(n_in, n, nonlinearity="tanh", batch_first=True).double()
    rnn.load_state_dict({k.removeprefix("0.op.rnn."): torch.from_numpy(v) for k, v in values.items()
                         if k.startswith("0.op.rnn.")})
    x = np.random.default_rng(16).normal(size=(2, n_in, 5))
    out, _ = rnn(torch.from_numpy(x.transpose(0, 2, 1).copy()))
    np.testing.assert_allclose(out.detach().numpy(), _simple_rnn_dl4j(x, w, rw, b).transpose(0, 2, 1),
                               rtol=RTOL, atol=ATOL)
    # with layer normalization, DL4J adds the gains g [2 nOut] after b: laid out, and refused
    layer["layer"]["hasLayerNorm"] = True
    path, _ = _recurrent_zip(tmp_path, layer, n_in * n + n * n + 3 * n, n)
    gains = param_slots(read_dl4j_configuration(path))[3]
    assert (gains.key, gains.offset, gains.count) == ("g", 32, 8)
    with pytest.raises(DL4JFileError, match=r"layer 0 \(org\.deeplearning4j\.nn\.conf\.layers\.recurrent\.SimpleRnn\): "
                                            r"a SimpleRnn with layer normalization \(hasLayerNorm\) has no dl4py "
                                            r"counterpart") as exc:
        import_dl4j(path)
    _one_line(exc)


@pytest.mark.parametrize("mode", ["CONCAT", "ADD", "MUL", "AVERAGE"])
def test_bidirectional_is_laid_out_as_a_bidirectional_nn_lstm_and_computes_dl4j_s_modes(tmp_path, mode):
    """BidirectionalParamInitializer: the wrapped LSTM's parameters for the forward copy (keys
    fW, fRW, fb), then the backward copy's (bW, bRW, bb); torch's backward entries end in
    _reverse. DL4J's CONCAT mode is nn.LSTM(bidirectional=True)'s output; the imported layer
    computes each of DL4J's four modes."""
    n_in, n = 3, 2
    lstm = {"@class": LAYERS + "LSTM", "nin": n_in, "nout": n, "activationFn": _activation("TanH"),
            "gateActivationFn": _activation("Sigmoid"), "forgetGateBiasInit": 1.0}
    layer = _layer("recurrent.Bidirectional", fwd=lstm, bwd=lstm, mode=mode, nin=n_in, nout=n)
    per_direction = n_in * 4 * n + n * 4 * n + 4 * n
    width = 2 * n if mode == "CONCAT" else n
    path, params = _recurrent_zip(tmp_path, layer, 2 * per_direction, width)
    net = import_dl4j(path, precision="double")
    assert net.config.layers[0].type_name == "bidirectional" and net.config.layers[0].mode == mode.lower()
    slots = param_slots(read_dl4j_configuration(path))
    assert [s.key for s in slots] == ["fW", "fRW", "fb", "bW", "bRW", "bb", "W", "b"]
    values = split_parameters(slots, params, "network.zip")
    module = nn.LSTM(n_in, n, batch_first=True, bidirectional=True).double()
    module.load_state_dict({k.removeprefix("0.op.rnn."): torch.from_numpy(v) for k, v in values.items()
                            if k.startswith("0.op.rnn.")})

    def direction(first: int):
        w = _dense_f(params[first:first + 24], n_in, 4 * n)
        rw = _dense_f(params[first + 24:first + 40], n, 4 * n)
        return w, rw, params[first + 40:first + 48]

    x = np.random.default_rng(17).normal(size=(2, n_in, 6))
    forward, backward = _lstm_dl4j(x, *direction(0)), _reversed(_lstm_dl4j, x, *direction(per_direction))
    combined = {"CONCAT": lambda: np.concatenate([forward, backward], axis=1), "ADD": lambda: forward + backward,
                "MUL": lambda: forward * backward, "AVERAGE": lambda: (forward + backward) / 2}[mode]()
    if mode == "CONCAT":
        out, _ = module(torch.from_numpy(x.transpose(0, 2, 1).copy()))
        np.testing.assert_allclose(out.detach().numpy(), combined.transpose(0, 2, 1), rtol=RTOL, atol=ATOL)
    w_out, b_out = _dense_f(params[2 * per_direction:2 * per_direction + width * 2], width, 2), params[-2:]
    np.testing.assert_allclose(_output(net, x.transpose(0, 2, 1).copy()), _per_step(combined, w_out, b_out),
                               rtol=RTOL, atol=ATOL)


def _graph_layers(path: Path):
    """A ComputationGraph's layers, in its topological order, as a layer list: DL4J's graph lays
    its parameters out vertex by vertex in that order (``ComputationGraph.init``), each as the
    layer's initializer does, so the list's slots are the graph's. Also the layer names."""
    graph = json.loads(zipfile.ZipFile(path).read("configuration.json"))
    names = [name for name in graph["topologicalOrderStr"]
             if graph["vertices"].get(name, {}).get("@class", "").endswith(".LayerVertex")]
    confs = [graph["vertices"][name]["layerConf"] for name in names]
    return read_configuration(json.dumps({"confs": confs}), f"{path.name}:configuration.json"), names


@needs_dl4j_files
def test_synthetic_bidirectional_rnn_graph_s_output_from_the_laid_out_parameters():
    """DL4J's own file and output (1.0.0-beta4, float): Bidirectional(LSTM, relu) and
    Bidirectional(SimpleRnn, relu) on the input, concatenated, max-pooled over time, a softmax
    output layer. Computed here from the tensors the slots give, in torch's layouts (nn.RNN for
    the simple RNN; the LSTM in torch's gate order i, f, g, o, as nn.LSTM has no relu cell):
    DL4J's output, to float's precision."""
    folder = MODELS / "regression_testing" / "100b4"
    path = folder / "SyntheticBidirectionalRNNGraph_100b4.bin"
    conf, names = _graph_layers(path)
    assert names == ["rnn1", "rnn2", "pooling", "out"]
    slots = param_slots(conf)
    assert [s.key for s in slots if s.layer == 0] == json.loads(zipfile.ZipFile(path).read("configuration.json"))[
        "vertices"]["rnn1"]["layerConf"]["variables"]
    flat = read_array(zipfile.ZipFile(path).read("coefficients.bin")).astype(np.float64)
    values = split_parameters(slots, flat, path.name)
    x = read_array(folder / "SyntheticBidirectionalRNNGraph_Input_100b4.bin").astype(np.float64)  # [4, 10, 10]
    expected = read_array(folder / "SyntheticBidirectionalRNNGraph_Output_100b4.bin")

    def relu(v):
        return np.maximum(v, 0)

    def lstm_torch_layout(x_ncw, suffix):
        w_ih, w_hh = values[f"0.op.rnn.weight_ih_l0{suffix}"], values[f"0.op.rnn.weight_hh_l0{suffix}"]
        bias = values[f"0.op.rnn.bias_ih_l0{suffix}"] + values[f"0.op.rnn.bias_hh_l0{suffix}"]
        n = w_hh.shape[1]
        h, c, out = np.zeros((x_ncw.shape[0], n)), np.zeros((x_ncw.shape[0], n)), []
        for t in range(x_ncw.shape[2]):
            i, f, g, o = np.split(x_ncw[:, :, t] @ w_ih.T + h @ w_hh.T + bias, 4, axis=1)
            c = sigmoid(f) * c + sigmoid(i) * relu(g)
            h = sigmoid(o) * relu(c)
            out.append(h)
        return np.stack(out, axis=2)

    rnn = nn.RNN(10, 16, nonlinearity="relu", batch_first=True, bidirectional=True).double()
    rnn.load_state_dict({k.removeprefix("1.op.rnn."): torch.from_numpy(v) for k, v in values.items()
                         if k.startswith("1.op.rnn.")})
    simple, _ = rnn(torch.from_numpy(x.transpose(0, 2, 1).copy()))
    merged = np.concatenate([lstm_torch_layout(x, ""), lstm_torch_layout(x[:, :, ::-1], "_reverse")[:, :, ::-1],
                             simple.detach().numpy().transpose(0, 2, 1)], axis=1)
    logits = merged.max(axis=2) @ values["3.op.weight"].T + values["3.op.bias"]
    probabilities = np.exp(logits - logits.max(axis=1, keepdims=True))
    probabilities /= probabilities.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(probabilities, expected, rtol=1e-5, atol=0)


# ---- refusals: one line, the file, the layer index, the Java class ---------------------------------

@pytest.mark.parametrize("layers, index, java_class, reason", [
    ([_layer("LossLayer", activationFn=_activation("Identity"), lossFn=MSE)], 1, "LossLayer",
     r"dl4py has no counterpart for DL4J's LossLayer"),
    ([_conv1d_layer(3, 4, 3, convolutionMode="Causal")], 1, "Convolution1DLayer",
     r"Causal convolution mode pads the start of the sequence only"),
    ([_layer("Subsampling1DLayer", poolingType="PNORM", kernelSize=[2, 1], stride=[2, 1], padding=[0, 0])], 1,
     "Subsampling1DLayer", r"pooling type PNORM has no dl4py counterpart"),
    ([_layer("Subsampling1DLayer", poolingType="AVG", kernelSize=[3, 1], stride=[1, 1], padding=[1, 0],
             avgPoolIncludePadInDivisor=False)], 1, "Subsampling1DLayer",
     r"average pooling with padding that DL4J leaves out of the divisor"),
    ([_attention_layer(3, 3, 1, 3, True, scaled=False)], 1, "SelfAttentionLayer",
     r"self-attention without scaling \(scaled=false\)"),
    ([_layer("LSTM", nin=3, nout=3, activationFn=_activation("TanH"), rnnDataFormat="NCWH")], 1, "LSTM",
     r"sequence format rnnDataFormat NCWH: dl4py maps NCW and NWC"),
])
def test_sequence_layers_dl4py_cannot_compute_are_refused_in_one_line(tmp_path, layers, index, java_class, reason):
    first = _layer("LSTM", nin=3, nout=3, activationFn=_activation("TanH"))
    path = _network_zip(tmp_path, [first] + layers + [_rnn_output(3, 2)], np.zeros(200))
    where = rf"network\.zip:configuration\.json: layer {index} \(org\.deeplearning4j\.nn\.conf\.layers\.{java_class}\)"
    with pytest.raises(DL4JFileError, match=rf"{where}: {reason}") as exc:
        import_dl4j(path)
    _one_line(exc)


@pytest.mark.parametrize("layer, reason", [
    (_deconv_layer(2, 3, (3, 3), (2, 2), (0, 0), "Same"),
     r"Same mode crops 1 from the transposed convolution's height, one side more than the other"),
    (_layer("ConvolutionLayer", nin=2, nout=3, kernelSize=[2, 2], stride=[1, 1], padding=[0, 0],
            cnn2dDataFormat="NHWC", activationFn=_activation("Identity")),
     r"data format cnn2dDataFormat NHWC: dl4py's convolutional layers take channels first"),
    (_layer("BatchNormalization", nin=2, nout=2, cnn2DFormat="NHWC"),
     r"data format cnn2DFormat NHWC: dl4py's convolutional layers take channels first"),
])
def test_image_layers_dl4py_cannot_compute_are_refused_in_one_line(tmp_path, layer, reason):
    java_class = layer["layer"]["@class"].replace(".", r"\.")
    path = _network_zip(tmp_path, [layer], np.zeros(200))
    with pytest.raises(DL4JFileError, match=rf"network\.zip:configuration\.json: layer 0 \({java_class}\): "
                                            rf"{reason}") as exc:
        import_dl4j(path, input_type=InputType.convolutional(4, 4, 2))
    _one_line(exc)


@pytest.mark.parametrize("index, preprocessor, java_class", [
    (1, {"@class": "org.deeplearning4j.nn.conf.preprocessor.CnnToFeedForwardPreProcessor",
         "inputHeight": 3, "inputWidth": 3, "numChannels": 2, "format": "NHWC"}, "OutputLayer"),
    (0, {"@class": "org.deeplearning4j.nn.conf.preprocessor.FeedForwardToCnnPreProcessor",
         "inputHeight": 4, "inputWidth": 4, "numChannels": 1, "format": "NHWC"}, "ConvolutionLayer"),
])
def test_a_channels_last_flattening_preprocessor_is_refused(tmp_path, index, preprocessor, java_class):
    """DL4J 1.0.0-beta7's preprocessors between images and rows keep a format: NHWC flattens
    [height, width, channels], which dl4py's flattening is not."""
    layers = [_layer("ConvolutionLayer", nin=1, nout=2, kernelSize=[2, 2], stride=[1, 1], padding=[0, 0],
                     activationFn=_activation("Identity")),
              _layer("OutputLayer", nin=18, nout=2, activationFn=_activation("Identity"), lossFn=MSE)]
    conf = {"confs": layers, "dataType": "DOUBLE", "backpropType": "Standard",
            "inputPreProcessors": {str(index): preprocessor}}
    path = tmp_path / "nhwc.zip"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("configuration.json", json.dumps(conf))
        archive.writestr("coefficients.bin", write_array(np.zeros((1, 2 + 8 + 36 + 2))))
    kind = preprocessor["@class"].rsplit(".", 1)[-1]
    with pytest.raises(DL4JFileError, match=rf"nhwc\.zip:configuration\.json: layer {index} "
                                            rf"\(org\.deeplearning4j\.nn\.conf\.layers\.{java_class}\): input "
                                            rf"preprocessor {kind} with format NHWC") as exc:
        import_dl4j(path, input_type=None if index == 0 else InputType.convolutional(4, 4, 1))
    _one_line(exc)


def test_nwc_sequence_layers_compute_as_ncw_ones(tmp_path):
    """rnnDataFormat says how DL4J's data is laid out ([batch, time, size] for NWC), not what the
    layer computes: both map, and dl4py takes [batch, time, size] either way."""
    outputs = []
    for data_format in ("NCW", "NWC"):
        layers = [_layer("LSTM", nin=3, nout=4, activationFn=_activation("TanH"), rnnDataFormat=data_format),
                  _layer("RnnOutputLayer", nin=4, nout=2, activationFn=_activation("Identity"), lossFn=MSE,
                         rnnDataFormat=data_format)]
        params = np.random.default_rng(18).normal(size=3 * 16 + 4 * 16 + 16 + 8 + 2)
        net = import_dl4j(_network_zip(tmp_path, layers, params))
        outputs.append(_output(net, np.random.default_rng(19).normal(size=(2, 5, 3))))
    np.testing.assert_array_equal(outputs[0], outputs[1])


def test_a_bidirectional_layer_s_own_input_dropout_is_kept(tmp_path):
    """DL4J's Bidirectional hands its input to both copies of its layer, which apply their own
    dropout (``idropout`` inside ``fwd``): dl4py's DropoutLayer before it, with DL4J's p as the
    probability to keep."""
    n_in, n = 3, 2
    lstm = {"@class": LAYERS + "LSTM", "nin": n_in, "nout": n, "activationFn": _activation("TanH"),
            "idropout": {"@class": "org.deeplearning4j.nn.conf.dropout.Dropout", "p": 0.75}}
    layer = _layer("recurrent.Bidirectional", fwd=lstm, bwd=lstm, mode="ADD", nin=n_in, nout=n)
    path, _ = _recurrent_zip(tmp_path, layer, 2 * (n_in * 4 * n + n * 4 * n + 4 * n), n)
    net = import_dl4j(path)
    assert [layer.type_name for layer in net.config.layers] == ["dropout", "bidirectional", "rnn_output"]
    assert net.config.layers[0].rate == pytest.approx(0.25)
