"""DL4J ComputationGraph zips imported as dl4py ComputationGraphs (``dl4py.dl4j.graph_mapping``).

The parameters' order is DL4J's topological order over the vertices (``ComputationGraph.init``);
where the file caches none it is the one DL4J's Kahn sort gives, whose tie-breaking follows
java.util.HashSet's iteration order (checked once against a JDK: a HashSet<Integer> of 1 and 16
iterates 16, 1). A graph written here in the 1.0 dialect, with parameters 1..N, checks each
value's destination and the forward pass against numpy (float64); DL4J's own graph files
(0.8 CG_LSTM_1, 1.0.0-beta4 SyntheticBidirectionalRNNGraph, 1.0.0-beta7 CNN1dCharacterTestCase)
hold layers dl4py lacks: each is refused in one line naming the vertex, the class and the file,
and its parameters are still laid out exactly (CG_LSTM_1's 1..N; CNN1dCharacter's gradients).
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from dl4py.dl4j import DL4JFileError, import_dl4j, param_slots, plan_import, read_array, read_dl4j_configuration
from dl4py.dl4j.graph_mapping import dl4j_topological_order, read_graph
from dl4py.dl4j.param_layout import split_parameters
from dl4py.dl4j.ndarray import write_array
from dl4py.nn import graph as graph_module
from test_dl4j_import import _activation, _dense, _graves
from dl4j_data import sigmoid, softmax

MODELS = Path(__file__).resolve().parents[1].parent / "shared" / "dl4j-models"
needs_dl4j_files = pytest.mark.skipif(not MODELS.is_dir(), reason=f"DL4J's model files are not in {MODELS}")
CG_LSTM_1 = MODELS / "regression_testing" / "080" / "080_ModelSerializer_Regression_CG_LSTM_1.zip"
SYNTHETIC = MODELS / "regression_testing" / "100b4" / "SyntheticBidirectionalRNNGraph_100b4.bin"
CNN1D = MODELS / "dl4j-integration-tests" / "CNN1dCharacterTestCase"
GRAPH = "org.deeplearning4j.nn.conf.graph."
RTOL, ATOL = 1e-10, 1e-12


# ---- DL4J's topological order -----------------------------------------------------------------

def test_the_order_is_dl4j_s_kahn_sort_with_java_hash_set_tie_breaking():
    """Input x (index 0) feeds c1 (index 1) and late (index 16): a HashSet<Integer> {1, 16} of 16
    buckets iterates 16 first (bucket 0), so DL4J visits late before c1's chain."""
    sources = {"c1": ("x",)}
    sources.update({f"c{i}": (f"c{i - 1}",) for i in range(2, 16)})
    sources["late"] = ("x",)
    sources["end"] = ("c15", "late")
    order = dl4j_topological_order(["x"], sources)
    assert order == ("x", "late", "c1", *(f"c{i}" for i in range(2, 16)), "end")
    # with fewer vertices the same shape of graph is visited in index order
    assert dl4j_topological_order(["x"], {"a": ("x",), "b": ("x",), "c": ("a", "b")}) == ("x", "a", "b", "c")
    with pytest.raises(DL4JFileError, match=r"the graph has a cycle \(through vertex 'a'\)"):
        dl4j_topological_order(["x"], {"a": ("x", "b"), "b": ("a",)})


# ---- a 1.0 graph written here -----------------------------------------------------------------

def _layer_vertex(kind: str, **fields) -> dict:
    updater = {"@class": "org.nd4j.linalg.learning.config.Nesterovs", "learningRate": 0.1, "momentum": 0.9}
    layer = {"@class": f"org.deeplearning4j.nn.conf.layers.{kind}", "iupdater": updater, **fields}
    return {"@class": GRAPH + "LayerVertex", "layerConf": {"layer": layer, "seed": 7}, "preProcessor": None}


def _vertex(kind: str, **fields) -> dict:
    return {"@class": GRAPH + kind, **fields}


