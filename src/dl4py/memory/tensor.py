"""Per-rank memory of tensor-parallel training (``training.parallelism: tensor``: dl4py's
Megatron MLP, ``parallel/tensor_parallel.py``).

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

Checked against ``LiveTensorBytes`` on 2 gloo ranks (``tests/test_memory_tensor.py``): the
MLP 784-4000-4000-10 and LeNet's convolutions with a 2048-2048 dense head, to 4 bytes where
the update sets the peak and within ``TOLERANCE`` where the backward does (the MLP at batch
2048: 0.3% under; the convolutional one at 1024: 0.05% over).
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


def rank_network(network, workers: int):
    """The network as one of ``workers`` tensor-parallel ranks holds it: the first layer of each
    dense pair narrowed to rank 0's columns. A ConfigError where there is no pair to split."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 2:
        raise ConfigError("workers", f"tensor parallelism needs 2 or more workers, got {workers!r}")
    if isinstance(network, GraphConfig):
        raise ConfigError("parallelism", "tensor splits the dense layers of a MultiLayerNetwork; this is a graph")
    pairs = dense_pairs(network)
    if not pairs:
        raise ConfigError("parallelism", f"tensor: {NO_PAIRS}")
    layers = list(network.layers)
    for first, _ in pairs:
        layers[first] = replace(layers[first], n_out=-(-layers[first].n_out // workers))
    return replace(network, layers=layers)


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
        nodes, moved = [], {}
        for j, node in enumerate(graph.nodes):
            sources = tuple(moved.get(k, k) for k in node.sources)
            if node.op.layer in seconds and node.op.name == "linear":
                widths = node.op.out_elements + graph.nodes[node.sources[0]].op.out_elements
                nodes.append(replace(node, sources=sources, scratch_elements=node.scratch_elements + widths))
                reduced = Op(node.op.layer, "all_reduce", node.op.out_elements, False, False,
                             backward_scratch_elements=2 * node.op.out_elements)
                nodes.append(Node(reduced, (len(nodes) - 1,)))
            else:
                nodes.append(replace(node, sources=sources))
            moved[j] = len(nodes) - 1
        losses = tuple(replace(head, node=moved[head.node]) for head in graph.losses)
        return replace(graph, nodes=tuple(nodes), losses=losses)

    return edit
