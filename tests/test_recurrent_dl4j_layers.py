"""DL4J's other recurrent layers: GravesLSTM, GravesBidirectionalLSTM, SimpleRnn, Bidirectional and
an LSTM with another activation than tanh. Each against a plain numpy re-computation of DL4J's
equations (``LSTMHelpers.activateHelper``, ``SimpleRnn.activateHelper``,
``GravesBidirectionalLSTM.activateOutput``, ``BidirectionalLayer.activate``) on DL4J-shaped
random weights, mapped to torch's names as ``dl4j/param_layout.py`` maps them; finite
differences; padded sequences; config round trips and errors; memory."""

from __future__ import annotations

import zipfile

import numpy as np
import pytest
import torch
from torch.func import functional_call

from dl4py import (
    GRU,
    LSTM,
    Adam,
    Bidirectional,
    GravesBidirectionalLSTM,
    GravesLSTM,
    InputType,
    LastTimeStep,
    MultiLayerNetwork,
    NetworkConfig,
    OutputLayer,
    RnnOutputLayer,
    SimpleRnn,
    load,
)
from dl4py.config import DenseLayer
from dl4py.dl4j import param_slots, read_array
from dl4py.dl4j.param_layout import LSTM_BLOCKS, split_parameters
from dl4py.errors import ConfigError
from dl4py.memory import estimate
from dl4py.memory.measure import measure_training_step
from test_dl4j_layers import MODELS, _graph_layers, needs_dl4j_files

SIZE, N, TIME = 3, 4, 6
LENGTHS = [6, 2, 4]  # a full sequence and two padded ones


def _conf(input_type, *layers):
    builder = NetworkConfig.builder().seed(7).updater(Adam(learning_rate=0.01))
    for layer in layers:
        builder.layer(layer)
    return builder.input_type(input_type).build()


def _net(layer, size=SIZE) -> MultiLayerNetwork:
    return MultiLayerNetwork(_conf(InputType.recurrent(size), layer, RnnOutputLayer(n_out=2)),
                             precision="double").init()


def _mask(lengths=LENGTHS, time=TIME) -> torch.Tensor:
    return (torch.arange(time)[None, :] < torch.tensor(lengths)[:, None]).double()


def _features(seed=0, batch=len(LENGTHS), time=TIME, size=SIZE, fill=None) -> np.ndarray:
    x = np.random.default_rng(seed).normal(size=(batch, time, size))
    if fill is not None:  # garbage in the padding
        x[_mask().numpy() == 0] = fill
    return x


# ---- DL4J's equations in numpy (float64), in DL4J's parameter layout -----------------------------
_NP_ACT = {
    "tanh": np.tanh,
    "sigmoid": lambda z: 1.0 / (1.0 + np.exp(-z)),
    "hardsigmoid": lambda z: np.minimum(1.0, np.maximum(0.0, 0.2 * z + 0.5)),
    "relu": lambda z: np.maximum(z, 0.0),
    "softsign": lambda z: z / (1.0 + np.abs(z)),
    "identity": lambda z: z,
}


def _dl4j_lstm(x, W, RW, b, act, gate, peepholes, mask=None, forwards=True):
    """LSTMHelpers.activateHelper. W [nIn, 4n], RW [n, 4n (+3)], b [4n]; column blocks 0 the cell
    input, 1 the forget gate, 2 the output gate, 3 the input modulation gate; peephole columns
    wFF (forget, previous cell), wOO (output, current cell), wGG (input modulation, previous cell).
    With a mask, h and c are zeroed at masked steps inside the loop (DL4J's bidirectional case)."""
    n = RW.shape[0]
    batch, time, _ = x.shape
    h, c = np.zeros((batch, n)), np.zeros((batch, n))
    out = np.zeros((batch, time, n))
    a, g = _NP_ACT[act], _NP_ACT[gate]
    for t in range(time) if forwards else reversed(range(time)):
        z = x[:, t] @ W + h @ RW[:, :4 * n] + b
        cell_input = a(z[:, :n])
        forget = g(z[:, n:2 * n] + (c * RW[:, 4 * n] if peepholes else 0.0))
        modulation = g(z[:, 3 * n:] + (c * RW[:, 4 * n + 2] if peepholes else 0.0))
        c = forget * c + modulation * cell_input
        output = g(z[:, 2 * n:3 * n] + (c * RW[:, 4 * n + 1] if peepholes else 0.0))
        h = a(c) * output
        if mask is not None:
            h, c = h * mask[:, t:t + 1], c * mask[:, t:t + 1]
        out[:, t] = h
    return out