def _graph(**changes) -> dict:
    """Two inputs (DL4J's order: b, then a), dense layers on each, their sum (ElementWiseVertex
    Add) merged with a (MergeVertex), features 1..6 of that (SubsetVertex), a softmax output.
    The JSON lists da before db, but DL4J's sort visits b's reader first: db's parameters come first."""
    conf = {
        "networkInputs": ["b", "a"], "networkOutputs": ["out"], "dataType": "DOUBLE",
        "vertexInputs": {"da": ["a"], "db": ["b"], "sum": ["da", "db"], "merge": ["sum", "a"], "sub": ["merge"],
                         "out": ["sub"]},
        "vertices": {
            "da": _layer_vertex("DenseLayer", nin=3, nout=4, activationFn=_activation("TanH")),
            "db": _layer_vertex("DenseLayer", nin=2, nout=4, activationFn=_activation("Sigmoid")),
            "sum": _vertex("ElementWiseVertex", op="Add"),
            "merge": _vertex("MergeVertex"),
            "sub": _vertex("SubsetVertex", **{"from": 1, "to": 6}),
            "out": _layer_vertex("OutputLayer", nin=6, nout=2, activationFn=_activation("Softmax"),
                                 lossFn={"@class": "org.nd4j.linalg.lossfunctions.impl.LossMCXENT"}),
        },
    }
    conf.update(changes)
    return conf


N_PARAMS = (2 * 4 + 4) + (3 * 4 + 4) + (6 * 2 + 2)


def _graph_zip(folder: Path, conf: dict, params: np.ndarray, state: np.ndarray | None = None) -> Path:
    path = folder / "graph.zip"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("configuration.json", json.dumps(conf))
        archive.writestr("coefficients.bin", write_array(params.reshape(1, -1)))
        if state is not None:
            archive.writestr("updaterState.bin", write_array(state.reshape(1, -1)))
    return path


def _state(model) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy() for k, v in model.module.state_dict().items()}


def _expected_1_to_n() -> dict[str, np.ndarray]:
    """Each torch entry as DL4J's 1..N lays it out: db (W [2, 4] f, b), da (W [3, 4] f, b), out."""
    w_b, b_b, first = _dense(1, 2, 4)
    w_a, b_a, first = _dense(first, 3, 4)
    w_o, b_o, end = _dense(first, 6, 2)
    assert end - 1 == N_PARAMS
    return {"vertices.db.op.weight": w_b, "vertices.db.op.bias": b_b, "vertices.da.op.weight": w_a,
            "vertices.da.op.bias": b_a, "vertices.out.op.weight": w_o, "vertices.out.op.bias": b_o}


def test_a_graph_s_parameters_land_where_dl4j_s_topological_order_puts_them(tmp_path):
    net = import_dl4j(_graph_zip(tmp_path, _graph(), np.arange(1, N_PARAMS + 1, dtype=np.float64)))
    assert isinstance(net, graph_module.ComputationGraph) and net.precision.name == "double"
    state, expected = _state(net), _expected_1_to_n()
    assert set(state) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)
    config = net.config
    assert list(config.inputs) == ["b", "a"] and config.outputs == ("out",)
    assert config.vertices["sum"].vertex.op == "add" and config.vertices["merge"].inputs == ("sum", "a")
    assert (config.vertices["sub"].vertex.from_index, config.vertices["sub"].vertex.to_index) == (1, 6)


def test_a_cached_topological_order_is_the_one_used(tmp_path):
    """1.0.0-beta4 on, DL4J saves its order (topologicalOrderStr) and lays the parameters out by it."""
    order = ["a", "b", "da", "db", "sum", "merge", "sub", "out"]
    conf = _graph(topologicalOrder=list(range(8)), topologicalOrderStr=order)
    net = import_dl4j(_graph_zip(tmp_path, conf, np.arange(1, N_PARAMS + 1, dtype=np.float64)))
    w_a, b_a, first = _dense(1, 3, 4)
    w_b, b_b, _ = _dense(first, 2, 4)
    state = _state(net)
    np.testing.assert_array_equal(state["vertices.da.op.weight"], w_a)
    np.testing.assert_array_equal(state["vertices.db.op.bias"], b_b)


