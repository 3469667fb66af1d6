"""GraphConfig: a network as a graph of named layers and vertices (DL4J's
``ComputationGraphConfiguration``; that name is an alias).

Residual connections, several inputs, several outputs: each vertex names the inputs or
vertices it reads, in order, and holds either a layer (any layer of a ``NetworkConfig``) or a
parameter-free vertex (merge, element-wise, subset, preprocessor)::

    inputs: {image: {type: convolutional_flat, height: 28, width: 28, channels: 1}}
    vertices:
      conv1: {inputs: [image], layer: {type: convolution, n_out: 16, kernel_size: 3, padding: 1}}
      conv2: {inputs: [conv1], layer: {type: convolution, n_out: 16, kernel_size: 3, padding: 1}}
      add:   {inputs: [conv2, conv1], vertex: {type: elementwise, op: add}}
      out:   {inputs: [add], layer: {type: output, n_out: 10}}
    outputs: [out]

The order of computation is inferred (a stable topological order: as written, where the
data allows), and so is every shape. A cycle, a name that is neither an input nor a vertex,
a vertex nothing reads, or shapes that do not fit is a ``ConfigError`` naming the vertex
(``network.vertices.add``). docs/graphs.md has the whole language.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Optional

from dl4py.config.frozen import unfrozen
from dl4py.config.input_type import InputType, Recurrent
from dl4py.config.layers import Activation, GradientNormalization, Layer, OutputLayer, Shape, WeightInit
from dl4py.config.network import NetworkConfig, NetworkText
from dl4py.config.network_rules import check_network_defaults, check_sequence_rules, check_threshold
from dl4py.config.schema import ConfigBase, TaggedConfig, dataclass_from_dict, join
from dl4py.config.updaters import AdamW, Sgd, Updater
from dl4py.errors import ConfigError


class GraphVertex(TaggedConfig):
    """A vertex without parameters; ``output_shape`` checks the shapes it is given."""

    registry: ClassVar[dict[str, type]] = {}
    type_name: ClassVar[str | None] = None
    min_inputs: ClassVar[int] = 1
    max_inputs: ClassVar[int | None] = None

    def output_shape(self, inputs: tuple[Shape, ...], where: str) -> Shape:
        raise NotImplementedError


def _same_kind(vertex: GraphVertex, inputs: tuple[Shape, ...], where: str) -> str:
    kinds = sorted({shape.kind for shape in inputs})
    if len(kinds) > 1:
        shown = ", ".join(f"{s.kind} {s}" for s in inputs)
        raise ConfigError(where, f"{vertex.type_name} needs inputs of one kind, got {shown}; put a "
                                 "preprocessor vertex (cnn_to_feed_forward) before the convolutional ones")
    return kinds[0]


@GraphVertex.register("merge")
@dataclass(frozen=True)
class MergeVertex(GraphVertex):
    """DL4J's ``MergeVertex``: its inputs side by side, along features (flat), channels
    (convolutional) or the size of each step (recurrent). Other dimensions must agree."""

    min_inputs: ClassVar[int] = 2

    def output_shape(self, inputs: tuple[Shape, ...], where: str) -> Shape:
        kind = _same_kind(self, inputs, where)
        axis = 1 if kind == "rnn" else 0  # rnn: (time, size); ff: (n,); cnn: (c, h, w)
        for shape in inputs[1:]:
            rest = [d for i, d in enumerate(shape.dims) if i != axis]
            first = [d for i, d in enumerate(inputs[0].dims) if i != axis]
            if rest != first:
                what = "height and width" if kind == "cnn" else "sequence length"
                raise ConfigError(where, f"merge needs inputs of the same {what}, got "
                                         f"{' and '.join(str(s) for s in inputs)}")
        dims = list(inputs[0].dims)
        dims[axis] = sum(shape.dims[axis] for shape in inputs)
        return Shape(kind, tuple(dims))


@GraphVertex.register("elementwise")
@dataclass(frozen=True)
class ElementWiseVertex(GraphVertex):
    """DL4J's ``ElementWiseVertex``: inputs of one shape combined element by element
    (``subtract`` takes exactly two: the first minus the second)."""

    op: Literal["add", "subtract", "product", "average", "max"] = "add"
    min_inputs: ClassVar[int] = 2

    def output_shape(self, inputs: tuple[Shape, ...], where: str) -> Shape:
        if self.op == "subtract" and len(inputs) != 2:
            raise ConfigError(where, f"elementwise subtract takes exactly 2 inputs, got {len(inputs)}")
        _same_kind(self, inputs, where)
        if any(shape != inputs[0] for shape in inputs[1:]):
            raise ConfigError(where, f"elementwise {self.op} needs inputs of one shape, got "
                                     f"{' and '.join(str(s) for s in inputs)}")
        return inputs[0]


@GraphVertex.register("subset")
@dataclass(frozen=True)
class SubsetVertex(GraphVertex):
    """DL4J's ``SubsetVertex``: features (flat), channels (convolutional) or step sizes
    (recurrent) ``from_index`` to ``to_index``, both included as in DL4J."""

    from_index: int
    to_index: int
    max_inputs: ClassVar[int | None] = 1

    def validate(self, where: str) -> None:
        if self.from_index < 0:
            raise ConfigError(join(where, "from_index"), f"must be zero or more, got {self.from_index}")
        if self.to_index < self.from_index:
            raise ConfigError(join(where, "to_index"),
                              f"must be at least from_index ({self.from_index}), got {self.to_index}")

    def output_shape(self, inputs: tuple[Shape, ...], where: str) -> Shape:
        shape = inputs[0]
        axis = 1 if shape.kind == "rnn" else 0
        size = shape.dims[axis]
        if self.to_index >= size:
            raise ConfigError(join(where, "to_index"), f"must be below the input's {size} "
                                                       f"{'channels' if shape.kind == 'cnn' else 'features'} "
                                                       f"(shape {shape}), got {self.to_index}")
        dims = list(shape.dims)
        dims[axis] = self.to_index - self.from_index + 1
        return Shape(shape.kind, tuple(dims))


@GraphVertex.register("preprocessor")
@dataclass(frozen=True)
class PreprocessorVertex(GraphVertex):
    """DL4J's ``PreprocessorVertex`` with its ``CnnToFeedForwardPreProcessor`` (flatten) or
    ``FeedForwardToCnnPreProcessor`` (``height``, ``width``, ``channels``)."""

    preprocessor: Literal["cnn_to_feed_forward", "feed_forward_to_cnn"]
    height: Optional[int] = None
    width: Optional[int] = None
    channels: Optional[int] = None
    max_inputs: ClassVar[int | None] = 1

    def validate(self, where: str) -> None:
        dims = (self.height, self.width, self.channels)
        if self.preprocessor == "feed_forward_to_cnn":
            for name, value in zip(("height", "width", "channels"), dims):
                if value is None or value <= 0:
                    raise ConfigError(join(where, name), f"feed_forward_to_cnn needs a positive {name}, got {value}")
        elif any(d is not None for d in dims):
            raise ConfigError(where, "cnn_to_feed_forward takes no height, width or channels")

    def output_shape(self, inputs: tuple[Shape, ...], where: str) -> Shape:
        shape = inputs[0]
        if self.preprocessor == "cnn_to_feed_forward":
            if shape.kind != "cnn":
                raise ConfigError(where, f"cnn_to_feed_forward needs convolutional input, got {shape.kind} {shape}")
            return shape.flat()
        if shape.kind != "ff":
            raise ConfigError(where, f"feed_forward_to_cnn needs flat input, got {shape.kind} {shape}")
        out = Shape("cnn", (self.channels, self.height, self.width))
        if out.size != shape.size:
            raise ConfigError(where, f"feed_forward_to_cnn: {self.channels}x{self.height}x{self.width} = "
                                     f"{out.size} values, but the input has {shape.size}")
        return out


@dataclass(frozen=True)
class GraphNode(ConfigBase):
    """One named vertex: what it reads (``inputs``, in order) and what it is: a ``layer``
    or a parameter-free ``vertex``, exactly one of them."""

    inputs: tuple[str, ...]
    layer: Optional[Layer] = None
    vertex: Optional[GraphVertex] = None

    def validate(self, where: str) -> None:
        if (self.layer is None) == (self.vertex is None):
            raise ConfigError(where, "needs exactly one of 'layer' (a layer) or 'vertex' (merge, elementwise, "
                                     "subset, preprocessor)")
        if not self.inputs:
            raise ConfigError(join(where, "inputs"), "must name at least one input or vertex")
        if self.layer is not None and len(self.inputs) != 1:
            raise ConfigError(join(where, "inputs"), f"a layer takes one input, got {len(self.inputs)} "
                                                     f"({', '.join(self.inputs)}): join them first with a "
                                                     "merge or elementwise vertex")
        if self.vertex is not None:
            low, high = self.vertex.min_inputs, self.vertex.max_inputs
            if len(self.inputs) < low or (high is not None and len(self.inputs) > high):
                wanted = f"exactly {low}" if low == high else f"at least {low}" if high is None else f"{low} to {high}"
                raise ConfigError(join(where, "inputs"), f"a {self.vertex.type_name} vertex takes {wanted} "
                                                         f"input(s), got {len(self.inputs)}")

    @property
    def kind(self) -> str:
        return self.layer.type_name if self.layer is not None else self.vertex.type_name


@dataclass(frozen=True)
class VertexShapes:
    """A vertex in computation order: the shape of each input as it receives it (a dense or
    output layer after a convolutional vertex receives it flattened) and its output's."""

    index: int
    name: str
    node: GraphNode
    inputs: tuple[Shape, ...]
    output: Shape

    @property
    def layer(self) -> Layer | None:
        return self.node.layer

    @property
    def input(self) -> Shape:  # a layer's one input, as LayerShapes names it
        return self.inputs[0]


