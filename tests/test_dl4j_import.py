"""DL4J ModelSerializer zips imported as dl4py MultiLayerNetworks (``dl4py.import_dl4j``), on the
real files in ``../shared/dl4j-models`` (DL4J's own test resources):

- 0.8.0 (``regression_testing/080``): DL4J set every parameter to 1, 2, ..., N, so the place of
  every value in every torch tensor is asserted, against tensors written here from DL4J's
  layout rules (the readme beside the files gives the Java code), not from the importer's;
- 1.0.0-beta4 (``regression_testing/100b4``): DL4J's own output on its own input, in float,
  double and half, through the custom-layer extension point;
- the integration tests' MLPMoon and LenetMnist: DL4J's predictions (made by the untrained
  model, as ``IntegrationTestBaselineGenerator`` does before training) and its evaluation
  after training (from ``paramsPostTrain.bin``), on the rows DL4J used, MNIST in the order of
  DL4J's seeded shuffle, reproduced from ``java.util.Random`` (``dl4j_data``);
- crafted zips: each a one-line DL4JFileError naming the file, the entry or the layer.
No processes; CPU only.
"""

from __future__ import annotations

import json
import logging
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from dl4py import InputType
from dl4py.config.layers import Layer, Shape
from dl4py.config.registry import BUILDER, LAYERS
from dl4py.config.updaters import Nesterovs, RmsProp
from dl4py.dl4j import (
    DL4JFileError,
    import_dl4j,
    load_parameters,
    param_slots,
    plan_import,
    read_array,
    read_dl4j_configuration,
    register_custom_layer,
    unregister_custom_layer,
    write_array,
)
from dl4py.dl4j.param_layout import join_parameters, split_parameters
from dl4py.nn.layer_init import ACTIVATIONS
from dl4j_data import JavaRandom, dl4j_mnist_order, mnist_rows, sigmoid, softmax

MODELS = Path(__file__).resolve().parents[1].parent / "shared" / "dl4j-models"
V080, V100B4, INTEGRATION = MODELS / "regression_testing" / "080", MODELS / "regression_testing" / "100b4", \
    MODELS / "dl4j-integration-tests"
CUSTOM_CLASS = "org.deeplearning4j.regressiontest.customlayer100a.CustomLayer"

pytestmark = pytest.mark.skipif(not MODELS.is_dir(), reason=f"needs DL4J's files in {MODELS}")


def _zip(name: str) -> Path:
    return V080 / f"080_ModelSerializer_Regression_{name}.zip"


def _state(net) -> dict[str, np.ndarray]:
    return {name: tensor.detach().numpy() for name, tensor in net.module.state_dict().items()}


# ---- DL4J's layouts, written out from its sources (not from dl4py's code) ----------------------

def _dense(first: int, n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, int]:
    """DefaultParamInitializer: W [nIn, nOut] in Fortran order (W[i, j] is value first + i + j*nIn),
    then b; torch's weight is W transposed, [nOut, nIn]."""
    weight = np.array([[first + i + j * n_in for i in range(n_in)] for j in range(n_out)], dtype=np.float32)
    bias = np.arange(first + n_in * n_out, first + n_in * n_out + n_out, dtype=np.float32)
    return weight, bias, first + n_in * n_out + n_out


# LSTMHelpers: DL4J's column blocks are 0 the cell input, 1 forget, 2 output, 3 the input gate;
# torch's rows are i, f, g (the cell input), o.
DL4J_BLOCK = {"i": 3, "f": 1, "g": 0, "o": 2}


def _graves(first: int, n_in: int, n: int, suffix: str = "") -> tuple[dict[str, np.ndarray], int]:
    """GravesLSTMParamInitializer: W [nIn, 4n], RW [n, 4n+3] (Fortran order), b [4n]; RW's last
    columns are the peepholes wFF, wOO, wGG."""
    def column(row: int) -> int:  # torch's gate row -> DL4J's column
        gate, unit = "ifgo"[row // n], row % n
        return DL4J_BLOCK[gate] * n + unit

    w_first, rw_first = first, first + n_in * 4 * n
    b_first = rw_first + n * (4 * n + 3)
    out = {
        f"weight_ih_l0{suffix}": [[w_first + i + column(r) * n_in for i in range(n_in)] for r in range(4 * n)],
        f"weight_hh_l0{suffix}": [[rw_first + a + column(r) * n for a in range(n)] for r in range(4 * n)],
        f"bias_ih_l0{suffix}": [b_first + column(r) for r in range(4 * n)],
        f"bias_hh_l0{suffix}": [0] * (4 * n),
        f"peephole_f_l0{suffix}": [rw_first + a + (4 * n) * n for a in range(n)],
        f"peephole_o_l0{suffix}": [rw_first + a + (4 * n + 1) * n for a in range(n)],
        f"peephole_i_l0{suffix}": [rw_first + a + (4 * n + 2) * n for a in range(n)],
    }
    return {k: np.array(v, dtype=np.float32) for k, v in out.items()}, b_first + 4 * n


# ---- 0.8.0: every value's place --------------------------------------------------------------------

def test_mlp_1_every_parameter_lands_where_dl4j_put_it():
    net = import_dl4j(_zip("MLP_1"))
    state = _state(net)
    assert set(state) == {"0.op.weight", "0.op.bias", "1.op.weight", "1.op.bias"}
    np.testing.assert_array_equal(state["0.op.weight"], [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]])
    np.testing.assert_array_equal(state["0.op.bias"], [13, 14, 15, 16])
    weight, bias, end = _dense(17, 4, 5)
    np.testing.assert_array_equal(state["1.op.weight"], weight)
    np.testing.assert_array_equal(state["1.op.bias"], bias)
    assert end - 1 == 41 and net.num_params() == 41
    # and the network as DL4J configured it (readme): relu, softmax + MCXENT, Nesterovs(0.15, 0.9)
    dense, output = net.config.layers
    assert (dense.n_out, dense.activation, output.n_out, output.activation, output.loss) == \
        (4, "relu", 5, "softmax", "mcxent")
    assert net.config.updater == Nesterovs(learning_rate=0.15, momentum=0.9)
    assert net.config.input_type == InputType.feed_forward(3) and net.precision.name == "float"