def test_a_layer_vertex_that_becomes_two_dl4py_layers_is_chained_under_its_name(tmp_path):
    """DL4J's dropout on da's input (keep 0.6) is a DropoutLayer vertex 'da-0' before 'da' (which
    keeps the parameters); the merge reads what da gives. Outside training the forward is unchanged."""
    conf = _graph()
    conf["vertices"]["da"]["layerConf"]["layer"]["idropout"] = {
        "@class": "org.deeplearning4j.nn.conf.dropout.Dropout", "p": 0.6}
    params = np.random.default_rng(4).normal(size=N_PARAMS)
    net = import_dl4j(_graph_zip(tmp_path, conf, params))
    (tmp_path / "plain").mkdir()
    plain = import_dl4j(_graph_zip(tmp_path / "plain", _graph(), params))
    vertices = net.config.vertices
    assert vertices["da-0"].inputs == ("a",) and vertices["da-0"].layer.rate == pytest.approx(0.4)
    assert vertices["da"].inputs == ("da-0",) and vertices["sum"].inputs == ("da", "db")
    b, a = np.ones((2, 2)), np.full((2, 3), 0.5)
    with torch.no_grad():
        net.module.eval(), plain.module.eval()
        np.testing.assert_array_equal(net.module((torch.from_numpy(b), torch.from_numpy(a))).numpy(),
                                      plain.module((torch.from_numpy(b), torch.from_numpy(a))).numpy())


def _in_0_8_dialect(conf: dict) -> dict:
    """The same graph as DL4J 0.8 wrote graphs: vertices and layers wrapped in their type names,
    activations as wrapper objects, the updater as per-layer fields, no dataType."""
    layers = {"DenseLayer": "dense", "OutputLayer": "output"}
    vertices = {}
    for name, vertex in conf["vertices"].items():
        kind = vertex["@class"].rsplit(".", 1)[-1]
        fields = {k: v for k, v in vertex.items() if k != "@class"}
        if kind == "LayerVertex":
            layer = dict(fields["layerConf"]["layer"])
            java = layer.pop("@class").rsplit(".", 1)[-1]
            layer.pop("iupdater")
            layer["activationFn"] = {layer["activationFn"]["@class"].rsplit("Activation", 1)[-1]: {}}
            if "lossFn" in layer:
                layer["lossFn"] = {"MCXENT": {}}
            layer.update(updater="NESTEROVS", learningRate=0.1, momentum=0.9)
            fields = {"layerConf": {"layer": {layers[java]: layer}, "seed": 7}, "preProcessor": None}
        vertices[name] = {kind: fields}
    return {k: v for k, v in conf.items() if k != "dataType"} | {"vertices": vertices}


def test_the_0_8_dialect_graph_imports_to_the_same_places(tmp_path):
    net = import_dl4j(_graph_zip(tmp_path, _in_0_8_dialect(_graph()), np.arange(1, N_PARAMS + 1, dtype=np.float64)))
    state = _state(net)
    for name, value in _expected_1_to_n().items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)
    assert net.config.vertices["sum"].vertex.op == "add" and net.config.vertices["out"].layer.activation == "softmax"


