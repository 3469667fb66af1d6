"""Convolution1D, Subsampling1D, Upsampling2D, Deconvolution2D, ZeroPadding, LayerNormalization
and SelfAttention layers: shapes, gradients, configs, errors, masks and memory."""

from __future__ import annotations

import pytest
import torch
import yaml
from torch.func import functional_call

from dl4py import load
from dl4py.config import (
    LSTM,
    Adam,
    Convolution1DLayer,
    ConvolutionLayer,
    Deconvolution2D,
    DenseLayer,
    GlobalPoolingLayer,
    InputType,
    LastTimeStep,
    LayerNormalization,
    NetworkConfig,
    OutputLayer,
    RnnOutputLayer,
    SelfAttentionLayer,
    Subsampling1DLayer,
    Upsampling2D,
    ZeroPaddingLayer,
)
from dl4py.errors import ConfigError, DataError
from dl4py.nn import MultiLayerNetwork

from devices import backend_for, on_devices


def _conf(input_type, *layers, l2=0.0):
    builder = NetworkConfig.builder().seed(7).updater(Adam(learning_rate=0.01)).l2(l2)
    for layer in layers:
        builder.layer(layer)
    return builder.input_type(input_type).build()


def _cnn_stack(input_type):
    return _conf(input_type, ZeroPaddingLayer(padding=(1, 2)),
                 ConvolutionLayer(n_out=3, kernel_size=3, activation="tanh"),
                 Upsampling2D(size=(2, 1)), Deconvolution2D(n_out=2, kernel_size=(3, 2), stride=2, padding=1),
                 LayerNormalization(), GlobalPoolingLayer(pooling_type="avg"), OutputLayer(n_out=3))


def _cnn_flat(input_type):
    return _conf(input_type, Deconvolution2D(n_out=2, kernel_size=2, stride=(2, 1), dilation=(1, 2), activation="relu"),
                 ZeroPaddingLayer(padding=1), LayerNormalization(), DenseLayer(n_out=5, activation="tanh"),
                 LayerNormalization(eps=1e-3), OutputLayer(n_out=2))


def _seq_conv(input_type):
    return _conf(input_type, Convolution1DLayer(n_out=4, kernel_size=3, stride=2, activation="tanh"),
                 Subsampling1DLayer(kernel_size=2, stride=1), LayerNormalization(),
                 Convolution1DLayer(n_out=3, kernel_size=2, dilation=2, padding=1), RnnOutputLayer(n_out=3))


def _seq_attention(input_type):
    # Layers that keep the sequence length: they take masked (padded) batches.
    return _conf(input_type, Convolution1DLayer(n_out=6, kernel_size=3, padding=1, activation="tanh"),
                 SelfAttentionLayer(n_out=6, n_heads=2), LayerNormalization(),
                 SelfAttentionLayer(n_out=6, n_heads=3, head_size=2, project_input=False),
                 Subsampling1DLayer(pooling_type="avg", kernel_size=3, stride=1, padding=1),
                 LastTimeStep(LSTM(n_out=3)), OutputLayer(n_out=2))


# name -> (config of an input type, the input types it is tested with)
CONFIGS = {
    "cnn_stack": (_cnn_stack, [InputType.convolutional(7, 6, 2), InputType.convolutional(4, 9, 1)]),
    "cnn_flat": (_cnn_flat, [InputType.convolutional_flat(3, 4, 1), InputType.convolutional_flat(2, 2, 2)]),
    "seq_conv": (_seq_conv, [InputType.recurrent(3), InputType.recurrent(2, 9)]),
    "seq_attention": (_seq_attention, [InputType.recurrent(4), InputType.recurrent(6, 5)]),
}
CASES = [(name, i) for name, (_, types) in CONFIGS.items() for i in range(len(types))]


def _config(name, i=0):
    make, types = CONFIGS[name]
    return make(types[i])


def _features(conf, n, time, generator):
    shape = conf.input_type.example_shape()
    shape = tuple(time if d is None else d for d in shape)
    return torch.randn((n,) + shape, generator=generator, dtype=torch.float64)