def test_mlp_2_maps_dropout_l2_and_clipping_and_says_what_it_leaves_out():
    plan = plan_import(_zip("MLP_2"))
    config = plan.mapped.config
    # DL4J's dropOut(0.6) keeps 60% of each layer's input: a dropout of rate 0.4 before it.
    assert [layer.type_name for layer in config.layers] == ["dropout", "dense", "dropout", "output"]
    assert config.layers[0].rate == pytest.approx(0.4) and config.layers[2].rate == pytest.approx(0.4)
    dense, output = config.layers[1], config.layers[3]
    assert (dense.activation, output.activation, output.loss) == ("leakyrelu", "identity", "mse")
    assert config.l2 == pytest.approx(0.2)
    assert dense.gradient_normalization == "clip_element_wise_absolute_value"
    assert dense.gradient_normalization_threshold == 1.5
    assert config.updater == RmsProp(learning_rate=0.15, rms_decay=0.96, epsilon=1e-8)
    assert any("L1 0.1" in line for line in plan.left_out)
    assert any("weight init DISTRIBUTION" in line for line in plan.left_out)
    assert any(line.startswith("updaterState.bin") for line in plan.left_out)
    with pytest.raises(DL4JFileError, match=r"MLP_2\.zip: strict import, but it would leave out: .*L1 0\.1"):
        import_dl4j(_zip("MLP_2"), strict=True)
    state = _state(import_dl4j(_zip("MLP_2")))
    weight, bias, first = _dense(1, 3, 4)
    np.testing.assert_array_equal(state["1.op.weight"], weight)
    np.testing.assert_array_equal(state["1.op.bias"], bias)
    weight, bias, end = _dense(first, 4, 5)
    np.testing.assert_array_equal(state["3.op.weight"], weight)
    np.testing.assert_array_equal(state["3.op.bias"], bias)
    assert set(state) == {"1.op.weight", "1.op.bias", "3.op.weight", "3.op.bias"} and end == 42


def test_0_8_l2_and_l1_count_only_where_regularization_was_switched_on(tmp_path):
    """0.7/0.8 kept l1/l2 in every layer but applied them only with useRegularization(true)."""
    conf = json.loads(zipfile.ZipFile(_zip("MLP_2")).read("configuration.json"))
    for layer_conf in conf["confs"]:
        layer_conf["useRegularization"] = False
    plan = plan_import(_rezip(_zip("MLP_2"), {"configuration.json": json.dumps(conf).encode()}, tmp_path))
    assert plan.mapped.config.l2 == 0.0 and not any("L1" in line for line in plan.left_out)


def test_cnn_1_lays_out_bias_first_then_c_order_weights_and_imports_with_same_mode_pooling():
    """Convolution: b [nOut] first, then W [nOut, nIn, kH, kW] in C order. The network's Same-mode
    2x2 convolution pads one side (a zero-padding layer before it) and its Same-mode 2x2 pooling
    pads one side with the padding left out of the max (dl4py's convolution_mode="same"). The
    file holds no input type, and its output layer's nIn 2028 is 26*26*3: Same mode keeps the
    size, so the input is 26x26x3 (the readme's comments count as if Truncate)."""
    conf = read_dl4j_configuration(_zip("CNN_1"))
    flat = read_array(zipfile.ZipFile(_zip("CNN_1")).read("coefficients.bin"))
    values = split_parameters(param_slots(conf), flat, "CNN_1")
    np.testing.assert_array_equal(values["0.op.bias"], [1, 2, 3])
    expected = np.zeros((3, 3, 2, 2), dtype=np.float32)
    for o in range(3):
        for i in range(3):
            for h in range(2):
                for w in range(2):
                    expected[o, i, h, w] = 4 + ((o * 3 + i) * 2 + h) * 2 + w
    np.testing.assert_array_equal(values["0.op.weight"], expected)
    weight, bias, end = _dense(40, 26 * 26 * 3, 5)
    np.testing.assert_array_equal(values["2.op.weight"], weight)
    np.testing.assert_array_equal(values["2.op.bias"], bias)
    assert end - 1 == flat.size == 10184
    with pytest.raises(DL4JFileError, match=r"CNN_1\.zip:configuration\.json: layer 0 \(.*ConvolutionLayer\): "
                                            r"the file does not hold the input's shape.*input_type="):
        import_dl4j(_zip("CNN_1"))
    net = import_dl4j(_zip("CNN_1"), input_type=InputType.convolutional(26, 26, 3))
    assert [layer.type_name for layer in net.config.layers] == ["zero_padding", "convolution", "subsampling", "output"]
    assert net.config.layers[0].padding == (0, 1, 0, 1) and net.config.layers[2].convolution_mode == "same"
    state = _state(net)
    np.testing.assert_array_equal(state["1.op.weight"], expected)
    np.testing.assert_array_equal(state["3.op.weight"], weight)
    x = torch.from_numpy(np.random.default_rng(2).normal(size=(2, 3, 26, 26)).astype(np.float32))
    assert net.output(x).shape == (2, 5)
    # Its CnnToFeedForward preprocessor says [3, 28, 28] (DL4J inferred it from the builder's
    # 28x28 input type) against the layers' [3, 26, 26], which the output layer's own nIn is: the
    # layers win, and the import says what it set aside
    plan = plan_import(_zip("CNN_1"), InputType.convolutional(26, 26, 3))
    assert any("the input preprocessor's [channels, height, width] [3, 28, 28] (the layers before give "
               "[3, 26, 26], which is the layer's nIn 2028: used)" in line for line in plan.left_out)
    with pytest.raises(DL4JFileError, match=r"layer 2 \(.*OutputLayer\): DL4J flattens \[channels, height, width\] "
                                            r"\[3, 28, 28\] here, but the layers before give \[3, 27, 27\]"):
        plan_import(_zip("CNN_1"), InputType.convolutional(27, 27, 3))  # neither the preprocessor nor the nIn