@dataclass(frozen=True)
class GraphConfig(NetworkText, ConfigBase):
    inputs: dict[str, InputType]
    vertices: dict[str, GraphNode]
    outputs: tuple[str, ...]
    seed: int = 12345
    weight_init: WeightInit = "xavier"
    activation: Activation = "sigmoid"
    updater: Updater = field(default_factory=Sgd)
    l2: float = 0.0
    gradient_normalization: GradientNormalization = "none"
    gradient_normalization_threshold: float = 1.0

    config_path: ClassVar[str] = "network"

    # ---- conversion (to_json, from_yaml, ... as NetworkConfig's) ---------------------------
    @classmethod
    def from_dict(cls, data: Any, where: str = "network") -> "GraphConfig":
        return dataclass_from_dict(cls, data, where)

    # ---- what the rest of dl4py reads -----------------------------------------------------
    @property
    def layers(self) -> tuple[Layer, ...]:
        """The layers of the layer vertices, in computation order: the order in which
        ``GraphModule`` yields their modules (updater groups, gradient normalization)."""
        return tuple(v.layer for v in self.vertex_shapes() if v.layer is not None)

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(v.name for v in self.vertex_shapes() if v.layer is not None)

    @property
    def input_type(self) -> InputType | None:
        """The input type when the graph has one input (None with several): the data path
        reads it as a NetworkConfig's."""
        return next(iter(self.inputs.values())) if len(self.inputs) == 1 else None

    def output_layers(self) -> list[OutputLayer]:
        return [unfrozen(self.vertices[name].layer) for name in self.outputs]

    def input_shapes(self) -> dict[str, Shape]:
        """Each input's shape as the graph sees it: convolutional_flat data as [c, h, w]."""
        shapes = {}
        for name, input_type in self.inputs.items():
            if isinstance(input_type, Recurrent):
                shapes[name] = Shape("rnn", (input_type.length, input_type.size))
            elif hasattr(input_type, "channels"):
                shapes[name] = Shape("cnn", (input_type.channels, input_type.height, input_type.width))
            else:
                shapes[name] = Shape("ff", input_type.example_shape())
        return shapes

    # ---- validation and shape inference ------------------------------------------------
    def validate(self, where: str = "network") -> None:
        if not self.inputs:
            raise ConfigError(join(where, "inputs"), "must name at least one input with its input type")
        if not self.vertices:
            raise ConfigError(join(where, "vertices"), "must hold at least one vertex")
        if not self.outputs:
            raise ConfigError(join(where, "outputs"), "must name at least one output layer vertex")
        check_network_defaults(self, where)
        for name in self.vertices:
            if name in self.inputs:
                raise ConfigError(join(join(where, "vertices"), name), "has the name of an input; names must be unique")
        self._check_outputs(where)
        for name, node in self.vertices.items():
            if node.layer is not None:
                check_threshold(getattr(node.layer, "gradient_normalization_threshold", None),
                                join(_layer_at(where, name), "gradient_normalization_threshold"))
        if isinstance(self.updater, AdamW) and (
            self.l2 > 0 or any(getattr(layer, "l2", None) for layer in self.layers_as_written())
        ):
            raise ConfigError(join(where, "l2"),
                              "AdamW decays weights itself (updater.weight_decay); do not combine it with l2")
        self.vertex_shapes(where)

    def layers_as_written(self) -> list[Layer]:
        return [node.layer for node in self.vertices.values() if node.layer is not None]

    def _check_outputs(self, where: str) -> None:
        for i, name in enumerate(self.outputs):
            node = self.vertices.get(name)
            if node is None:
                raise ConfigError(join(join(where, "outputs"), i), f"{name!r} is not a vertex; vertices: "
                                                                   f"{', '.join(self.vertices)}")
            if node.layer is None or not isinstance(unfrozen(node.layer), OutputLayer):
                raise ConfigError(join(join(where, "outputs"), i),
                                  f"{name!r} must be an output layer vertex (a layer with a loss), got {node.kind!r}")
        if len(set(self.outputs)) != len(self.outputs):
            raise ConfigError(join(where, "outputs"), f"names a vertex twice: {list(self.outputs)}")
        for name, node in self.vertices.items():
            if node.layer is not None and isinstance(unfrozen(node.layer), OutputLayer) and name not in self.outputs:
                raise ConfigError(join(join(where, "vertices"), name),
                                  f"is an output layer but not listed in {join(where, 'outputs')}")

    def vertex_shapes(self, where: str = "network") -> list[VertexShapes]:
        """Every vertex in computation order with its input and output shapes."""
        at = join(where, "vertices")
        known = set(self.inputs) | set(self.vertices)
        readers: dict[str, list[str]] = {name: [] for name in known}
        for name, node in self.vertices.items():
            for i, source in enumerate(node.inputs):
                if source not in known:
                    raise ConfigError(join(join(join(at, name), "inputs"), i),
                                      f"{source!r} is neither an input ({', '.join(self.inputs)}) nor a vertex")
                if source == name:
                    raise ConfigError(join(at, name), "reads its own output: a graph has no cycles")
                readers[source].append(name)
        for name in self.outputs:
            if readers[name]:
                raise ConfigError(join(at, name), f"an output layer's scores feed no other vertex, but "
                                                  f"{', '.join(readers[name])} read them")
        for name in list(self.inputs) + list(self.vertices):
            if not readers[name] and name not in self.outputs:
                what = "input" if name in self.inputs else "vertex"
                raise ConfigError(join(at if what == "vertex" else join(where, "inputs"), name),
                                  f"this {what}'s output is read by no vertex and it is not an output")
        shapes = dict(self.input_shapes())
        order: list[VertexShapes] = []
        pending = list(self.vertices)
        while pending:
            ready = next((name for name in pending if all(s in shapes for s in self.vertices[name].inputs)), None)
            if ready is None:
                raise ConfigError(at, f"the vertices {_cycle(self.vertices, pending)} form a cycle: "
                                      "a graph must be acyclic")
            pending.remove(ready)
            node = self.vertices[ready]
            received = tuple(shapes[s] for s in node.inputs)
            vertex_at = join(at, ready)
            if node.layer is not None:
                received = (self._layer_input(node, received[0], vertex_at),)
                output = node.layer.output_shape(received[0], join(vertex_at, "layer"))
            else:
                output = node.vertex.output_shape(received, join(vertex_at, "vertex"))
            shapes[ready] = output
            order.append(VertexShapes(len(order), ready, node, received, output))
        return order

    def _layer_input(self, node: GraphNode, shape: Shape, where: str) -> Shape:
        layer = unfrozen(node.layer)
        if layer.type_name in ("dense", "output") and shape.kind == "cnn":
            shape = shape.flat()  # DL4J's CnnToFeedForwardPreProcessor, added as in a MultiLayerNetwork
        reads_input = node.inputs[0] in self.inputs
        # Embeddings read integer indices: only straight from an input (index 0 says so).
        check_sequence_rules(node.layer, 0 if reads_input else 1, shape, join(where, "layer"))
        return shape