def _labels(conf, n, generator, time):
    last = conf.layer_shapes()[-1]
    if isinstance(last.layer, RnnOutputLayer):
        steps = last.output.dims[0] or _out_time(conf, time)
        return torch.randint(0, last.layer.n_out, (n, steps), generator=generator)
    return torch.randint(0, last.layer.n_out, (n,), generator=generator)


def _out_time(conf, time):
    net = MultiLayerNetwork(conf, backend="cpu", precision="double").init()
    return net.module(torch.zeros((1, time, conf.input_type.size), dtype=torch.float64)).shape[1]


def _lengths(conf):
    fixed = getattr(conf.input_type, "length", 1)
    return [fixed] if fixed is not None else [6, 9, 13]


# ---- shapes -----------------------------------------------------------------------------
@on_devices
@pytest.mark.parametrize("name, i", CASES)
def test_output_shapes_match_inferred_shapes(name, i, device):
    conf = _config(name, i)
    net = MultiLayerNetwork(conf, backend=backend_for(device), precision="double").init()
    g = torch.Generator().manual_seed(0)
    for n, time in zip([1, 3, 2], _lengths(conf) * 3):
        x = _features(conf, n, time, g).to(device)
        for shapes, module in zip(conf.layer_shapes(), net.module):
            x = module(x)
            assert x.shape[0] == n
            if shapes.output.kind == "rnn" and shapes.output.dims[0] is None:
                assert x.shape[2] == shapes.output.dims[1], (name, shapes.index)
                continue
            assert tuple(x.shape[1:]) == shapes.output.dims, (name, shapes.index, time)


def test_variable_length_shapes_follow_dl4j_window_rules():
    conf = _config("seq_conv")
    net = MultiLayerNetwork(conf, precision="double").init()
    for time in (6, 9, 13):
        x = torch.zeros((1, time, 3), dtype=torch.float64)
        fixed = _seq_conv(InputType.recurrent(3, time))  # the same layers at a known length
        for shapes, module in zip(fixed.layer_shapes(), net.module):
            x = module(x)
            assert tuple(x.shape[1:]) == shapes.output.dims, (time, shapes.index)


def test_deconvolution_upsampling_and_zero_padding_compute_dl4js_results():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 1, 3, 4, generator=g, dtype=torch.float64)
    pad = MultiLayerNetwork(_conf(InputType.convolutional(3, 4, 1), ZeroPaddingLayer(padding=(1, 2, 0, 3)),
                                  GlobalPoolingLayer(), OutputLayer(n_out=2)), precision="double").init()
    padded = pad.module[0](x)
    assert padded.shape == (2, 1, 6, 7)
    expected = torch.zeros(2, 1, 6, 7, dtype=torch.float64)  # (top, bottom, left, right) = (1, 2, 0, 3)
    expected[:, :, 1:4, 0:4] = x
    assert torch.equal(padded, expected)
    up = MultiLayerNetwork(_conf(InputType.convolutional(3, 4, 1), Upsampling2D(size=(2, 3)),
                                 GlobalPoolingLayer(), OutputLayer(n_out=2)), precision="double").init()
    assert torch.equal(up.module[0](x), x.repeat_interleave(2, dim=2).repeat_interleave(3, dim=3))
    # (in - 1) * stride + kernel - 2 * padding, per axis
    conf = _conf(InputType.convolutional(5, 4, 1), Deconvolution2D(n_out=2, kernel_size=(3, 4), stride=(2, 3),
                                                                  padding=(1, 2)), GlobalPoolingLayer(), OutputLayer(n_out=2))
    assert conf.layer_shapes()[0].output.dims == (2, (5 - 1) * 2 + 3 - 2, (4 - 1) * 3 + 4 - 4)


# ---- gradients: double precision against finite differences ------------------------------
def _mask(n, time):
    """A padded batch: lengths time, time-1, 2, ..."""
    mask = torch.ones(n, time, dtype=torch.float64)
    mask[1, time - 1:] = 0
    mask[2:, 2:] = 0
    return mask


@on_devices
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gradients_match_finite_differences(name, device):
    # seq_attention: the padding is masked all the way through
    _check_gradients(_config(name), device, masked=name == "seq_attention")