def test_lstm_1_graves_layouts_land_in_torch_gate_order_in_the_imported_network():
    """GravesLSTM and GravesBidirectionalLSTM (peephole LSTMs; softsign on the second): laid out
    exactly, onto nn.LSTM's entries and the peephole vectors, which are the imported network's."""
    net = import_dl4j(_zip("LSTM_1"))
    assert [layer.type_name for layer in net.config.layers if layer.type_name != "dropout"] == [
        "graves_lstm", "graves_bidirectional_lstm", "rnn_output"]
    conf = read_dl4j_configuration(_zip("LSTM_1"))
    flat = read_array(zipfile.ZipFile(_zip("LSTM_1")).read("coefficients.bin"))
    values = split_parameters(param_slots(conf), flat, "LSTM_1")
    forward, first = _graves(1, 3, 4)
    expected = {f"0.op.rnn.{k}": v for k, v in forward.items()}
    forward, first = _graves(first, 4, 4)
    backward, first = _graves(first, 4, 4, "_reverse")
    expected.update({f"1.op.rnn.{k}": v for k, v in (forward | backward).items()})
    weight, bias, end = _dense(first, 4, 5)
    expected.update({"2.op.weight": weight, "2.op.bias": bias})
    assert set(values) == set(expected) and end - 1 == flat.size == 477
    for name, value in expected.items():
        np.testing.assert_array_equal(values[name], value, err_msg=name)
    # DL4J's dropout on each layer's input becomes a dl4py layer before it: the import's prefixes
    # say where each DL4J layer's parameters went, and there they are
    prefixes = plan_import(_zip("LSTM_1")).mapped.prefixes
    assert prefixes == {0: "1.op", 1: "3.op", 2: "5.op"}
    state = _state(net)
    assert len(state) == len(expected)
    for name, value in expected.items():
        layer, rest = name.split(".", 1)
        np.testing.assert_array_equal(state[f"{prefixes[int(layer)]}.{rest.removeprefix('op.')}"], value, err_msg=name)
    graves, bidirectional = net.config.layers[1], net.config.layers[3]
    assert (graves.activation, bidirectional.activation) == ("tanh", "softsign")


def test_the_slots_go_back_to_the_flat_vector_exactly():
    """``from_torch`` undoes ``to_torch`` for every layout (the write-back's and the updater
    state's split rest on it), including the LSTM's two biases summed."""
    for name in ("MLP_1", "CNN_1", "LSTM_1"):
        conf = read_dl4j_configuration(_zip(name))
        slots = param_slots(conf)
        flat = np.arange(1, slots[-1].offset + slots[-1].count + 1, dtype=np.float64)
        tensors = split_parameters(slots, flat, name)
        if name == "LSTM_1":  # after training in torch its second bias is no longer zero
            tensors["0.op.rnn.bias_hh_l0"] = tensors["0.op.rnn.bias_hh_l0"] + 0.5
            tensors["0.op.rnn.bias_ih_l0"] = tensors["0.op.rnn.bias_ih_l0"] - 0.5
        np.testing.assert_array_equal(join_parameters(slots, tensors), flat)


def test_the_graph_files_with_recurrent_layers_import_as_graphs():
    """Graphs import (tests/test_dl4j_graph_import.py checks each); these two hold DL4J's
    peephole and bidirectional recurrent layers."""
    for path in (_zip("CG_LSTM_1"), V100B4 / "SyntheticBidirectionalRNNGraph_100b4.bin"):
        assert type(import_dl4j(path)).__name__ == "ComputationGraph"


# ---- 1.0 networks written here: DL4J's own equations against dl4py's modules ------------------------

def _layer(kind: str, **fields) -> dict:
    return {"layer": {"@class": f"org.deeplearning4j.nn.conf.layers.{kind}", **fields}, "seed": 7}


def _activation(name: str) -> dict:
    return {"@class": f"org.nd4j.linalg.activations.impl.Activation{name}"}


