"""The step of a computation graph (a GraphConfig) as a ``StepGraph``.

A layer vertex contributes its layer's operators (``operations.layer_ops``, the chain's own
rules), the first reading the vertex's input. The other vertices follow what
``dl4py.nn.graph`` runs and PyTorch's derivative formulas:

- merge: ``torch.cat`` makes a new tensor and saves nothing; its backward hands each input
  a slice of the gradient (views: no bytes).
- element-wise: binary operators left to right, each result a new tensor. ``add`` saves
  nothing and hands the same gradient to both inputs; ``subtract`` hands the second a
  negated copy; ``product`` and ``max`` save both inputs and make a new gradient for each
  (``max`` with masks and a halved gradient on the side); ``average`` adds, then divides
  (a new tensor, and a new gradient).
- subset: a slice, a view; its backward makes a zero tensor of the input's size.
- preprocessor: a reshape, a view both ways.
"""

from __future__ import annotations

import dataclasses

from dl4py.config.frozen import unfrozen
from dl4py.memory.operations import Op, layer_ops
from dl4py.memory.sequence_ops import elements
from dl4py.memory.step_graph import LossHead, Node, StepGraph, graph_input, loss_head, reads_as_view

# element-wise op -> (its operator's name, saves its inputs, what its backward gives each input)
_ELEMENTWISE = {
    "add": ("add", False, ("same", "same")),
    "average": ("add", False, ("same", "same")),
    "subtract": ("sub", False, ("same", "new")),
    "product": ("mul", True, ("new", "new")),
    "max": ("maximum", True, ("new", "new")),
}


def graph_step(graph, device: str = "cuda") -> StepGraph:
    """The step of a GraphConfig: its vertices in topological order, its inputs and losses."""
    result: dict[str, int] = {name: graph_input(k) for k, name in enumerate(graph.inputs)}
    input_shapes = graph.input_shapes()
    nodes: list[Node] = []
    names = []
    losses: list[LossHead] = []
    for vertex in graph.vertex_shapes():
        names.append(f"vertex {vertex.name!r}")
        sources = tuple(result[name] for name in vertex.node.inputs)
        if vertex.node.layer is not None:
            ops = layer_ops(vertex.node.layer, vertex.index, vertex.inputs[0], vertex.output, graph,
                            device)
            for k, op in enumerate(ops):
                reads = sources if k == 0 else (len(nodes) - 1,)
                source = nodes[reads[0]].op if reads[0] >= 0 else None
                nodes.append(Node(op, reads, view=reads_as_view(op, source)))
        else:
            nodes += _vertex_nodes(vertex, sources, len(nodes), graph)
        # A layer without operators (an identity activation) hands on its input.
        result[vertex.name] = len(nodes) - 1 if nodes and nodes[-1].op.layer == vertex.index else sources[0]
        if vertex.name in graph.outputs:
            head = loss_head(unfrozen(vertex.node.layer), result[vertex.name], graph, vertex.output)
            if len(graph.outputs) > 1:  # labels travel side by side as float rows (ComputationGraph.pack_labels)
                head = dataclasses.replace(head, label_bytes=4 * head.classes)
            losses.append((graph.outputs.index(vertex.name), head))
    return StepGraph(
        nodes=tuple(nodes),
        input_elements=tuple(elements(input_shapes[name], graph) for name in graph.inputs),
        losses=tuple(head for _, head in sorted(losses, key=lambda pair: pair[0])),
        names=tuple(names),
    )


def _vertex_nodes(vertex, sources: tuple[int, ...], first: int, graph) -> list[Node]:
    kind, i = vertex.node.vertex.type_name, vertex.index
    out = elements(vertex.output, graph)
    if kind == "merge":
        return [Node(Op(i, "cat", out, False, False), sources, gradients=("slice",) * len(sources))]
    if kind == "subset":
        return [Node(Op(i, "slice", out, False, False), sources, view=True, gradients=("new",))]
    if kind == "preprocessor":
        return [Node(Op(i, "reshape", out, False, False), sources, view=True, gradients=("same",))]
    if kind == "elementwise":
        operation = vertex.node.vertex.op
        name, saves, gradients = _ELEMENTWISE[operation]
        # torch.maximum's backward, per input: where(x == y, grad / 2, grad).masked_fill_(x < y, 0).
        # While the second input's is made, the first's is done and two masks and grad / 2 live.
        scratch = (out, 2.0 * out) if operation == "max" else (0, 0.0)
        nodes = []
        for k, source in enumerate(sources[1:]):  # left to right: ((x0 op x1) op x2) ...
            pair = (sources[0] if k == 0 else first + len(nodes) - 1, source)
            nodes.append(Node(Op(i, name, out, saves, False), pair, gradients=gradients,
                              scratch_elements=scratch[0], scratch_bytes=scratch[1]))
        if operation == "average":
            nodes.append(Node(Op(i, "div", out, False, False), (first + len(nodes) - 1,), gradients=("new",)))
        return nodes
    raise TypeError(f"the memory estimator has no rule for graph vertex type {kind!r} (vertex {vertex.name!r})")
