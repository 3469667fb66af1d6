"""Per-rank memory of tensor-parallel and hybrid training (``training.parallelism: tensor``,
dl4py's Megatron MLP, and ``hybrid``, Krizhevsky's; ``parallel/tensor_parallel.py``).

Every rank trains the same batch, and each pair of consecutive hidden dense layers is split
over the W ranks: the first by output columns, the second by input rows. So one rank's
tensors are those of the same network with the first layer of each pair narrowed to its
share of the columns, ceil(n_out / W) (``torch.chunk``'s split: rank 0 holds the most, and its
figure is the one given): that layer's weight, bias, output and activation are the rank's
shard; the second layer reads the narrow activation through its own rows, and its bias and
output are whole (replicated; its partial sums are all-reduced). Every other layer is
replicated. The distributed plans step their DTensors with the for-loop kernel
(``optimizer="loop"``), whose temporaries set the MLP's peak at small batches; at large ones
the peak is in the row-parallel layer's backward (``tensor_rank_graph``).

A hybrid rank trains the layers before the first dense one on its own rows and the rest as
a tensor rank on all ranks' rows (``hybrid_rank_graph``).

Checked against ``LiveTensorBytes`` on 2 gloo ranks (``tests/test_memory_tensor.py``): the
MLP 784-4000-4000-10 and LeNet's convolutions with a 2048-2048 dense head, to 4 bytes (the
loss's scalar) where the update sets the peak and within ``TOLERANCE`` where the backward
does: there the estimate was 0.02-0.08% over every measurement, at batches up to 4,298.
"""

from __future__ import annotations

from dataclasses import replace

from dl4py.config.graph import GraphConfig
from dl4py.errors import ConfigError
from dl4py.memory.op import Op
from dl4py.memory.step_graph import Node, StepGraph

# What the estimate may be short of a rank's measured peak (docs/memory.md); ``dl4py plan``
# keeps it free, so that a tensor plan's "fits" holds.
TOLERANCE = 0.01
NO_PAIRS = "no two hidden dense layers in a row to split (the tensor plans split dense pairs)"
NOTHING_APART = "the hybrid needs layers before the first dense layer to train apart"


def dense_pairs(network) -> list[tuple[int, int]]:
    """Consecutive hidden dense layers of a MultiLayerNetwork's config, paired from the first
    (``tensor_parallel_plan``'s rule, on the config); none for a graph."""
    if isinstance(network, GraphConfig):
        return []
    last = len(network.layers) - 1
    pairs, waiting = [], None
    for index, layer in enumerate(network.layers):
        dense = index < last and type(layer).__name__ == "DenseLayer"
        if not dense:
            waiting = None
        elif waiting is None:
            waiting = index
        else:
            pairs.append((waiting, index))
            waiting = None
    return pairs