def _network_zip(folder: Path, layers: list[dict], params: np.ndarray) -> Path:
    """A 1.0-dialect ModelSerializer zip of ``layers`` holding ``params`` (double)."""
    path = folder / "network.zip"
    conf = {"confs": layers, "dataType": "DOUBLE", "inputPreProcessors": {}, "backpropType": "Standard"}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("configuration.json", json.dumps(conf))
        archive.writestr("coefficients.bin", write_array(params.reshape(1, -1)))
    return path


def test_an_lstm_runs_dl4j_s_equations_with_the_imported_parameters(tmp_path):
    """LSTMHelpers.activateHelper, written out: z = x W + h RW + b; block 0 through the layer's
    activation is the cell input, blocks 1, 2, 3 through the gate activation are the forget,
    output and input gates; c = f c + i a, h = o tanh(c). dl4py's nn.LSTM with the imported
    parameters gives the same, to double precision."""
    n_in, n, n_out, steps = 3, 4, 2, 5
    layers = [_layer("LSTM", nin=n_in, nout=n, activationFn=_activation("TanH"),
                     gateActivationFn=_activation("Sigmoid"), forgetGateBiasInit=1.0),
              _layer("RnnOutputLayer", nin=n, nout=n_out, activationFn=_activation("Softmax"),
                     lossFn={"@class": "org.nd4j.linalg.lossfunctions.impl.LossMCXENT"})]
    sizes = [n_in * 4 * n, n * 4 * n, 4 * n, n * n_out, n_out]
    params = np.random.default_rng(0).normal(size=sum(sizes))
    w, rw, b, w_out, b_out = np.split(params, np.cumsum(sizes)[:-1])
    w, rw, w_out = w.reshape(n_in, 4 * n, order="F"), rw.reshape(n, 4 * n, order="F"), w_out.reshape(n, n_out, order="F")
    x = np.random.default_rng(1).normal(size=(2, steps, n_in))
    h, c, expected = np.zeros((2, n)), np.zeros((2, n)), []
    for t in range(steps):
        z = x[:, t] @ w + h @ rw + b
        a, f, o, i = np.tanh(z[:, :n]), sigmoid(z[:, n:2 * n]), sigmoid(z[:, 2 * n:3 * n]), sigmoid(z[:, 3 * n:])
        c = f * c + i * a
        h = o * np.tanh(c)
        expected.append(softmax(h @ w_out + b_out))
    net = import_dl4j(_network_zip(tmp_path, layers, params))
    assert net.config.input_type == InputType.recurrent(n_in) and net.precision.name == "double"
    np.testing.assert_allclose(net.output(torch.from_numpy(x)).numpy(), np.stack(expected, axis=1), rtol=1e-12)


def test_batch_normalization_takes_dl4j_s_running_statistics(tmp_path):
    """BatchNormalizationParamInitializer: gamma, beta, mean, then log10(std) (useLogStd) or var;
    in inference DL4J computes gamma (x - mean) / sqrt(var + eps) + beta."""
    for log_std in (True, False):
        layers = [_layer("DenseLayer", nin=2, nout=5, activationFn=_activation("TanH")),
                  _layer("BatchNormalization", nin=5, nout=5, eps=1e-3, decay=0.9, useLogStd=log_std,
                         activationFn=_activation("Identity")),
                  _layer("OutputLayer", nin=5, nout=3, activationFn=_activation("Softmax"),
                         lossFn={"@class": "org.nd4j.linalg.lossfunctions.impl.LossMCXENT"})]
        rng = np.random.default_rng(2)
        w, b = rng.normal(size=(2, 5)), rng.normal(size=5)
        gamma, beta, mean, std = rng.normal(size=5), rng.normal(size=5), rng.normal(size=5), rng.uniform(0.5, 2, 5)
        w2, b2 = rng.normal(size=(5, 3)), rng.normal(size=3)
        stored = np.log10(std) if log_std else std ** 2
        params = np.concatenate([w.reshape(-1, order="F"), b, gamma, beta, mean, stored, w2.reshape(-1, order="F"), b2])
        net = import_dl4j(_network_zip(tmp_path, layers, params))
        x = rng.normal(size=(4, 2))
        normed = gamma * (np.tanh(x @ w + b) - mean) / np.sqrt(std ** 2 + 1e-3) + beta
        np.testing.assert_allclose(net.output(torch.from_numpy(x)).numpy(), softmax(normed @ w2 + b2), rtol=1e-10)
        assert net.config.layers[1].eps == 1e-3 and net.config.layers[1].decay == 0.9


def test_an_embedding_is_dl4j_s_weight_matrix_row_by_index(tmp_path):
    """EmbeddingLayerParamInitializer: W [nIn = vocabulary, nOut] in Fortran order, which is
    nn.Embedding's table as it is (no transpose)."""
    layers = [_layer("EmbeddingLayer", nin=6, nout=4, hasBias=False, activationFn=_activation("Identity")),
              _layer("OutputLayer", nin=4, nout=2, activationFn=_activation("Identity"),
                     lossFn={"@class": "org.nd4j.linalg.lossfunctions.impl.LossMSE"})]
    params = np.arange(1.0, 6 * 4 + 4 * 2 + 2 + 1)
    net = import_dl4j(_network_zip(tmp_path, layers, params))
    table = params[:24].reshape(6, 4, order="F")
    np.testing.assert_array_equal(net.module.state_dict()["0.op.embedding.weight"].numpy(), table)
    out = net.output(torch.tensor([[5.0], [2.0]], dtype=torch.float64)).numpy()
    np.testing.assert_allclose(out, table[[5, 2]] @ params[24:32].reshape(4, 2, order="F") + params[32:], rtol=1e-12)


