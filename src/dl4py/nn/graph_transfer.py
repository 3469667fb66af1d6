"""Transfer learning on a computation graph (DL4J's ``TransferLearning.GraphBuilder``).

Vertices have names, so everything is said by name::

    graph = (TransferLearning.GraphBuilder(trained)      # a ComputationGraph, or a saved one's path
             .fine_tune_configuration(FineTuneConfiguration(updater=Adam(learning_rate=1e-3)))
             .set_feature_extractor("pool2")            # pool2 and every vertex it reads from: frozen
             .remove_vertex_and_connections("out")
             .add_layer("out5", OutputLayer(n_out=5), "dense")
             .set_outputs("out5")
             .build())

Kept vertices keep their parameters and batch-norm statistics bit for bit (matched by
vertex name); new vertices, resized ones and readers whose weights no longer fit are
initialised from the (fine-tune) seed.
"""

from __future__ import annotations

import dataclasses

from dl4py.config.frozen import FrozenLayer, unfrozen
from dl4py.config.graph import GraphConfig, GraphNode, GraphVertex
from dl4py.config.layers import Layer, WeightInit
from dl4py.config.schema import join
from dl4py.errors import ConfigError
from dl4py.nn.graph import ComputationGraph
from dl4py.nn.loading import load
from dl4py.nn.transfer import FineTuneConfiguration, _copy_kept

_HERE = "TransferLearning.GraphBuilder"


class GraphTransferLearning:
    """Each method returns the builder; ``build()`` the new ComputationGraph."""

    def __init__(self, graph):

        if not isinstance(graph, ComputationGraph):
            if isinstance(graph, (str, bytes)) or hasattr(graph, "__fspath__"):
                graph = load(graph)
            if not isinstance(graph, ComputationGraph):
                raise TypeError(f"{_HERE} needs a ComputationGraph or a saved one's path, got {type(graph).__name__}")
        self._source = graph.init()
        self._vertices: dict[str, GraphNode] = dict(graph.config.vertices)
        self._outputs: list[str] = list(graph.config.outputs)
        self._fresh: set[str] = set()  # initialised anew: added or resized
        self._frozen: tuple[str, ...] = ()
        self._fine_tune = None

    def fine_tune_configuration(self, fine_tune) -> "GraphTransferLearning":

        if not isinstance(fine_tune, FineTuneConfiguration):
            raise TypeError(f"fine_tune_configuration needs a FineTuneConfiguration, got {type(fine_tune).__name__}")
        self._fine_tune = fine_tune
        return self

    fine_tune = fine_tune_configuration

    def set_feature_extractor(self, *names: str) -> "GraphTransferLearning":
        """Freeze the named vertices and every layer vertex they read from, directly or not."""
        for name in names:
            self._existing(name, "set_feature_extractor")
        self._frozen = names
        return self

    def remove_vertex_and_connections(self, name: str) -> "GraphTransferLearning":
        """Remove the vertex, its name from the outputs and from every reader's inputs."""
        self._existing(name, "remove_vertex_and_connections")
        del self._vertices[name]
        self._outputs = [o for o in self._outputs if o != name]
        for reader, node in list(self._vertices.items()):
            if name in node.inputs:
                self._vertices[reader] = dataclasses.replace(node, inputs=tuple(i for i in node.inputs if i != name))
        return self

    def remove_vertex_keep_connections(self, name: str) -> "GraphTransferLearning":
        """Remove the vertex but leave its readers naming it: add one of that name again."""
        self._existing(name, "remove_vertex_keep_connections")
        del self._vertices[name]
        return self

    def add_layer(self, name: str, layer: Layer, *inputs: str) -> "GraphTransferLearning":
        if not isinstance(layer, Layer):
            raise TypeError(f"add_layer needs a layer config (e.g. OutputLayer(n_out=5)), got {type(layer).__name__}")
        return self._add(name, GraphNode(inputs=inputs, layer=layer), "add_layer")

    def add_vertex(self, name: str, vertex: GraphVertex, *inputs: str) -> "GraphTransferLearning":
        if not isinstance(vertex, GraphVertex):
            raise TypeError(f"add_vertex needs a vertex config (e.g. MergeVertex()), got {type(vertex).__name__}")
        return self._add(name, GraphNode(inputs=inputs, vertex=vertex), "add_vertex")

    def set_outputs(self, *names: str) -> "GraphTransferLearning":
        self._outputs = list(names)
        return self

    def n_out_replace(self, name: str, n_out: int, weight_init: WeightInit | None = None) -> "GraphTransferLearning":
        """Give layer vertex ``name`` ``n_out`` outputs; it is initialised anew, and so is each
        reader whose weights no longer fit."""
        node = self._existing(name, "n_out_replace")
        where = join(join(_HERE, "n_out_replace"), name)
        layer = unfrozen(node.layer) if node.layer is not None else None
        if layer is None or not hasattr(layer, "n_out"):
            raise ConfigError(where, f"({node.kind}) has no n_out to replace")
        if isinstance(node.layer, FrozenLayer):
            raise ConfigError(where, "is frozen in the source network; its outputs cannot change")
        changes = {"n_out": n_out, **({"weight_init": weight_init} if weight_init is not None else {})}
        try:
            self._vertices[name] = dataclasses.replace(node, layer=dataclasses.replace(layer, **changes))
        except ConfigError as exc:
            raise ConfigError(where, str(exc)) from None
        self._fresh.add(name)
        return self

    # ---- the new graph ------------------------------------------------------------------------
    def build(self):

        config = self._config()
        source = self._source
        graph = ComputationGraph(config, backend=source.backend, precision=source.precision).init()
        kept = [n for n in config.layer_names if n in source.config.vertices and n not in self._fresh]
        _copy_kept(source, graph, kept, layer_of=lambda root, name: root.vertices[name])
        graph.set_normalizer(source.normalizer)
        return graph

    def _config(self) -> GraphConfig:
        vertices = dict(self._vertices)
        for name in _ancestors(vertices, self._frozen):
            node = vertices[name]
            if node.layer is not None and not isinstance(node.layer, FrozenLayer):
                if name in self._outputs:
                    raise ConfigError(join(_HERE, "set_feature_extractor"),
                                      f"{name!r} is an output of the new graph: an output must train")
                vertices[name] = dataclasses.replace(node, layer=FrozenLayer(layer=node.layer))
        changes = self._fine_tune.changes(self._source.config) if self._fine_tune else {}
        try:
            return self._source.config.replace(vertices=vertices, outputs=tuple(self._outputs), **changes)
        except ConfigError as exc:
            raise ConfigError(_HERE, f"the transferred graph is not valid: {exc}") from None

    def _add(self, name: str, node: GraphNode, method: str) -> "GraphTransferLearning":
        if name in self._vertices or name in self._source.config.inputs:
            raise ConfigError(join(join(_HERE, method), name), "a vertex or input of that name exists; remove it first")
        self._vertices[name] = node
        self._fresh.add(name)
        return self

    def _existing(self, name: str, method: str) -> GraphNode:
        if name not in self._vertices:
            raise ConfigError(join(_HERE, method), f"{name!r} is not a vertex of the graph; vertices: "
                                                   f"{', '.join(self._vertices)}")
        return self._vertices[name]


def _ancestors(vertices: dict[str, GraphNode], names) -> set[str]:
    """``names`` and every vertex they read from, directly or not (inputs excluded)."""
    found, pending = set(), list(names)
    while pending:
        name = pending.pop()
        if name in found or name not in vertices:
            continue
        found.add(name)
        pending.extend(vertices[name].inputs)
    return found