def rank_network(network, workers: int, plan: str = "tensor"):
    """The network as one of ``workers`` ranks of the tensor (or hybrid) plan holds it: the
    first layer of each dense pair narrowed to rank 0's columns. A ConfigError where there is
    no pair to split."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 2:
        raise ConfigError("workers", f"{plan} parallelism needs 2 or more workers, got {workers!r}")
    if isinstance(network, GraphConfig):
        raise ConfigError("parallelism", f"{plan} splits the dense layers of a MultiLayerNetwork; this is a graph")
    pairs = dense_pairs(network)
    if not pairs:
        raise ConfigError("parallelism", f"{plan}: {NO_PAIRS}")
    layers = list(network.layers)
    for first, _ in pairs:
        layers[first] = replace(layers[first], n_out=-(-layers[first].n_out // workers))
    return replace(network, layers=layers)


def first_dense_layer(network) -> int | None:
    """Index of a MultiLayerNetwork config's first dense layer (DenseLayer or OutputLayer),
    where the hybrid gathers the ranks' rows (``gather_point``'s rule, on the config)."""
    return next((i for i, layer in enumerate(network.layers)
                 if type(layer).__name__ in ("DenseLayer", "OutputLayer")), None)


def gather_layer(network) -> int:
    """``first_dense_layer``; a ConfigError where no layer comes before it to train apart."""
    first = first_dense_layer(network)
    if not first:
        raise ConfigError("parallelism", f"hybrid: {NOTHING_APART}")
    return first


def tensor_rank_graph(network, workers: int):
    """What a rank's step holds besides the narrowed network's operators, around each
    row-parallel layer: its all-reduce, a copy of the layer's output forward; backward, the
    all-reduce's (Replicate to Partial) makes the output's gradient anew with two tensors of
    its size beside it, and the layer's own backward holds one tensor of its output's size and
    one of its input's beside the gradients (DTensor's copies). Found by ``LiveTensorBytes``
    (tests/test_memory_tensor.py): without them the MLP's rank measured 16.5% over the estimate at
    batch 2048 and more above."""
    seconds = {second for _, second in dense_pairs(network)}

    def edit(graph: StepGraph) -> StepGraph:
        def rewrite(j: int, node: Node) -> list[Node]:
            if node.op.layer not in seconds or node.op.name != "linear":
                return [node]
            widths = node.op.out_elements + graph.nodes[node.sources[0]].op.out_elements
            reduced = Op(node.op.layer, "all_reduce", node.op.out_elements, False, False,
                         backward_scratch_elements=2 * node.op.out_elements)
            return [replace(node, scratch_elements=node.scratch_elements + widths), Node(reduced, ())]

        return _rewired(graph, rewrite)

    return edit


def hybrid_rank_graph(network, workers: int):
    """A hybrid rank's step (``parallel/tensor_parallel.py``): the layers before the first dense
    one on its own rows; there its rows gathered, a padded copy and every rank's part kept
    beside their concatenation until the gather returns; from there on, the dense layers as
    the tensor plan's on all W ranks' rows (per example, W times the sizes), the loss on the
    gathered rows. Backward, its rows' gradient is a slice of the whole one, which lives
    until the layer before the gather has used it."""
    gather = gather_layer(network)
    pairs_edit = tensor_rank_graph(network, workers)

    def edit(graph: StepGraph) -> StepGraph:
        graph = pairs_edit(graph)
        first = next(j for j, node in enumerate(graph.nodes) if node.op.layer >= gather)
        rows = graph.nodes[first - 1].op.out_elements  # a chain: the node before gives the rows

        def rewrite(j: int, node: Node) -> list[Node]:
            if j < first:
                return [node]
            node = _per_example_times(node, workers)
            if j > first:
                return [node]
            buffers = Op(gather, "gather_buffers", (1 + workers) * rows, False, False, input_gradient="same")
            gathered = Op(gather, "gather_rows", workers * rows, False, False, input_gradient="same")
            return [Node(buffers, ()), Node(gathered, ()), node]

        rewired = _rewired(graph, rewrite)
        # the scores of all W ranks' rows; the labels held are the rank's own (the gathered ones
        # live only while the loss is computed, under no_grad)
        return replace(rewired, losses=tuple(replace(head, classes=head.classes * workers)
                                             for head in rewired.losses))

    return edit


def _rewired(graph: StepGraph, rewrite) -> StepGraph:
    """``graph`` with each node j replaced by the nodes ``rewrite(j, node)`` returns, in a chain:
    the first reads node j's sources, each next one the one before, and the last stands for
    node j (its readers and its loss read it); every source renumbered."""
    nodes, moved = [], {}
    for j, node in enumerate(graph.nodes):
        sources = tuple(moved.get(k, k) for k in node.sources)
        for position, new in enumerate(rewrite(j, node)):
            nodes.append(replace(new, sources=sources if position == 0 else (len(nodes) - 1,)))
        moved[j] = len(nodes) - 1
    return replace(graph, nodes=tuple(nodes), losses=tuple(replace(head, node=moved[head.node])
                                                            for head in graph.losses))


def _per_example_times(node: Node, factor: int) -> Node:
    """``node`` on ``factor`` times the examples: its per-example sizes times ``factor``."""
    op = node.op
    op = replace(op, out_elements=op.out_elements * factor, extra_bytes=op.extra_bytes * factor,
                 aligned_bytes=tuple(b * factor for b in op.aligned_bytes),
                 backward_scratch_elements=op.backward_scratch_elements * factor,
                 backward_scratch_bytes=op.backward_scratch_bytes * factor)
    return replace(node, op=op, scratch_elements=node.scratch_elements * factor,
                   scratch_bytes=node.scratch_bytes * factor)