def _dl4j_simple_rnn(x, W, RW, b, act):
    """SimpleRnn.activateHelper: out_t = act(x_t W + out_{t-1} RW + b)."""
    batch, time, _ = x.shape
    out = np.zeros((batch, time, RW.shape[0]))
    h = np.zeros((batch, RW.shape[0]))
    for t in range(time):
        h = _NP_ACT[act](x[:, t] @ W + h @ RW + b)
        out[:, t] = h
    return out


def _reverse_real_steps(x, lengths):
    out = x.copy()
    for i, length in enumerate(lengths):
        out[i, :length] = x[i, :length][::-1]
    return out


def _random_dl4j(rng, size, n, kind):
    """DL4J-shaped parameters of one direction: (W, RW, b)."""
    columns = {"simple_rnn": n, "lstm": 4 * n}.get(kind, 4 * n)
    recurrent = columns + (3 if kind == "graves" else 0)
    return (rng.normal(size=(size, columns)) * 0.7, rng.normal(size=(n, recurrent)) * 0.7,
            rng.normal(size=columns) * 0.5)


def _to_torch(params, kind, suffix=""):
    """DL4J's (W, RW, b) -> torch's entries (param_layout's mapping); the bias split in two."""
    W, RW, b = params
    n = RW.shape[0]
    half = b * 0.3  # torch adds its two biases; DL4J has their sum
    if kind == "simple_rnn":
        rows = np.arange(n)
    else:
        rows = np.concatenate([np.arange(block * n, (block + 1) * n) for block in LSTM_BLOCKS])
    out = {f"weight_ih_l0{suffix}": W[:, rows].T, f"weight_hh_l0{suffix}": RW[:, :len(rows)][:, rows].T,
           f"bias_ih_l0{suffix}": (b - half)[rows], f"bias_hh_l0{suffix}": half[rows]}
    if kind == "graves":
        out.update({f"peephole_f_l0{suffix}": RW[:, 4 * n], f"peephole_o_l0{suffix}": RW[:, 4 * n + 1],
                    f"peephole_i_l0{suffix}": RW[:, 4 * n + 2]})
    return out


def _load(net, tensors):
    rnn = net.module[0].op.rnn
    state = rnn.state_dict()
    assert set(state) == set(tensors), sorted(state)
    rnn.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()})


def _layer_output(net, x, mask):
    net.set_mask(None if mask is None else torch.as_tensor(mask))
    with torch.no_grad():
        return net.module[0](torch.from_numpy(x)).numpy()


# Each case: (layer, kind of its cell, activation, gate) for one-direction layers.
ONE_DIRECTION = {
    "graves_lstm": (GravesLSTM(n_out=N), "graves", "tanh", "sigmoid"),
    "graves_lstm_hardsigmoid_softsign": (GravesLSTM(n_out=N, activation="softsign", gate_activation="hardsigmoid"),
                                         "graves", "softsign", "hardsigmoid"),
    "lstm_relu": (LSTM(n_out=N, activation="relu"), "lstm", "relu", "sigmoid"),
    "lstm_identity": (LSTM(n_out=N, activation="identity"), "lstm", "identity", "sigmoid"),
    "lstm_tanh": (LSTM(n_out=N), "lstm", "tanh", "sigmoid"),
    "simple_rnn": (SimpleRnn(n_out=N), "simple_rnn", "tanh", None),
    "simple_rnn_softsign": (SimpleRnn(n_out=N, activation="softsign"), "simple_rnn", "softsign", None),
}


def _reference_one_direction(x, params, kind, act, gate, mask):
    if kind == "simple_rnn":
        out = _dl4j_simple_rnn(x, *params, act)
        return out if mask is None else out * mask[:, :, None]  # DL4J masks its output afterwards
    return _dl4j_lstm(x, *params, act, gate, kind == "graves", mask)