def test_same_mode_pads_the_bottom_and_right_with_the_odd_zero(tmp_path):
    """ConvolutionMode.Same: out = ceil(in / stride), the padding that takes split with the smaller
    half on top and left (ConvolutionUtils.getSameModeTopLeftPadding): for a 2x2 kernel, one row
    of zeros below and one column right. DL4J flattens [channels, height, width] in C order."""
    layers = [_layer("ConvolutionLayer", nin=2, nout=3, kernelSize=[2, 2], stride=[1, 1], padding=[0, 0],
                     convolutionMode="Same", activationFn=_activation("Identity")),
              _layer("OutputLayer", nin=3 * 5 * 5, nout=2, activationFn=_activation("Identity"),
                     lossFn={"@class": "org.nd4j.linalg.lossfunctions.impl.LossMSE"})]
    params = np.random.default_rng(3).normal(size=3 + 3 * 2 * 2 * 2 + 75 * 2 + 2)
    net = import_dl4j(_network_zip(tmp_path, layers, params), input_type=InputType.convolutional(5, 5, 2))
    assert [layer.type_name for layer in net.config.layers] == ["zero_padding", "convolution", "output"]
    x = np.random.default_rng(4).normal(size=(2, 2, 5, 5))
    padded = np.pad(x, ((0, 0), (0, 0), (0, 1), (0, 1)))
    kernel = params[3:27].reshape(3, 2, 2, 2)  # the bias first, then [nOut, nIn, kH, kW] in C order
    windows = np.array([[padded[:, :, i:i + 2, j:j + 2] for j in range(5)] for i in range(5)])
    conv = np.einsum("ijnchw,ochw->noij", windows, kernel) + params[:3, None, None]
    expected = conv.reshape(2, 3 * 25) @ params[27:177].reshape(75, 2, order="F") + params[177:]
    np.testing.assert_allclose(net.output(torch.from_numpy(x)).numpy(), expected, rtol=1e-10)


def test_updater_schedules_dl4py_has_map_and_the_others_are_listed(tmp_path):
    moon = INTEGRATION / "MLPMoon" / "Model_RANDOM_INIT_UNTRAINED.zip"
    conf = json.loads(zipfile.ZipFile(moon).read("configuration.json"))
    schedules = [{"@class": "org.nd4j.linalg.schedule.ExponentialSchedule", "scheduleType": "EPOCH",
                  "initialValue": 0.1, "gamma": 0.5},
                 {"@class": "org.nd4j.linalg.schedule.MapSchedule", "scheduleType": "ITERATION",
                  "values": {"0": 0.1, "10": 0.01}}]
    for layer_conf, schedule in zip(conf["confs"], schedules):
        layer_conf["layer"]["iupdater"] = {"@class": "org.nd4j.linalg.learning.config.Adam", "learningRate": "NaN",
                                           "learningRateSchedule": schedule, "beta1": 0.8}
    plan = plan_import(_rezip(moon, {"configuration.json": json.dumps(conf).encode()}, tmp_path))
    updater = plan.mapped.config.updater
    assert (type(updater).__name__, updater.learning_rate, updater.beta1) == ("Adam", 0.1, 0.8)
    assert (updater.schedule.type_name, updater.schedule.gamma, updater.schedule.unit) == ("exponential", 0.5, "epoch")
    assert any(line.startswith("layer 1: learning-rate schedule MapSchedule") for line in plan.left_out)
    assert any(line.startswith("layers [1]: their own updaters") for line in plan.left_out)


# ---- 1.0.0-beta4: DL4J's outputs, custom layers, float / double / half ----------------------------

@dataclass(frozen=True)
class SplitActivationDense(Layer):
    """The test's own layer type for CustomLayerImpl: a dense layer whose first n_out // 2
    outputs take one activation and the rest another (DL4J's example, readme of 100b4)."""

    n_out: int
    first: str = "tanh"
    second: str = "sigmoid"

    def output_shape(self, shape: Shape, where: str) -> Shape:
        return Shape("ff", (self.n_out,))


class SplitActivation(nn.Module):
    def __init__(self, first: str, second: str):
        super().__init__()
        self.first, self.second = ACTIVATIONS[first](), ACTIVATIONS[second]()

    def forward(self, x):
        half = x.shape[1] // 2  # DL4J: output.columns() / 2
        return torch.cat([self.first(x[:, :half]), self.second(x[:, half:])], dim=1)


def _split_module(layer, shape, config, generator, masks, where):
    return nn.Linear(shape.size, layer.n_out), SplitActivation(layer.first, layer.second)


@pytest.fixture
def custom_layer_type():
    """Registers the layer type with dl4py's registry, and the DL4J class onto it, for one test;
    then removes both (the registry has no unregister: test_layer_registry checks its exact
    list of types in the same session)."""
    Layer.register("test_split_activation_dense")(SplitActivationDense)
    LAYERS.builder("test_split_activation_dense")(_split_module)
    register_custom_layer(CUSTOM_CLASS, lambda fields: SplitActivationDense(
        n_out=fields.n_out, first=fields.activation(), second=fields.activation("secondActivationFunction")))
    yield
    unregister_custom_layer(CUSTOM_CLASS)
    del Layer.registry["test_split_activation_dense"]
    del LAYERS._parts[BUILDER]["test_split_activation_dense"]


