"""A DL4J ComputationGraphConfiguration read (``read_graph``) and mapped onto dl4py's GraphConfig
(``map_graph``).

DL4J keeps a graph's parameters in one flat vector, vertex after vertex in the graph's
*topological order* (``ComputationGraph.init``: ``for (int vertexIdx : topologicalOrder)``, each
layer's part as its ParamInitializer lays it out), and its updater state in blocks over the same
order. That order is the configuration's cached ``topologicalOrder`` where the file has one
(1.0.0-beta4 on), else the one ``ComputationGraph.topologicalSortOrder`` computes: the network
inputs numbered first, then the vertices in the JSON's order; Kahn's algorithm with a FIFO queue,
started with the vertices without inputs in index order, and each vertex's readers visited in
the iteration order of a ``java.util.HashSet<Integer>`` (``dl4j_topological_order``).

The layer vertices, in that order, form ``DL4JGraph.layers``: a layer list like a
MultiLayerConfiguration's, so that ``param_layout.param_slots`` and ``optimizer_state`` lay out
the graph's parameters and updater state as they do a network's. Each layer vertex becomes a
dl4py layer vertex of the same name, whose parameters are ``vertices.<name>.<path>`` in the built
``GraphModule``; where one DL4J layer becomes several dl4py layers (a DropoutLayer for its
dropout, a ZeroPaddingLayer for uneven Same padding), the others are chained around it as
vertices named ``<name>-<k>``. MergeVertex, ElementWiseVertex (Add, Subtract, Product, Average,
Max), SubsetVertex and PreprocessorVertex map onto dl4py's; any other vertex is one error naming
the vertex, its DL4J class and the file.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from dl4py.config.graph import ElementWiseVertex, GraphConfig, GraphNode, MergeVertex, PreprocessorVertex, SubsetVertex
from dl4py.config.input_type import ConvolutionalFlat, FeedForward, InputType, Recurrent
from dl4py.config.layers import Shape
from dl4py.dl4j.json_dialects import (
    DL4JConfiguration,
    DL4JLayer,
    LayerFields,
    number,
    read_layer_conf,
    typed,
    wrapped_layer,
)
from dl4py.dl4j.layer_mapping import CONVOLUTIONAL, DENSE, NO_UPDATER, SEQUENCES, map_layer
from dl4py.dl4j.mapping_state import NetworkMapping
from dl4py.dl4j.ndarray import DL4JFileError
from dl4py.dl4j.training_settings import layer_updater, network_l2, network_updater
from dl4py.errors import ConfigError

GRAPH_PACKAGE = "org.deeplearning4j.nn.conf.graph."
_ELEMENTWISE_OPS = ("add", "subtract", "product", "average", "max")
_DL4PY_VERTICES = "LayerVertex, MergeVertex, ElementWiseVertex, SubsetVertex, PreprocessorVertex"
# java.util.HashSet's defaults: the table starts at 16 buckets and doubles past 3/4 full.
_HASH_CAPACITY, _HASH_LOAD = 16, 0.75


@dataclass(frozen=True)
class DL4JVertex:
    """One vertex as the file holds it: its simple class name (``kind``), its fields, the
    names it reads in order, and for a LayerVertex its layer and input preprocessor."""

    name: str
    java_class: str
    kind: str
    fields: dict
    inputs: tuple[str, ...]
    layer: DL4JLayer | None
    preprocessor: tuple[str, dict] | None


@dataclass(frozen=True)
class DL4JGraph:
    """A ComputationGraphConfiguration read: inputs, outputs, vertices (the file's order),
    DL4J's topological ``order`` (inputs included) and ``layers``: the layer vertices in that
    order as a layer list (layer i is vertex ``layer_names[i]``), for the parameter layout."""

    where: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    vertices: dict[str, DL4JVertex]
    order: tuple[str, ...]
    layers: DL4JConfiguration
    layer_names: tuple[str, ...]


@dataclass(frozen=True)
class MappedGraph:
    """A DL4J graph as dl4py's: the GraphConfig, where each DL4J layer's parameters are in the
    built GraphModule (``prefixes[i]`` for ``DL4JGraph.layers``' layer i, e.g.
    ``"vertices.dense1.op"``), what was left out, and the precision DL4J's ``dataType`` names."""

    config: GraphConfig
    prefixes: dict[int, str]
    left_out: tuple[str, ...]
    precision: str | None


# ---- reading -----------------------------------------------------------------------------------

def read_graph(conf: DL4JConfiguration) -> DL4JGraph:
    """The graph in a configuration ``read_configuration`` flagged ``is_graph``."""
    raw, where = conf.raw, conf.where
    inputs = _names(raw.get("networkInputs"), where, "networkInputs")
    outputs = _names(raw.get("networkOutputs"), where, "networkOutputs")
    found, vertex_inputs = raw.get("vertices"), raw.get("vertexInputs") or {}
    if not isinstance(found, dict) or not found or not isinstance(vertex_inputs, dict):
        raise DL4JFileError(where, "a graph's 'vertices' and 'vertexInputs' must be JSON objects by vertex name")
    known = set(inputs) | set(found)
    sources = {}
    for name in found:
        sources[name] = _names(vertex_inputs.get(name, []), where, f"vertexInputs[{name!r}]")
        unknown = [s for s in sources[name] if s not in known]
        if unknown:
            raise DL4JFileError(where, f"vertex {name!r} reads {unknown[0]!r}, which is neither a network input "
                                       "nor a vertex")
    for name in outputs:
        if name not in found:
            raise DL4JFileError(where, f"networkOutputs names {name!r}, which is not a vertex")
    order = _cached_order(raw, inputs, found, where) or dl4j_topological_order(inputs, sources, where)
    layers, layer_names = [], []
    by_name = {name: _read_vertex(name, found[name], sources[name], where) for name in found}
    for name in order:
        if name in by_name and by_name[name].kind == "LayerVertex":
            vertex = by_name[name]
            try:
                layer = read_layer_conf(len(layers), vertex.fields.get("layerConf"), where)
            except DL4JFileError as exc:
                raise DL4JFileError(where, f"vertex {name!r}: {exc.what}") from None
            by_name[name] = DL4JVertex(name, vertex.java_class, vertex.kind, vertex.fields, vertex.inputs, layer,
                                       vertex.preprocessor)
            layers.append(layer)
            layer_names.append(name)
    vertices = {name: by_name[name] for name in found}
    as_layers = DL4JConfiguration(where, tuple(layers), {}, conf.data_type, raw)
    return DL4JGraph(where, inputs, outputs, vertices, tuple(order), as_layers, tuple(layer_names))


def _names(value, where: str, what: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise DL4JFileError(where, f"{what} is {str(value)[:80]}, not a list of names")
    return tuple(value)


def _read_vertex(name: str, value, inputs: tuple[str, ...], where: str) -> DL4JVertex:
    kind, fields = typed(value)
    if kind is None:
        raise DL4JFileError(where, f"vertex {name!r} is {str(value)[:80]}: no vertex object DL4J writes")
    java_class = str(value["@class"]) if "@class" in value else GRAPH_PACKAGE + kind
    preprocessor = None
    if kind == "LayerVertex" and fields.get("preProcessor") is not None:
        pre_kind, pre_fields = typed(fields["preProcessor"])
        if pre_kind is None:
            raise DL4JFileError(where, f"vertex {name!r} ({java_class}): its preProcessor is no object DL4J writes")
        preprocessor = (pre_kind, pre_fields)
    return DL4JVertex(name, java_class, kind, fields, inputs, None, preprocessor)


def _cached_order(raw: dict, inputs, vertices: dict, where: str) -> tuple[str, ...] | None:
    """1.0.0-beta4 on: the order DL4J computed and saved with the configuration (``topologicalOrderStr``),
    which ``calculateIndices`` uses instead of sorting again."""
    order = raw.get("topologicalOrderStr")
    if order is None:
        return None
    if not isinstance(order, list) or sorted(map(str, order)) != sorted(list(inputs) + list(vertices)):
        raise DL4JFileError(where, "topologicalOrderStr does not list each input and vertex once")
    return tuple(order)


def dl4j_topological_order(inputs, sources: dict[str, tuple[str, ...]], where: str = "graph") -> tuple[str, ...]:
    """DL4J's ``topologicalSortOrder``: indices inputs first, then vertices as ``sources`` lists
    them; Kahn's algorithm, the queue started in index order (a HashMap of small Integer keys
    iterates in key order), each vertex's readers in its ``HashSet<Integer>``'s order."""
    names = list(inputs) + list(sources)
    index = {name: i for i, name in enumerate(names)}
    waiting = {i: set() for i in range(len(names))}
    readers: dict[int, list[int]] = {}
    for name, reads in sources.items():
        for source in dict.fromkeys(reads):
            waiting[index[name]].add(index[source])
            readers.setdefault(index[source], []).append(index[name])
    queue = deque(i for i in range(len(names)) if not waiting[i])
    order = []
    while queue:
        current = queue.popleft()
        order.append(current)
        for reader in _hash_set_order(readers.get(current, [])):
            waiting[reader].discard(current)
            if not waiting[reader]:
                queue.append(reader)
    if len(order) != len(names):
        stuck = next(names[i] for i in range(len(names)) if waiting[i])
        raise DL4JFileError(where, f"the graph has a cycle (through vertex {stuck!r})")
    return tuple(names[i] for i in order)


def _hash_set_order(values: list[int]) -> list[int]:
    """The iteration order of a ``java.util.HashSet<Integer>`` filled with ``values`` in turn:
    by bucket (an Integer's hash is itself; bucket = hash mod the table size), then insertion."""
    capacity = _HASH_CAPACITY
    while len(values) > capacity * _HASH_LOAD:
        capacity *= 2
    return sorted(values, key=lambda v: (v ^ (v >> 16)) & (capacity - 1))  # sorted() is stable


# ---- mapping -----------------------------------------------------------------------------------

def map_graph(graph: DL4JGraph, input_types: dict[str, InputType] | None = None) -> MappedGraph:
    """``graph`` as a dl4py GraphConfig (see the module docstring); ``input_types``: where the
    file does not say what a network input carries (by input name)."""
    input_types = {name: (input_types or {}).get(name) or _input_type(graph, name) for name in graph.inputs}
    shapes = {name: _shape(input_type) for name, input_type in input_types.items()}
    nodes, output_of, prefixes, left_out = {}, {}, {}, []
    updaters, layers, l2_elsewhere = {}, [], {}
    for name in graph.order:
        if name in graph.inputs:
            continue
        vertex = graph.vertices[name]
        sources = tuple(output_of.get(s, s) for s in vertex.inputs)
        if not sources:
            raise _vertex_error(graph, vertex, "reads nothing (no vertexInputs)")
        if vertex.layer is None:
            node = GraphNode(sources, vertex=_parameter_free(graph, vertex))
            shapes[name] = _vertex_shape(graph, vertex, node, [shapes[s] for s in sources])
            nodes[name] = node
            continue
        if len(sources) != 1:
            raise _vertex_error(graph, vertex, f"a layer vertex reading {len(sources)} inputs: dl4py's layer "
                                               "vertices read one (DL4J would merge them first)")
        fields = LayerFields(vertex.layer, graph.where)
        source = _preprocessed(graph, vertex, sources[0], shapes, nodes, input_types)
        mapping = NetworkMapping(graph.layers, shapes[source])
        try:
            map_layer(mapping, fields)
            if fields.index in mapping.prefixes and fields.layer.kind not in NO_UPDATER:
                updaters[fields.index] = layer_updater(wrapped_layer(fields), mapping.left_out)
        except DL4JFileError as exc:
            raise DL4JFileError(exc.where, f"vertex {name!r}, {exc.what}") from None
        except (KeyError, TypeError, ValueError, ConfigError) as exc:
            raise _vertex_error(graph, vertex, f"a field is missing or malformed: {exc}") from None
        last = _chain(name, source, mapping, nodes, prefixes, fields.index)
        output_of[name] = last
        shapes[last] = mapping.shape
        layers.extend(mapping.layers)
        l2_elsewhere.update(mapping.l2_elsewhere)
        left_out.extend(f"vertex {name!r}: {line}" for line in mapping.left_out)
    updater = network_updater(updaters, left_out)
    l2 = network_l2(layers, l2_elsewhere, left_out)
    seed = int(number((graph.layers.layers[0].conf if graph.layers.layers else {}).get("seed"), 12345))
    try:
        outputs = tuple(output_of.get(name, name) for name in graph.outputs)
        config = GraphConfig(inputs=input_types, vertices=nodes, outputs=outputs, seed=seed, updater=updater, l2=l2)
    except ConfigError as exc:
        raise DL4JFileError(graph.where, f"as a dl4py graph: {exc}") from None
    precision = {"FLOAT": "float", "DOUBLE": "double", "HALF": "half"}.get(graph.layers.data_type or "")
    return MappedGraph(config, prefixes, tuple(dict.fromkeys(left_out)), precision)


def _chain(name: str, source: str, mapping: NetworkMapping, nodes: dict, prefixes: dict, index: int) -> str:
    """The dl4py layers one DL4J layer vertex became, as vertices reading one another; the one
    with the parameters (or the last) is named ``name``. Returns the last one's name."""
    holder, path = len(mapping.layers) - 1, None
    if index in mapping.prefixes:
        position, path = mapping.prefixes[index].split(".", 1)
        holder = int(position)
    previous = source
    for k, layer in enumerate(mapping.layers):
        vertex_name = name if k == holder else f"{name}-{k}"
        nodes[vertex_name] = GraphNode((previous,), layer=layer)
        previous = vertex_name
    if path is not None:
        prefixes[index] = f"vertices.{name}.{path}"
    return previous


def _vertex_error(graph: DL4JGraph, vertex: DL4JVertex, what: str) -> DL4JFileError:
    return DL4JFileError(graph.where, f"vertex {vertex.name!r} ({vertex.java_class}): {what}")


def _parameter_free(graph: DL4JGraph, vertex: DL4JVertex):
    fields = vertex.fields
    if vertex.kind == "MergeVertex":
        axis = number(fields.get("mergeAxis"))
        if axis is not None and int(axis) != 1:
            raise _vertex_error(graph, vertex, f"merges along axis {int(axis)}: dl4py merges along DL4J's axis 1")
        return MergeVertex()
    if vertex.kind == "ElementWiseVertex":
        op, _ = typed(fields.get("op"))
        if str(op).lower() not in _ELEMENTWISE_OPS:
            raise _vertex_error(graph, vertex, f"op {op} has no dl4py counterpart (dl4py has Add, Subtract, "
                                               "Product, Average, Max)")
        return ElementWiseVertex(op=str(op).lower())
    if vertex.kind == "SubsetVertex":
        return _made(graph, vertex, SubsetVertex, from_index=int(fields["from"]), to_index=int(fields["to"]))
    if vertex.kind == "PreprocessorVertex":
        kind, values = typed(fields.get("preProcessor"))
        return _preprocessor_vertex(graph, vertex, kind, values)
    raise _vertex_error(graph, vertex, f"dl4py has no counterpart for DL4J's {vertex.kind} (dl4py maps "
                                       f"{_DL4PY_VERTICES})")


def _made(graph: DL4JGraph, vertex: DL4JVertex, cls, **values):
    try:
        return cls(**values)
    except (ConfigError, KeyError, TypeError, ValueError) as exc:
        raise _vertex_error(graph, vertex, str(exc)) from None


def _preprocessor_vertex(graph: DL4JGraph, vertex: DL4JVertex, kind: str | None, values: dict):
    low = (kind or "").lower()
    if isinstance(values.get("format"), str) and values["format"].upper() != "NCHW":
        raise _vertex_error(graph, vertex, f"preprocessor {kind} with format {values['format']}: dl4py maps NCHW")
    if low.startswith("cnntofeedforward"):
        return PreprocessorVertex("cnn_to_feed_forward")
    if low.startswith("feedforwardtocnn"):
        return _made(graph, vertex, PreprocessorVertex, preprocessor="feed_forward_to_cnn",
                     height=int(values["inputHeight"]), width=int(values["inputWidth"]),
                     channels=int(values["numChannels"]))
    raise _vertex_error(graph, vertex, f"preprocessor {kind} has no dl4py counterpart")


def _vertex_shape(graph: DL4JGraph, vertex: DL4JVertex, node: GraphNode, inputs: list[Shape]) -> Shape:
    try:
        node.validate(vertex.name)
        return node.vertex.output_shape(tuple(inputs), vertex.name)
    except ConfigError as exc:
        raise _vertex_error(graph, vertex, str(exc).split(": ", 1)[-1]) from None


def _preprocessed(graph: DL4JGraph, vertex: DL4JVertex, source: str, shapes: dict, nodes: dict,
                  input_types: dict) -> str:
    """A layer vertex's input preprocessor: checked (CnnToFeedForward before a dense layer, which
    dl4py flattens itself; FeedForwardToCnn on an input read as convolutional_flat) or made a
    preprocessor vertex before it. Returns the name the layer reads."""
    if vertex.preprocessor is None:
        return source
    kind, values = vertex.preprocessor
    low = kind.lower()
    if low.startswith("feedforwardtocnn") and isinstance(input_types.get(source), ConvolutionalFlat):
        return source
    shape = shapes[source]
    if low.startswith("cnntofeedforward") and shape.kind == "cnn" and vertex.layer.kind in DENSE:
        expected = (int(values.get("numChannels", -1)), int(values.get("inputHeight", -1)),
                    int(values.get("inputWidth", -1)))
        if tuple(shape.dims) != expected:
            raise _vertex_error(graph, vertex, f"DL4J flattens [channels, height, width] {list(expected)} here, "
                                               f"but its input gives {list(shape.dims)}")
        return source
    pre_vertex = _preprocessor_vertex(graph, vertex, kind, values)
    name = f"{vertex.name}-preprocessor"
    node = GraphNode((source,), vertex=pre_vertex)
    shapes[name] = _vertex_shape(graph, vertex, node, [shape])
    nodes[name] = node
    return name


def _input_type(graph: DL4JGraph, name: str) -> InputType:
    """What network input ``name`` carries, from the first layer vertex reading it (DL4J's
    files keep no input types): as ``config_json`` infers a network's."""
    reader = next((graph.vertices[v] for v in graph.order if v in graph.vertices
                   and name in graph.vertices[v].inputs and graph.vertices[v].layer is not None), None)
    if reader is not None:
        kind, values = reader.preprocessor or (None, {})
        if kind is not None and kind.lower().startswith("feedforwardtocnn"):
            return ConvolutionalFlat(int(values["inputHeight"]), int(values["inputWidth"]), int(values["numChannels"]))
        inner = wrapped_layer(LayerFields(reader.layer, graph.where))
        if inner.layer.kind == "EmbeddingLayer":
            return FeedForward(1)
        if inner.layer.kind == "EmbeddingSequenceLayer":
            return Recurrent(1)
        if inner.n_in and inner.layer.kind in SEQUENCES:
            return Recurrent(inner.n_in)
        if inner.n_in and inner.layer.kind not in CONVOLUTIONAL:
            return FeedForward(inner.n_in)
    raise DL4JFileError(graph.where, f"network input {name!r}: the file does not hold its shape (DL4J keeps no "
                                     f"input types): pass input_type={{{name!r}: InputType...}}")


def _shape(input_type: InputType) -> Shape:
    if isinstance(input_type, Recurrent):
        return Shape("rnn", (input_type.length, input_type.size))
    if hasattr(input_type, "channels"):
        return Shape("cnn", (input_type.channels, input_type.height, input_type.width))
    return Shape("ff", tuple(input_type.example_shape()))