# The seq_attention stack's layers one at a time, masked: on CUDA (an H200, float64) the whole
# stack's analytical gradient missed the numerical one by 10-50%, at the real steps only; these
# say which layer's CUDA path it is.
SEQUENCE_LAYERS = {
    "conv1d": lambda: _conf(InputType.recurrent(4), Convolution1DLayer(n_out=6, kernel_size=3, padding=1,
                                                                      activation="tanh"), RnnOutputLayer(n_out=3)),
    "attention": lambda: _conf(InputType.recurrent(4), SelfAttentionLayer(n_out=6, n_heads=2), RnnOutputLayer(n_out=3)),
    "attention_unprojected": lambda: _conf(InputType.recurrent(6), SelfAttentionLayer(
        n_out=6, n_heads=3, head_size=2, project_input=False), RnnOutputLayer(n_out=3)),
    "layer_norm": lambda: _conf(InputType.recurrent(4), LayerNormalization(), RnnOutputLayer(n_out=3)),
    "avg_pool_1d": lambda: _conf(InputType.recurrent(4), Subsampling1DLayer(pooling_type="avg", kernel_size=3,
                                                                           stride=1, padding=1), RnnOutputLayer(n_out=3)),
    "lstm_last_step": lambda: _conf(InputType.recurrent(4), LastTimeStep(LSTM(n_out=3)), OutputLayer(n_out=2)),
}


@on_devices
@pytest.mark.parametrize("name", sorted(SEQUENCE_LAYERS))
def test_each_masked_sequence_layer_alone_matches_finite_differences(name, device):
    _check_gradients(SEQUENCE_LAYERS[name](), device, masked=True)


def _check_gradients(conf, device, masked: bool) -> None:
    net = MultiLayerNetwork(conf, backend=backend_for(device), precision="double").init()
    g = torch.Generator().manual_seed(1)
    time = 6
    x = _features(conf, 3, time, g).to(device)
    y = _labels(conf, 3, g, time).to(device)
    if masked:
        net.set_mask(_mask(3, time).to(device))
    names = [n for n, _ in net.module.named_parameters()]

    def loss(features, *params):
        return net.loss(functional_call(net.module, dict(zip(names, params)), (features,)), y)

    params = tuple(p.detach().clone().requires_grad_(True) for p in net.module.parameters())
    inputs = (x.requires_grad_(True),) + params
    # fast_mode: random directions of the Jacobian, seconds instead of minutes. On CUDA some
    # backward kernels (upsampling's) add with atomics: two backwards differ in the last bits.
    assert torch.autograd.gradcheck(loss, inputs, eps=1e-6, atol=1e-5, fast_mode=True,
                                    nondet_tol=1e-12 if device == "cuda" else 0.0)


# ---- config as data ---------------------------------------------------------------------
@pytest.mark.parametrize("name, i", CASES)
def test_yaml_and_json_round_trip(name, i):
    conf = _config(name, i)
    assert NetworkConfig.from_yaml(conf.to_yaml()) == conf
    assert NetworkConfig.from_json(conf.to_json()) == conf


def test_yaml_names_and_short_forms():
    conf = NetworkConfig.from_yaml("""
input_type: {type: convolutional, height: 5, width: 5, channels: 1}
layers:
  - {type: zero_padding, padding: [1, 2]}        # DL4J's (height, width) form
  - {type: Deconvolution2D, n_out: 2, kernel_size: 2, stride: 2, activation: RELU}
  - {type: upsampling2d, size: 2}
  - {type: layer_normalization}
  - {type: global_pooling}
  - {type: output, n_out: 3}
""")
    assert conf.layers[0].padding == (1, 1, 2, 2) and conf.layers[0] == ZeroPaddingLayer(padding=(1, 1, 2, 2))
    assert ZeroPaddingLayer(padding=3).padding == (3, 3, 3, 3)
    assert conf.layers[2].size == (2, 2) and conf.layers[1].activation == "relu"
    assert [str(s.output) for s in conf.layer_shapes()] == ["1x7x9", "2x14x18", "2x28x36", "2x28x36", "2", "3"]