def _beta4(name: str, dtype: str):
    return (V100B4 / f"{name}_100b4_{dtype}.bin", read_array(V100B4 / f"{name}_Input_100b4_{dtype}.bin"),
            read_array(V100B4 / f"{name}_Output_100b4_{dtype}.bin"))


@pytest.mark.parametrize("dtype", ["float", "double", "half"])
def test_the_custom_layer_is_refused_by_name_until_registered(dtype):
    path, _, _ = _beta4("CustomLayerExample", dtype)
    with pytest.raises(DL4JFileError, match=rf"CustomLayerExample_100b4_{dtype}\.bin:configuration\.json: layer 1 "
                                            rf"\({CUSTOM_CLASS}\): a custom layer class with nothing registered "
                                            r"for it: .*register_custom_layer"):
        import_dl4j(path)


# DL4J's RegressionTest100b4 tolerance is 1e-3 relative. Float and double meet it by far; half
# has 11 significant bits (a relative spacing of 2**-10 ~ 1e-3), so there the bound is 2 units
# in the last place (DL4J's own test of this model allows 0.01 absolute).
TOLERANCE = {"float": 1e-6, "double": 1e-12}


@pytest.mark.parametrize("dtype", ["float", "double", "half"])
def test_the_custom_layer_example_gives_dl4j_s_output_once_registered(dtype, custom_layer_type):
    path, features, expected = _beta4("CustomLayerExample", dtype)
    net = import_dl4j(path)
    assert net.precision.name == dtype and net.config.layers[1].type_name == "test_split_activation_dense"
    assert net.config.l2 == pytest.approx(0.03) and net.config.updater == RmsProp(learning_rate=0.95)
    out = net.output(torch.from_numpy(features)).numpy()
    assert out.dtype == expected.dtype
    if dtype == "half":
        np.testing.assert_array_max_ulp(out, expected, maxulp=2)
    else:
        np.testing.assert_allclose(out, expected, rtol=TOLERANCE[dtype], atol=0)


def test_synthetic_cnn_gives_dl4j_s_output():
    """1.0.0-beta4's SyntheticCNN: a strided convolution, a Same-mode separable convolution,
    pooling, zero padding, upsampling, a depthwise convolution (depth multiplier 2), pooling,
    cropping, a convolution and a CNN loss layer (MAE). The file keeps no input type: the input
    array's [n, 1, 28, 28] gives it. Its output on DL4J's input is DL4J's output within DL4J's
    own tolerance (1e-3 relative; it holds to float's precision)."""
    path = V100B4 / "SyntheticCNN_100b4.bin"
    features = read_array(V100B4 / "SyntheticCNN_Input_100b4.bin")
    expected = read_array(V100B4 / "SyntheticCNN_Output_100b4.bin")  # [4, 4, 11, 22]
    net = import_dl4j(path, input_type=InputType.convolutional(*features.shape[2:], features.shape[1]))
    assert [layer.type_name for layer in net.config.layers] == [
        "convolution", "separable_convolution2d", "subsampling", "zero_padding", "upsampling2d",
        "depthwise_convolution2d", "subsampling", "cropping2d", "convolution", "cnn_loss"]
    assert net.config.layers[-1].loss == "mae"
    out = net.output(torch.from_numpy(features)).numpy()
    np.testing.assert_allclose(out, expected, rtol=1e-3, atol=0)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


# ---- the integration tests' models: DL4J's predictions and evaluations ---------------------------

def _moon_rows() -> tuple[np.ndarray, np.ndarray]:
    table = np.loadtxt(INTEGRATION / "data" / "moon_data_eval.csv", delimiter=",", dtype=np.float32)
    return table[:, 1:], table[:, 0].astype(np.int64)  # RecordReaderDataSetIterator(rr, batch, 0, 2)


def _confusion(evaluation_json: Path) -> dict[tuple[int, int], int]:
    """DL4J's Evaluation confusion matrix: per actual class, [predicted classes, counts]."""
    matrix = json.loads(evaluation_json.read_text())["confusion"]["matrix"]
    return {(int(actual), int(p)): int(c) for actual, (predicted, counts) in matrix.items()
            for p, c in zip(predicted, counts) if c}


def _counts(actual: np.ndarray, predicted: np.ndarray) -> dict[tuple[int, int], int]:
    pairs, counts = np.unique(np.stack([actual, predicted], axis=1), axis=0, return_counts=True)
    return {(int(a), int(p)): int(c) for (a, p), c in zip(pairs, counts)}


def test_mlp_moon_predicts_as_dl4j_and_evaluates_as_dl4j_after_training():
    """MLPTestCases.getMLPMoon: predictions on moon_data_eval.csv's first row, then its first 10
    (a new iterator resets the reader), by the untrained model; after training
    (paramsPostTrain.bin) DL4J evaluated the whole file: the same confusion matrix here."""
    case = INTEGRATION / "MLPMoon"
    net = import_dl4j(case / "Model_RANDOM_INIT_UNTRAINED.zip")
    features, labels = _moon_rows()
    for name, rows in (("output_0_0.bin", 1), ("output_1_0.bin", 10)):
        np.testing.assert_allclose(net.output(torch.from_numpy(features[:rows])).numpy(),
                                   read_array(case / "predictions" / name), rtol=0, atol=1e-4)
    plan = plan_import(case / "Model_RANDOM_INIT_UNTRAINED.zip")
    load_parameters(net, plan.slots, read_array(case / "paramsPostTrain.bin"), "paramsPostTrain.bin")
    predicted = net.output(torch.from_numpy(features)).numpy().argmax(axis=1)
    assert _counts(labels, predicted) == _confusion(case / "evaluation" / "0.Evaluation.json")