ComputationGraphConfiguration = GraphConfig  # DL4J's name


def _layer_at(where: str, name: str) -> str:
    return join(join(join(where, "vertices"), name), "layer")


def _cycle(vertices: dict[str, GraphNode], pending: list[str]) -> str:
    """One cycle among the ``pending`` vertices, as ``a -> b -> a``: each waits on one before it."""
    waiting = set(pending)
    name, seen = pending[0], []
    while name not in seen:
        seen.append(name)
        name = next(s for s in vertices[name].inputs if s in waiting)
    loop = seen[seen.index(name):] + [name]
    return " <- ".join(loop)


def example_shape(network) -> tuple:
    """One example's shape as the data carries it: the input type's for one input; for a
    graph's several inputs one row of their values side by side (ComputationGraph.pack_inputs)."""
    if network.input_type is not None:
        return network.input_type.example_shape()
    total = 0
    for name, input_type in network.inputs.items():
        shape = input_type.example_shape()
        if None in shape:
            raise ConfigError(join(join("network", "inputs"), name), "several inputs travel side by side in one "
                                                                     "row per example, so each needs a fixed length")
        size = 1
        for d in shape:
            size *= d
        total += size
    return (total,)


def network_from_dict(data: Any, where: str = "network"):
    """A run config's ``network``: a GraphConfig when it has ``vertices``, else a NetworkConfig."""
    if isinstance(data, dict) and "vertices" in data:
        for key in ("inputs", "outputs"):
            if key not in data:
                raise ConfigError(join(where, key), "is required for a graph network (with vertices)")
        return GraphConfig.from_dict(data, where)
    return NetworkConfig.from_dict(data, where)