@pytest.mark.parametrize("name", ["cnn_stack", "seq_attention"])
def test_save_and_load_keep_outputs(name, tmp_path):
    conf = _config(name)
    net = MultiLayerNetwork(conf).init()
    x = _features(conf, 4, 5, torch.Generator().manual_seed(4)).float()
    net.save(tmp_path / "model.dl4py")
    again = load(tmp_path / "model.dl4py")
    assert again.config == conf
    assert torch.equal(net.output(x), again.output(x))


def test_l2_reaches_attention_and_convolution_weights_but_not_layer_norm():
    from dl4py.nn.optimizers import param_groups

    conf = _seq_attention(InputType.recurrent(4)).replace(l2=0.01)
    net = MultiLayerNetwork(conf).init()
    names = {id(p): n for n, p in net.module.named_parameters()}
    decayed = {names[id(p)] for group in param_groups(conf, net.module) if group["weight_decay"] > 0
               for p in group["params"]}
    assert {"0.op.op.weight", "1.op.qkv.weight", "1.op.out.weight"} <= decayed, decayed
    assert not any(n.startswith("2.") or "bias" in n for n in decayed), decayed


# ---- impossible configurations ------------------------------------------------------------
SEQ = {"type": "recurrent", "size": 3, "length": 4}
CNN = {"type": "convolutional", "height": 4, "width": 4, "channels": 2}
FF = {"type": "feed_forward", "size": 5}
CONV = {"type": "convolution", "n_out": 2, "kernel_size": 3}
DENSE = {"type": "dense", "n_out": 4}
ERRORS = [  # input type, layers (an output layer follows), the key path and words of the error
    (SEQ, [{"type": "convolution1d", "n_out": 2, "kernel_size": 5}], "network.layers[0].kernel_size",
     "sequence length is 4"),
    (SEQ, [{"type": "convolution1d", "n_out": 2, "kernel_size": 3, "dilation": 2}], "network.layers[0].kernel_size",
     "spans 5"),
    (CNN, [{"type": "convolution1d", "n_out": 2}], "network.layers[0]", "needs recurrent input"),
    (CNN, [CONV, {"type": "subsampling1d"}], "network.layers[1]", "needs recurrent input"),
    (FF, [DENSE, {"type": "self_attention", "n_out": 4}], "network.layers[1]", "needs recurrent input"),
    (SEQ, [{"type": "subsampling1d", "kernel_size": 2, "padding": 2}], "network.layers[0].padding", "at most half"),
    (SEQ, [{"type": "subsampling1d", "kernel_size": 6}], "network.layers[0].kernel_size", "sequence length is 4"),
    (SEQ, [{"type": "upsampling2d"}], "network.layers[0]", "cannot take recurrent input"),
    (FF, [DENSE, {"type": "upsampling2d"}], "network.layers[1]", "needs convolutional input"),
    (CNN, [{"type": "deconvolution2d", "n_out": 2, "kernel_size": 1, "padding": 2}], "network.layers[0].padding",
     "crops away"),
    (FF, [{"type": "deconvolution2d", "n_out": 2}], "network.layers[0]", "needs convolutional input"),
    (SEQ, [{"type": "zero_padding", "padding": 1}], "network.layers[0]", "cannot take recurrent input"),
    (SEQ, [{"type": "self_attention", "n_out": 4, "n_heads": 3}], "network.layers[0].n_heads",
     "do not divide n_out 4"),
    (SEQ, [{"type": "self_attention", "n_out": 3, "head_size": 2, "project_input": False}],
     "network.layers[0].head_size", "split the input, of size 3"),
    (SEQ, [{"type": "self_attention", "n_out": 4, "project_input": False}], "network.layers[0].n_out",
     "must equal the input size 3"),
    (SEQ, [{"type": "self_attention", "n_out": 3, "n_heads": 2, "project_input": False}],
     "network.layers[0].n_heads", "do not divide the input size 3"),
]


@pytest.mark.parametrize("input_type, layers, where, words", ERRORS)
def test_impossible_configurations_are_named(input_type, layers, where, words):
    with pytest.raises(ConfigError) as error:  # the error comes before the output layer
        NetworkConfig.from_dict({"input_type": input_type, "layers": layers + [{"type": "output", "n_out": 2}]})
    assert str(error.value).startswith(where + ":"), str(error.value)
    assert words in str(error.value)