def test_the_java_random_shuffle_gives_java_s_order():
    """Values printed by a JDK (17) for new Random(42).nextInt(10) and for the shuffle
    (``dl4j_data``, shared with the gradient test)."""
    rng = JavaRandom(42)
    assert [rng.next_int(10) for _ in range(5)] == [0, 3, 8, 4, 0]
    assert dl4j_mnist_order(60000, 12345)[:16] == [5310, 36545, 10388, 10768, 1311, 42299, 11497, 35849,
                                                   39700, 62, 20999, 33395, 51189, 42119, 19893, 11802]


def test_lenet_mnist_predicts_as_dl4j_and_evaluates_as_dl4j_after_training():
    """CNN2DTestCases.getLenetMnist: predictions on MnistDataSetIterator(8, true, 12345)'s first
    example, then its second batch, by the untrained model; after training, DL4J evaluated 10
    batches of MnistDataSetIterator(32, false, 12345): the same confusion matrix here."""
    case = INTEGRATION / "LenetMnist"
    net = import_dl4j(case / "Model_RANDOM_INIT_UNTRAINED.zip")
    assert [layer.type_name for layer in net.config.layers] == \
        ["convolution", "subsampling", "convolution", "subsampling", "dense", "output"]
    assert net.config.input_type == InputType.convolutional_flat(28, 28, 1) and net.config.l2 == 0.0005
    order = dl4j_mnist_order(60000, 12345)
    for name, rows in (("output_0_0.bin", order[:1]), ("output_1_0.bin", order[8:16])):
        features, _ = mnist_rows(True, rows)
        np.testing.assert_allclose(net.output(torch.from_numpy(features)).numpy(),
                                   read_array(case / "predictions" / name), rtol=0, atol=1e-4)
    plan = plan_import(case / "Model_RANDOM_INIT_UNTRAINED.zip")
    load_parameters(net, plan.slots, read_array(case / "paramsPostTrain.bin"), "paramsPostTrain.bin")
    features, labels = mnist_rows(False, dl4j_mnist_order(10000, 12345)[:320])
    predicted = net.output(torch.from_numpy(features)).numpy().argmax(axis=1)
    assert _counts(labels, predicted) == _confusion(case / "evaluation" / "0.Evaluation.json")


def test_an_imported_network_trains_and_evaluates():
    net = import_dl4j(INTEGRATION / "MLPMoon" / "Model_RANDOM_INIT_UNTRAINED.zip")
    data = tuple(torch.from_numpy(array) for array in _moon_rows())
    before = net.score(data, batch_size=100)
    net.fit(data, epochs=3, batch_size=32)
    assert net.score(data, batch_size=100) < before
    assert net.evaluate(data, batch_size=100).accuracy() > 0.5


def test_the_0_7_dialect_s_activation_strings_map_as_the_0_8_objects(tmp_path):
    conf = json.loads(zipfile.ZipFile(_zip("MLP_1")).read("configuration.json"))
    for layer_conf, activation in zip(conf["confs"], ("relu", "softmax")):
        (kind, fields), = layer_conf["layer"].items()
        fields.pop("activationFn")
        fields["activationFunction"] = activation
        if kind == "output":
            fields.pop("lossFn")
    old = _rezip(_zip("MLP_1"), {"configuration.json": json.dumps(conf).encode()}, tmp_path)
    assert plan_import(old).mapped.config == plan_import(_zip("MLP_1")).mapped.config


# ---- crafted and damaged zips: one line each -------------------------------------------------------

def _rezip(source: Path, replace: dict[str, bytes | None], folder: Path) -> Path:
    """``source`` with entries replaced (None: removed) or added, as ``folder``/crafted.zip."""
    path = folder / "crafted.zip"
    with zipfile.ZipFile(source) as original, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as copy:
        for info in original.infolist():
            if info.filename not in replace:
                copy.writestr(info.filename, original.read(info))
        for name, data in replace.items():
            if data is not None:
                copy.writestr(name, data)
    return path


def _one_line(exc: pytest.ExceptionInfo) -> None:
    assert "\n" not in str(exc.value), str(exc.value)


def _patch_central_directory(path: Path, entry: str, offset: int, value: int) -> None:
    """Write ``value`` into a field of ``entry``'s central-directory record (offset 20: the
    compressed size, 24: the uncompressed size)."""
    data = bytearray(path.read_bytes())
    at = data.find(b"PK\x01\x02")  # the first record; walk on to the entry's
    while True:
        name_length = struct.unpack_from("<H", data, at + 28)[0]
        if data[at + 46:at + 46 + name_length].decode() == entry:
            break
        extra, comment = struct.unpack_from("<HH", data, at + 30)
        at += 46 + name_length + extra + comment
    struct.pack_into("<I", data, at + offset, value)
    path.write_bytes(bytes(data))


def test_a_truncated_zip_is_one_line_naming_the_file(tmp_path):
    cut = tmp_path / "cut.zip"
    cut.write_bytes(_zip("MLP_1").read_bytes()[:700])
    with pytest.raises(DL4JFileError, match=r"cut\.zip: is not a readable zip file .*truncated") as exc:
        import_dl4j(cut)
    _one_line(exc)