@pytest.mark.parametrize("masked", [False, True], ids=["full", "padded"])
@pytest.mark.parametrize("name", sorted(ONE_DIRECTION))
def test_one_direction_layers_compute_dl4js_equations(name, masked):
    layer, kind, act, gate = ONE_DIRECTION[name]
    net = _net(layer)
    params = _random_dl4j(np.random.default_rng(1), SIZE, N, kind)
    _load(net, _to_torch(params, kind))
    x, mask = _features(fill=5.0), (_mask().numpy() if masked else None)
    expected = _reference_one_direction(x, params, kind, act, gate, mask)
    np.testing.assert_allclose(_layer_output(net, x, mask), expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("masked", [False, True], ids=["full", "padded"])
@pytest.mark.parametrize("gate", ["sigmoid", "hardsigmoid"])
def test_graves_bidirectional_adds_dl4js_two_masked_directions(gate, masked):
    net = _net(GravesBidirectionalLSTM(n_out=N, gate_activation=gate))
    rng = np.random.default_rng(2)
    forward, backward = _random_dl4j(rng, SIZE, N, "graves"), _random_dl4j(rng, SIZE, N, "graves")
    _load(net, {**_to_torch(forward, "graves"), **_to_torch(backward, "graves", "_reverse")})
    x, mask = _features(fill=5.0), (_mask().numpy() if masked else None)
    # DL4J: the backward pass runs from the padded end, its states zeroed at padded steps.
    expected = (_dl4j_lstm(x, *forward, "tanh", gate, True, mask)
                + _dl4j_lstm(x, *backward, "tanh", gate, True, mask, forwards=False))
    np.testing.assert_allclose(_layer_output(net, x, mask), expected, rtol=0, atol=1e-10)


_COMBINE = {"concat": lambda f, b: np.concatenate([f, b], axis=-1), "add": lambda f, b: f + b,
            "mul": lambda f, b: f * b, "average": lambda f, b: (f + b) / 2}
BIDIRECTIONAL = {
    "lstm_concat": (LSTM(n_out=N), "lstm", "tanh", "concat"),
    "lstm_relu_mul": (LSTM(n_out=N, activation="relu"), "lstm", "relu", "mul"),
    "graves_average": (GravesLSTM(n_out=N, gate_activation="hardsigmoid"), "graves", "tanh", "average"),
    "simple_rnn_add": (SimpleRnn(n_out=N), "simple_rnn", "tanh", "add"),
}


@pytest.mark.parametrize("masked", [False, True], ids=["full", "padded"])
@pytest.mark.parametrize("name", sorted(BIDIRECTIONAL))
def test_bidirectional_combines_a_forward_and_a_reversed_pass(name, masked):
    inner, kind, act, mode = BIDIRECTIONAL[name]
    gate = getattr(inner, "gate_activation", "sigmoid")
    net = _net(Bidirectional(inner, mode=mode))
    rng = np.random.default_rng(3)
    forward, backward = _random_dl4j(rng, SIZE, N, kind), _random_dl4j(rng, SIZE, N, kind)
    _load(net, {**_to_torch(forward, kind), **_to_torch(backward, kind, "_reverse")})
    x = _features(fill=5.0)
    lengths, mask = (LENGTHS, _mask().numpy()) if masked else ([TIME] * len(LENGTHS), None)
    # The backward copy sees each sequence's real steps reversed (DL4J's reverse with a mask).
    back = _reverse_real_steps(_reference_one_direction(_reverse_real_steps(x, lengths), backward, kind, act, gate,
                                                        mask), lengths)
    expected = _COMBINE[mode](_reference_one_direction(x, forward, kind, act, gate, mask), back)
    if mask is not None:
        expected = expected * mask[:, :, None]
    np.testing.assert_allclose(_layer_output(net, x, mask), expected, rtol=0, atol=1e-10)


@needs_dl4j_files
def test_dl4js_own_bidirectional_graph_is_reproduced_by_the_layers():
    """DL4J's own file and output (1.0.0-beta4 SyntheticBidirectionalRNNGraph, float):
    Bidirectional(LSTM, relu) and Bidirectional(SimpleRnn, relu) on the input, concatenated,
    max-pooled over time, a softmax output layer. dl4py's two layers, given the file's
    parameters as param_layout lays them out, give DL4J's output to float's precision."""
    folder = MODELS / "regression_testing" / "100b4"
    path = folder / "SyntheticBidirectionalRNNGraph_100b4.bin"
    conf, _ = _graph_layers(path)
    values = split_parameters(param_slots(conf), read_array(zipfile.ZipFile(path).read("coefficients.bin")),
                              path.name)
    x = read_array(folder / "SyntheticBidirectionalRNNGraph_Input_100b4.bin").astype(np.float64)  # NCW
    x = np.ascontiguousarray(x.transpose(0, 2, 1))
    outputs = []
    for i, inner in enumerate([LSTM(n_out=16, activation="relu"), SimpleRnn(n_out=16, activation="relu")]):
        net = _net(Bidirectional(inner), size=x.shape[2])
        _load(net, {k.removeprefix(f"{i}.op.rnn."): v.astype(np.float64) for k, v in values.items()
                    if k.startswith(f"{i}.op.rnn.")})
        outputs.append(_layer_output(net, x, None))
    logits = np.concatenate(outputs, axis=2).max(axis=1) @ values["3.op.weight"].T + values["3.op.bias"]
    probabilities = np.exp(logits - logits.max(axis=1, keepdims=True))
    probabilities /= probabilities.sum(axis=1, keepdims=True)
    expected = read_array(folder / "SyntheticBidirectionalRNNGraph_Output_100b4.bin")
    np.testing.assert_allclose(probabilities, expected, rtol=1e-5, atol=0)


def test_bidirectional_gru_runs_both_directions_of_pytorchs_gru():
    # DL4J has no GRU; the wrapper's contract (a reversed pass, combined) is what is checked.
    net = _net(Bidirectional(GRU(n_out=N), mode="add"))
    x = torch.from_numpy(_features())
    rnn = net.module[0].op.rnn
    reference = torch.nn.GRU(SIZE, N, batch_first=True, bidirectional=True).double()
    reference.load_state_dict(rnn.state_dict())
    with torch.no_grad():
        out, _ = reference(x)
        net.set_mask(None)
        np.testing.assert_allclose(net.module[0](x).numpy(), (out[..., :N] + out[..., N:]).numpy(), atol=1e-12)


def test_last_time_step_takes_a_bidirectional_layers_last_real_step():
    conf = _conf(InputType.recurrent(SIZE), LastTimeStep(Bidirectional(GravesLSTM(n_out=N))), OutputLayer(n_out=2))
    net = MultiLayerNetwork(conf, precision="double").init()
    x, mask = torch.from_numpy(_features(fill=5.0)), _mask()
    net.set_mask(mask)
    with torch.no_grad():
        last = net.module[0](x)
        full = net.module[0].op.op(x)
    assert last.shape == (3, 2 * N)
    for i, length in enumerate(LENGTHS):
        assert torch.equal(last[i], full[i, length - 1])


# ---- gradients ----------------------------------------------------------------------------------
GRADIENT_LAYERS = {
    "graves_lstm": GravesLSTM(n_out=3),
    "graves_lstm_hardsigmoid": GravesLSTM(n_out=3, gate_activation="hardsigmoid", activation="softsign"),
    "graves_bidirectional_lstm": GravesBidirectionalLSTM(n_out=3),
    "lstm_relu": LSTM(n_out=3, activation="relu"),
    "simple_rnn_softsign": SimpleRnn(n_out=3, activation="softsign"),
    "bidirectional_lstm_concat": Bidirectional(LSTM(n_out=3)),
    "bidirectional_gru_mul": Bidirectional(GRU(n_out=3), mode="mul"),
    "bidirectional_simple_rnn_average": Bidirectional(SimpleRnn(n_out=3, activation="relu"), mode="average"),
}


@pytest.mark.parametrize("masked", [False, True], ids=["full", "padded"])
@pytest.mark.parametrize("name", sorted(GRADIENT_LAYERS))
def test_gradients_match_finite_differences(name, masked):
    net = _net(GRADIENT_LAYERS[name])
    with torch.no_grad():  # biases and peepholes start at zero, which would hide their gradients
        g = torch.Generator().manual_seed(4)
        for p in net.module.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    x = torch.from_numpy(_features(seed=5))
    y = torch.randint(0, 2, (len(LENGTHS), TIME), generator=g)
    net.set_mask(_mask() if masked else None)
    names = [n for n, _ in net.module.named_parameters()]

    def loss(features, *params):
        return net.loss(functional_call(net.module, dict(zip(names, params)), (features,)), y)

    params = tuple(p.detach().clone().requires_grad_(True) for p in net.module.parameters())
    # fast_mode: random directions of the Jacobian, seconds instead of minutes.
    assert torch.autograd.gradcheck(loss, (x.requires_grad_(True),) + params, eps=1e-6, atol=1e-6, fast_mode=True)


# ---- padded sequences ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(GRADIENT_LAYERS))
def test_padding_changes_nothing_for_the_real_steps(name):
    """Garbage in the padding: every sequence's real steps get what the sequence alone gets
    (the backward direction of a bidirectional layer included), and padded steps zero."""
    net = _net(GRADIENT_LAYERS[name])
    with torch.no_grad():
        g = torch.Generator().manual_seed(6)
        for p in net.module.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    x, mask = torch.from_numpy(_features(seed=7, fill=100.0)), _mask()
    net.set_mask(mask)
    with torch.no_grad():
        padded = net.module[0](x)
        assert torch.count_nonzero(padded * (1 - mask).unsqueeze(-1)) == 0
        net.set_mask(None)
        for i, length in enumerate(LENGTHS):
            alone = net.module[0](x[i:i + 1, :length])
            assert torch.allclose(padded[i, :length], alone[0], rtol=0, atol=1e-12), i


# ---- configuration ------------------------------------------------------------------------------
CONFIGS = [
    [GravesLSTM(n_out=5, activation="softsign", gate_activation="hardsigmoid", forget_gate_bias_init=0.5, l2=0.1)],
    [GravesBidirectionalLSTM(n_out=5, weight_init="uniform"), LastTimeStep(SimpleRnn(n_out=3, activation="relu"))],
    [Bidirectional(GravesLSTM(n_out=4, gate_activation="hardsigmoid"), mode="mul"),
     Bidirectional(SimpleRnn(n_out=3, activation="identity", l2=0.01), mode="average")],
    [LastTimeStep(Bidirectional(LSTM(n_out=4, activation="relu"), mode="concat"))],
]


@pytest.mark.parametrize("i", range(len(CONFIGS)))
def test_yaml_and_json_round_trip(i):
    last = OutputLayer(n_out=2) if isinstance(CONFIGS[i][-1], LastTimeStep) else RnnOutputLayer(n_out=2)
    conf = _conf(InputType.recurrent(3, 7), *CONFIGS[i], last)
    assert NetworkConfig.from_yaml(conf.to_yaml()) == conf
    assert NetworkConfig.from_json(conf.to_json()) == conf


@pytest.mark.parametrize("i", range(len(CONFIGS)))
def test_save_and_load_keep_outputs(i, tmp_path):
    last = OutputLayer(n_out=2) if isinstance(CONFIGS[i][-1], LastTimeStep) else RnnOutputLayer(n_out=2)
    conf = _conf(InputType.recurrent(3, 7), *CONFIGS[i], last)
    net = MultiLayerNetwork(conf).init()
    x = torch.randn(4, 7, 3, generator=torch.Generator().manual_seed(4))
    net.save(tmp_path / "model.dl4py")
    again = load(tmp_path / "model.dl4py")
    assert again.config == conf
    assert torch.equal(net.output(x), again.output(x))


def test_yaml_spelling_and_shapes():
    conf = NetworkConfig.from_yaml("""
input_type: {type: recurrent, size: 3}
layers:
  - {type: GravesLSTM, n_out: 4, gate_activation: HardSigmoid, activation: SOFTSIGN}
  - {type: bidirectional, mode: CONCAT, layer: {type: simple_rnn, n_out: 5}}
  - {type: graves_bidirectional_lstm, n_out: 6}
  - {type: rnn_output, n_out: 2}
""")
    assert conf.layers[0] == GravesLSTM(n_out=4, gate_activation="hardsigmoid", activation="softsign")
    assert [s.output.dims[1] for s in conf.layer_shapes()] == [4, 10, 6, 2]


def test_the_l2_of_a_wrapped_layer_reaches_its_weights():
    net = _net(Bidirectional(SimpleRnn(n_out=3, l2=0.25)))
    decays = {id(p): group["weight_decay"] for group in net.optimizer.param_groups for p in group["params"]}
    for name, p in net.module[0].named_parameters():
        assert decays[id(p)] == (0.25 if ".weight_" in name else 0.0), name


def test_the_l2_of_a_peephole_lstm_reaches_its_peepholes_as_dl4j_s_rw():
    """DL4J keeps the peephole weights in RW's last three columns: its L2 on RW reaches them."""
    net = _net(GravesBidirectionalLSTM(n_out=3, l2=0.5))
    decays = {id(p): group["weight_decay"] for group in net.optimizer.param_groups for p in group["params"]}
    named = dict(net.module[0].named_parameters())
    assert any(".peephole_" in name for name in named)
    for name, p in named.items():
        assert decays[id(p)] == (0.5 if (".weight_" in name or ".peephole_" in name) else 0.0), name


@pytest.mark.parametrize("layer, key", [
    ({"type": "graves_lstm", "n_out": 0}, "n_out"),
    ({"type": "graves_lstm", "n_out": 2, "gate_activation": "tanh"}, "gate_activation"),
    ({"type": "graves_lstm", "n_out": 2, "l2": -1}, "l2"),
    ({"type": "graves_bidirectional_lstm", "n_out": 2, "activation": "swish"}, "activation"),
    ({"type": "simple_rnn", "n_out": -3}, "n_out"),
    ({"type": "lstm", "n_out": 2, "activation": "cube"}, "activation"),
    ({"type": "bidirectional", "layer": {"type": "lstm", "n_out": 2}, "mode": "max"}, "mode"),
    ({"type": "bidirectional", "layer": {"type": "dense", "n_out": 2}}, "layer"),
    ({"type": "bidirectional", "layer": {"type": "graves_bidirectional_lstm", "n_out": 2}}, "layer"),
    ({"type": "bidirectional", "layer": {"type": "simple_rnn", "n_out": 0}}, "layer.n_out"),
    ({"type": "last_time_step", "layer": {"type": "dense", "n_out": 2}}, "layer"),
])
def test_bad_fields_are_named_by_key_path(layer, key):
    with pytest.raises(ConfigError) as error:
        NetworkConfig.from_dict({"input_type": {"type": "recurrent", "size": 4, "length": 8},
                                 "layers": [layer, {"type": "rnn_output", "n_out": 2}]})
    assert str(error.value).startswith(f"network.layers[0].{key}"), str(error.value)


def test_a_recurrent_layer_after_flat_input_is_named():
    with pytest.raises(ConfigError, match=r"network\.layers\[1\]: bidirectional needs recurrent input"):
        NetworkConfig.from_dict({"input_type": {"type": "feed_forward", "size": 4},
                                 "layers": [DenseLayer(n_out=3).to_dict(),
                                            {"type": "bidirectional", "layer": {"type": "lstm", "n_out": 2}},
                                            {"type": "rnn_output", "n_out": 2}]})


# ---- memory -------------------------------------------------------------------------------------
MEMORY_CASES = {
    "graves_lstm": lambda: _conf(InputType.recurrent(8, 20), GravesLSTM(n_out=32),
                                 LastTimeStep(GravesLSTM(n_out=16, gate_activation="hardsigmoid")),
                                 OutputLayer(n_out=3)),
    "lstm_relu": lambda: _conf(InputType.recurrent(8, 20), LastTimeStep(LSTM(n_out=32, activation="relu")),
                               OutputLayer(n_out=3)),
    "simple_rnn": lambda: _conf(InputType.recurrent(8, 20), SimpleRnn(n_out=48, activation="softsign"),
                                LastTimeStep(SimpleRnn(n_out=32)), OutputLayer(n_out=3)),
    "graves_bidirectional_lstm": lambda: _conf(InputType.recurrent(8, 20), GravesBidirectionalLSTM(n_out=24),
                                               RnnOutputLayer(n_out=3)),
    "bidirectional": lambda: _conf(InputType.recurrent(8, 20), Bidirectional(LSTM(n_out=24)),
                                   LastTimeStep(Bidirectional(SimpleRnn(n_out=16), mode="add")),
                                   OutputLayer(n_out=3)),
    "bidirectional_gru_mul": lambda: _conf(InputType.recurrent(8, 20), Bidirectional(GRU(n_out=24), mode="mul"),
                                           LastTimeStep(Bidirectional(GravesLSTM(n_out=16), mode="average")),
                                           OutputLayer(n_out=3)),
}


@pytest.mark.parametrize("name", sorted(MEMORY_CASES))
def test_memory_estimate_is_within_5_percent_of_the_measured_peak(name):
    conf = MEMORY_CASES[name]()
    net = MultiLayerNetwork(conf, backend="cpu").init()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(16, 20, 8, generator=g)
    mask = torch.ones(16, 20)
    mask[:8, 17:] = 0  # half the sequences 3 steps shorter, as SequenceDataSetIterator pads them
    per_step = isinstance(conf.layers[-1], RnnOutputLayer)
    y = torch.randint(0, 3, (16, 20) if per_step else (16,), generator=g)
    measured = measure_training_step(net, x, y, mask=mask)
    assert estimate(conf, 16, device="cpu").peak_bytes == pytest.approx(measured.peak_bytes, rel=0.05)