@pytest.mark.parametrize("layer, key", [
    ({"type": "convolution1d", "n_out": 0}, "n_out"),
    ({"type": "convolution1d", "n_out": 2, "stride": 0}, "stride"),
    ({"type": "convolution1d", "n_out": 2, "padding": -1}, "padding"),
    ({"type": "convolution1d", "n_out": 2, "kernel_size": [2, 2]}, "kernel_size"),
    ({"type": "convolution1d", "n_out": 2, "l2": -0.1}, "l2"),
    ({"type": "subsampling1d", "pooling_type": "pnorm"}, "pooling_type"),
    ({"type": "upsampling2d", "size": [2, 0]}, "size"),
    ({"type": "deconvolution2d", "n_out": 2, "dilation": 0}, "dilation"),
    ({"type": "zero_padding", "padding": [1, 2, 3]}, "padding"),
    ({"type": "zero_padding", "padding": -1}, "padding"),
    ({"type": "zero_padding"}, "padding"),
    ({"type": "layer_normalization", "eps": 0}, "eps"),
    ({"type": "self_attention", "n_out": 4, "head_size": 0}, "head_size"),
    ({"type": "self_attention", "n_out": 4, "project_input": "yes"}, "project_input"),
    ({"type": "self_attention", "n_out": 4, "heads": 2}, "heads"),
])
def test_bad_fields_are_named_by_key_path(layer, key):
    with pytest.raises(ConfigError) as error:
        NetworkConfig.from_dict({"input_type": {"type": "recurrent", "size": 4, "length": 8},
                                 "layers": [layer, {"type": "rnn_output", "n_out": 2}]})
    assert str(error.value).startswith(f"network.layers[0].{key}"), str(error.value)


# ---- masks --------------------------------------------------------------------------------
def _padded(seqs, time, fill=100.0):
    x = torch.full((len(seqs), time, seqs[0].shape[1]), fill, dtype=torch.float64)
    mask = torch.zeros(len(seqs), time, dtype=torch.float64)
    for i, s in enumerate(seqs):
        x[i, : len(s)], mask[i, : len(s)] = s, 1.0
    return x, mask


def test_masked_padding_changes_nothing_for_the_real_steps():
    """Self-attention, layer norm and length-keeping 1-D windows: a padded batch with garbage
    in its padding gives every sequence's real steps what the sequence alone gives, and the
    same per-step loss and gradients."""
    g = torch.Generator().manual_seed(3)
    lengths = [2, 5, 3]
    seqs = [torch.randn(t, 4, generator=g, dtype=torch.float64) for t in lengths]
    labels = [torch.randint(0, 3, (t,), generator=g) for t in lengths]
    conf = _conf(InputType.recurrent(4), Convolution1DLayer(n_out=6, kernel_size=3, padding=1, activation="tanh"),
                 SelfAttentionLayer(n_out=6, n_heads=2), LayerNormalization(),
                 SelfAttentionLayer(n_out=6, n_heads=2, project_input=False),
                 Subsampling1DLayer(kernel_size=3, stride=1, padding=1), RnnOutputLayer(n_out=3))
    net = MultiLayerNetwork(conf, precision="double").init()
    with torch.no_grad():  # biases start at zero, which would hide a padded step's bias
        for p in net.module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    x, mask = _padded(seqs, 5)
    y = torch.zeros(3, 5, dtype=torch.int64)
    for i, t in enumerate(lengths):
        y[i, :t] = labels[i]

    def loss_and_grads(features, targets, m):
        net.module.zero_grad()
        net.set_mask(m)
        out = net.module(features)
        loss = net.loss(out, targets)
        loss.backward()
        return out.detach(), loss.detach(), [p.grad.clone() for p in net.module.parameters()]

    net.set_mask(mask)
    h = x
    for i, layer in enumerate(net.module[:-1]):  # every layer's output is zero at padded steps
        h = layer(h)
        assert torch.count_nonzero(h * (1 - mask).unsqueeze(-1)) == 0, conf.layers[i].type_name
    out, padded_loss, padded_grads = loss_and_grads(x, y, mask)
    total, grads = 0.0, None
    for i, t in enumerate(lengths):
        alone, loss, g_i = loss_and_grads(seqs[i][None], labels[i][None], None)
        assert torch.allclose(out[i, :t], alone[0], atol=1e-12)
        total += loss * t
        grads = [gi * t for gi in g_i] if grads is None else [a + gi * t for a, gi in zip(grads, g_i)]
    assert torch.allclose(padded_loss, total / sum(lengths), atol=1e-12)
    for a, b in zip(padded_grads, grads):
        assert torch.allclose(a, b / sum(lengths), atol=1e-10)