def test_an_entry_longer_than_the_file_is_one_line_naming_it(tmp_path):
    path = tmp_path / "long.zip"
    path.write_bytes(_zip("MLP_1").read_bytes())
    _patch_central_directory(path, "coefficients.bin", 20, 10 ** 9)
    with pytest.raises(DL4JFileError, match=r"long\.zip:coefficients\.bin: its 1000000000 compressed bytes .* run "
                                            r"past the end of the \d+-byte file") as exc:
        import_dl4j(path)
    _one_line(exc)


def test_an_entry_claiming_more_than_deflate_can_give_is_refused_before_reading(tmp_path):
    path = tmp_path / "bomb.zip"
    path.write_bytes(_zip("MLP_1").read_bytes())
    _patch_central_directory(path, "configuration.json", 24, 2 ** 31)
    with pytest.raises(DL4JFileError, match=r"bomb\.zip:configuration\.json: claims 2147483648 bytes from 686 "
                                            r"compressed \(deflate\), more than that can give") as exc:
        import_dl4j(path)
    _one_line(exc)


def test_an_unknown_layer_class_is_one_line_naming_the_layer_and_class(tmp_path):
    conf = json.loads(zipfile.ZipFile(INTEGRATION / "MLPMoon" / "Model_RANDOM_INIT_UNTRAINED.zip")
                      .read("configuration.json"))
    conf["confs"][1]["layer"]["@class"] = "org.deeplearning4j.nn.conf.layers.FancyLayer"
    path = _rezip(INTEGRATION / "MLPMoon" / "Model_RANDOM_INIT_UNTRAINED.zip",
                  {"configuration.json": json.dumps(conf).encode()}, tmp_path)
    with pytest.raises(DL4JFileError, match=rf"{path.name}:configuration\.json: layer 1 "
                                            r"\(org\.deeplearning4j\.nn\.conf\.layers\.FancyLayer\): "
                                            r"dl4py has no counterpart for DL4J's FancyLayer") as exc:
        import_dl4j(path)
    _one_line(exc)


def test_coefficients_shorter_than_the_layers_need_is_one_line_naming_the_layer(tmp_path):
    short = write_array(np.arange(1, 31, dtype=np.float32).reshape(1, 30))
    path = _rezip(_zip("MLP_1"), {"coefficients.bin": short}, tmp_path)
    with pytest.raises(DL4JFileError, match=rf"{path.name}:coefficients\.bin: holds 30 parameters, the "
                                            r"configuration's layers take 41: it runs out in layer 1's W "
                                            r"\(values 16 to 35\)") as exc:
        import_dl4j(path)
    _one_line(exc)


@pytest.mark.parametrize("replace, message", [
    ({"coefficients.bin": None}, r"has no coefficients\.bin entry"),
    ({"configuration.json": b"{not json"}, r"configuration\.json: is not JSON: .* line 1 column 2"),
    # 41 parameters take at most 41 doubles and a header: 1352 bytes; this claims 4000 and more.
    ({"coefficients.bin": write_array(np.arange(1000, dtype=np.float32).reshape(1, -1))},
     r"coefficients\.bin: claims \d+ bytes, more than the 1352 its content can take"),
])
def test_other_damage_is_one_line_naming_the_entry(replace, message, tmp_path):
    path = _rezip(_zip("MLP_1"), replace, tmp_path)
    with pytest.raises(DL4JFileError, match=message) as exc:
        import_dl4j(path)
    _one_line(exc)


def test_a_malformed_layer_field_is_one_line_naming_the_layer(tmp_path):
    conf = json.loads(zipfile.ZipFile(_zip("MLP_1")).read("configuration.json"))
    conf["confs"][0]["layer"]["dense"]["nout"] = "four"
    path = _rezip(_zip("MLP_1"), {"configuration.json": json.dumps(conf).encode()}, tmp_path)
    with pytest.raises(DL4JFileError, match=r"crafted\.zip:configuration\.json: layer 0 "
                                            r"\(org\.deeplearning4j\.nn\.conf\.layers\.DenseLayer\): "
                                            r"a field is missing or malformed: .*n_out") as exc:
        import_dl4j(path)
    _one_line(exc)


def test_java_serialized_entries_are_never_read_and_are_said_to_be_left_out(caplog, monkeypatch, tmp_path):
    # Bytes that would be Java's serialization header, never looked at.
    path = _rezip(_zip("MLP_1"), {"preprocessor.bin": b"\xac\xed\x00\x05sr\x00", "updater.bin": b"\xac\xed"},
                  tmp_path)
    opened = []
    original = zipfile.ZipFile.open
    monkeypatch.setattr(zipfile.ZipFile, "open", lambda self, name, *a, **k: opened.append(
        getattr(name, "filename", name)) or original(self, name, *a, **k))
    with caplog.at_level(logging.WARNING, logger="dl4py.dl4j"):
        net = import_dl4j(path)
    assert net.num_params() == 41
    assert not {"preprocessor.bin", "updater.bin"} & set(opened)
    lines = [record.getMessage() for record in caplog.records if record.name == "dl4py.dl4j"]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "preprocessor.bin (a 0.7-era data normalizer, a Java-serialized object: dl4py never deserializes one)" \
        in lines[0] and "updater.bin (a 0.7-era updater" in lines[0]