def test_the_imported_graph_computes_dl4j_s_vertices(tmp_path):
    """DenseLayer: act(x W + b) with W [nIn, nOut] read in Fortran order; ElementWiseVertex Add,
    MergeVertex (side by side along features), SubsetVertex (from..to, both included), softmax."""
    rng = np.random.default_rng(3)
    params = rng.normal(size=N_PARAMS)
    net = import_dl4j(_graph_zip(tmp_path, _graph(), params))
    a, b = rng.normal(size=(5, 3)), rng.normal(size=(5, 2))
    w_b, b_b = params[:8].reshape(2, 4, order="F"), params[8:12]
    w_a, b_a = params[12:24].reshape(3, 4, order="F"), params[24:28]
    w_o, b_o = params[28:40].reshape(6, 2, order="F"), params[40:42]
    summed = np.tanh(a @ w_a + b_a) + sigmoid(b @ w_b + b_b)
    merged = np.concatenate([summed, a], axis=1)
    logits = merged[:, 1:7] @ w_o + b_o
    with torch.no_grad():  # the module, in double: output() packs several inputs into one float32 row
        got = net.module((torch.from_numpy(b), torch.from_numpy(a))).numpy()
    np.testing.assert_allclose(got, logits, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(net.output([b, a]).numpy(), softmax(logits), rtol=1e-6, atol=1e-7)


def test_a_graph_s_updater_state_lands_in_the_momentum_buffers(tmp_path):
    """updaterState.bin over the same order (DL4J's ComputationGraphUpdater takes the layers in
    topological order): Nesterovs' v 1..N, torch's momentum buffer -v / lr at each parameter's place."""
    values = np.arange(1, N_PARAMS + 1, dtype=np.float64)
    net = import_dl4j(_graph_zip(tmp_path, _graph(), values, state=values))
    names = {id(p): name for name, p in net.precision_state.stepped_module.named_parameters()}
    buffers = {names[id(p)]: s["momentum_buffer"].numpy() for p, s in net.optimizer.state.items()}
    expected = _expected_1_to_n()
    assert set(buffers) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(buffers[name], -value / 0.1, rtol=1e-15, err_msg=name)


def test_an_unknown_vertex_is_one_line_naming_it_and_nothing_is_built(tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(graph_module.ComputationGraph, "init", lambda self: built.append(self))
    conf = _graph()
    conf["vertices"]["sum"] = _vertex("StackVertex")
    path = _graph_zip(tmp_path, conf, np.arange(1, N_PARAMS + 1, dtype=np.float64))
    with pytest.raises(DL4JFileError) as caught:
        import_dl4j(path)
    message = str(caught.value)
    assert message == (f"{path}:configuration.json: vertex 'sum' (org.deeplearning4j.nn.conf.graph.StackVertex): "
                       "dl4py has no counterpart for DL4J's StackVertex (dl4py maps LayerVertex, MergeVertex, "
                       "ElementWiseVertex, SubsetVertex, PreprocessorVertex)")
    assert "\n" not in message and not built
    conf["vertices"]["sum"] = _vertex("ElementWiseVertex", op="Foo")
    with pytest.raises(DL4JFileError, match=r"vertex 'sum' \(org\.deeplearning4j\.nn\.conf\.graph\.ElementWiseVertex\)"
                                            r": op Foo has no dl4py counterpart"):
        import_dl4j(_graph_zip(tmp_path, conf, np.arange(1, N_PARAMS + 1, dtype=np.float64)))


def test_a_layer_vertex_dl4py_cannot_map_names_the_vertex_and_its_class(tmp_path):
    conf = _graph()
    conf["vertices"]["da"] = _layer_vertex("misc.ElementWiseMultiplicationLayer", nin=3, nout=3)
    with pytest.raises(DL4JFileError, match=r"graph\.zip:configuration\.json: vertex 'da', layer 1 "
                                            r"\(org\.deeplearning4j\.nn\.conf\.layers\.misc\.ElementWiseMultiplicationLayer\): "
                                            r"dl4py has no counterpart"):
        plan_import(_graph_zip(tmp_path, conf, np.arange(1, N_PARAMS + 1, dtype=np.float64)))


def test_a_graph_reading_a_name_it_lacks_is_one_line(tmp_path):
    conf = _graph()
    conf["vertexInputs"]["sum"] = ["da", "nowhere"]
    with pytest.raises(DL4JFileError, match=r"vertex 'sum' reads 'nowhere', which is neither a network input"):
        plan_import(_graph_zip(tmp_path, conf, np.arange(1, N_PARAMS + 1, dtype=np.float64)))


# ---- DL4J's own graph files ---------------------------------------------------------------------

@needs_dl4j_files
def test_cg_lstm_1_0_8_imports_as_a_graph_with_every_value_where_dl4j_put_it():
    """0.8's wrapper dialect ({"LayerVertex": {...}}): a GravesLSTM, a GravesBidirectionalLSTM and an
    RNN output layer, as a ComputationGraph; DL4J's 1..N lands in the entries the layouts name,
    and those are the imported graph's own tensors."""
    net = import_dl4j(CG_LSTM_1)
    assert type(net).__name__ == "ComputationGraph"
    assert [type(net.config.vertices[name].layer).__name__ for name in ("0", "1", "2")] == [
        "GravesLSTM", "GravesBidirectionalLSTM", "RnnOutputLayer"]
    graph = read_graph(read_dl4j_configuration(CG_LSTM_1))
    assert graph.order == ("in", "0", "1", "2") and graph.layer_names == ("0", "1", "2")
    prefixes = {i: f"vertices.{name}.op" for i, name in enumerate(graph.layer_names)}
    flat = read_array(zipfile.ZipFile(CG_LSTM_1).read("coefficients.bin"))
    values = split_parameters(param_slots(graph.layers, prefixes), flat, "CG_LSTM_1")
    forward, first = _graves(1, 3, 4)
    expected = {f"vertices.0.op.rnn.{k}": v for k, v in forward.items()}
    forward, first = _graves(first, 4, 4)
    backward, first = _graves(first, 4, 4, "_reverse")
    expected.update({f"vertices.1.op.rnn.{k}": v for k, v in (forward | backward).items()})
    weight, bias, end = _dense(first, 4, 5)
    expected.update({"vertices.2.op.weight": weight, "vertices.2.op.bias": bias})
    assert set(values) == set(expected) and end - 1 == flat.size == 477
    state = {name: tensor.detach().numpy() for name, tensor in net.module.state_dict().items()}
    assert set(state) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(values[name], value, err_msg=name)
        np.testing.assert_array_equal(state[name], value, err_msg=name)


@needs_dl4j_files
def test_synthetic_bidirectional_graph_imports_and_gives_dl4j_s_output():
    """1.0.0-beta4: Bidirectional(LSTM, relu) and Bidirectional(SimpleRnn, relu) on the input,
    merged, max-pooled over time, a softmax output: imported as a graph, its output on DL4J's
    input array is DL4J's output array within DL4J's own tolerance (RegressionTest100b4: 1e-3
    relative; here it holds to float's precision)."""
    net = import_dl4j(SYNTHETIC)
    graph = read_graph(read_dl4j_configuration(SYNTHETIC))
    assert graph.order == ("input", "rnn1", "rnn2", "concat", "pooling", "out")
    assert graph.vertices["concat"].kind == "MergeVertex" and graph.layer_names == ("rnn1", "rnn2", "pooling", "out")
    folder = SYNTHETIC.parent
    x = read_array(folder / "SyntheticBidirectionalRNNGraph_Input_100b4.bin")  # [4, 10, 10]: NCW
    expected = read_array(folder / "SyntheticBidirectionalRNNGraph_Output_100b4.bin")
    out = net.output(torch.from_numpy(x.transpose(0, 2, 1).copy())).numpy()  # dl4py's [batch, time, size]
    np.testing.assert_allclose(out, expected, rtol=1e-3, atol=0)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-7)


@needs_dl4j_files
def test_cnn1d_character_graph_imports_and_its_gradients_follow_the_graph_order():
    """1.0.0-beta7: a Same-mode 1-D convolution, Same-mode 1-D max pooling with stride 2 (its
    padding depends on each sequence's length), Cropping1D, ZeroPadding1D and an RNN output layer:
    imported as a graph, its untrained parameters in its modules. The graph's slots, in the
    cached topological order, cut flattenedGradients.bin into exactly the gradients/ files."""
    zip_path = CNN1D / "Model_RANDOM_INIT_UNTRAINED.zip"
    net = import_dl4j(zip_path)
    kinds = {name: type(node.layer).__name__ for name, node in net.config.vertices.items()}
    assert kinds == {"0": "Convolution1DLayer", "1": "Subsampling1DLayer", "2": "Cropping1D",
                     "3": "ZeroPadding1DLayer", "out": "RnnOutputLayer"}
    assert net.config.vertices["1"].layer.convolution_mode == "same"
    # the pooling's window [2, 1], stride [1, 2]: a 1-D layer's first values count, so stride 1,
    # Same mode padding one step after the sequence only; then one step cropped and padded each end
    x = torch.randn(2, 9, 77)
    assert net.output(x).shape == (2, 9, 77)
    graph = read_graph(read_dl4j_configuration(zip_path))
    assert graph.order == ("in", "0", "1", "2", "3", "out")
    prefixes = {i: f"vertices.{name}.op" for i, name in enumerate(graph.layer_names)}
    slots = param_slots(graph.layers, prefixes)
    assert [(graph.layer_names[s.layer], s.key) for s in slots] == [("0", "b"), ("0", "W"), ("out", "W"), ("out", "b")]
    flat = read_array(CNN1D / "flattenedGradients.bin")
    values = split_parameters(slots, flat, "flattenedGradients.bin")
    gradients = CNN1D / "gradients"
    np.testing.assert_array_equal(values["vertices.0.op.weight"], read_array(gradients / "0_W.bin")[..., 0])
    np.testing.assert_array_equal(values["vertices.0.op.bias"], read_array(gradients / "0_b.bin").reshape(-1))
    np.testing.assert_array_equal(values["vertices.out.op.weight"], read_array(gradients / "out_W.bin").T)
    np.testing.assert_array_equal(values["vertices.out.op.bias"], read_array(gradients / "out_b.bin").reshape(-1))