def test_a_window_that_changes_the_length_refuses_a_mask_naming_the_layer():
    net = MultiLayerNetwork(_config("seq_conv"), precision="double").init()
    x, mask = _padded([torch.randn(4, 3, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)], 7)
    net.set_mask(mask)
    with pytest.raises(DataError, match=r"network\.layers\[0\]: this window changes the sequence length"):
        net.module(x)


def test_a_sequence_shorter_than_the_kernel_is_named():
    net = MultiLayerNetwork(_config("seq_conv"), precision="double").init()  # any length: checked per batch
    with pytest.raises(DataError, match=r"network\.layers\[0\]: sequences of 2 steps \(\+0 padding\) are shorter"):
        net.output(torch.zeros(1, 2, 3, dtype=torch.float64))


# ---- memory estimate ------------------------------------------------------------------------
MEMORY_CASES = {
    "cnn": lambda: _conf(InputType.convolutional(10, 10, 2), ZeroPaddingLayer(padding=(1, 2)),
                         ConvolutionLayer(n_out=6, kernel_size=3, activation="relu"), Upsampling2D(size=2),
                         Deconvolution2D(n_out=4, kernel_size=3, stride=2, padding=1), LayerNormalization(),
                         GlobalPoolingLayer(pooling_type="avg"), OutputLayer(n_out=3)),
    "sequence": lambda: _conf(InputType.recurrent(6, 20),
                              Convolution1DLayer(n_out=24, kernel_size=3, padding=1, activation="relu"),
                              LayerNormalization(), SelfAttentionLayer(n_out=24, n_heads=3),
                              Subsampling1DLayer(kernel_size=3, stride=1, padding=1), RnnOutputLayer(n_out=3)),
}


@pytest.mark.parametrize("name", sorted(MEMORY_CASES))
def test_memory_estimate_is_within_5_percent_of_the_measured_peak(name):
    from dl4py.memory import estimate
    from dl4py.memory.measure import measure_training_step

    conf = MEMORY_CASES[name]()
    net = MultiLayerNetwork(conf, backend="cpu").init()
    g = torch.Generator().manual_seed(5)
    x = _features(conf, 16, 20, g).float()
    y = torch.randint(0, 3, (16, 20) if name == "sequence" else (16,), generator=g)
    measured = measure_training_step(net, x, y)
    assert estimate(conf, 16, device="cpu").peak_bytes == pytest.approx(measured.peak_bytes, rel=0.05)


def test_memory_command_and_report_cover_the_new_layers(tmp_path, capsys):
    from dl4py.cli import main
    from dl4py.memory import estimate

    conf = MEMORY_CASES["sequence"]()
    path = tmp_path / "attention.yaml"
    path.write_text(yaml.safe_dump({"network": conf.to_dict()}))
    assert main(["memory", str(path), "--device", "cpu", "--batch-size", "8", "--json"]) == 0
    by_layer = {row.type_name: row for row in estimate(conf, 8, device="cpu").layers}
    assert by_layer["convolution1d"].parameters == 6 * 24 * 3 + 24
    assert by_layer["layer_normalization"].parameters == 2 * 24
    assert by_layer["self_attention"].parameters == 3 * 24 * 24 + 24 * 24
    assert by_layer["subsampling1d"].parameters == 0
    assert by_layer["self_attention"].activation_bytes > 8 * 20 * 24 * 4  # at least its result
