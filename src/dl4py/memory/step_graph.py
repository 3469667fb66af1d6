"""A training step's operators as a graph: who feeds whom, what the inputs and losses are.

A chain network is the simplest case: each operator reads the one before it. A
computation graph (``dl4py.memory.graph_ops``) forks (a result read by several vertices)
and joins (merge and element-wise vertices read several). ``replay`` walks either the same
way, so one set of rules covers both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dl4py.config.layers import OutputLayer
from dl4py.config.layers_conv import CnnLossLayer
from dl4py.config.recurrent import RnnOutputLayer
from dl4py.memory.operations import Op, network_ops
from dl4py.memory.sequence_ops import steps


def graph_input(k: int) -> int:
    """The source index that stands for the step's k-th input (a batch of features)."""
    return -1 - k


@dataclass(frozen=True)
class Node:
    """One operator in the step. ``sources`` are indices of earlier nodes, or
    ``graph_input(k)``; ``layer`` of its ``op`` numbers the layer or vertex it belongs to."""

    op: Op
    sources: tuple[int, ...]
    view: bool = False  # its result is a view of its one source: no bytes of its own
    # What its backward gives each source: "new", a tensor of the source's size (the rule
    # for every layer); "same", the gradient this node received, or a reshaped view of it
    # (an addition's, a reshape's): no bytes; "slice", a slice of it (a concatenation's): no
    # bytes, but a slice is never added to in place.
    gradients: tuple[str, ...] = ()
    # Temporaries its backward makes beside the gradients, per example: elements in the
    # activations' dtype, and bytes (boolean masks).
    scratch_elements: int = 0
    scratch_bytes: float = 0.0

    def gradient(self, i: int) -> str:
        return self.gradients[i] if self.gradients else self.op.input_gradient


@dataclass(frozen=True)
class LossHead:
    """An output of the step and its loss."""

    node: int  # the node whose result is the scores
    classes: int  # score elements per example (per step, times the steps, for a per-step output)
    label_bytes: int  # per example


@dataclass(frozen=True)
class StepGraph:
    nodes: tuple[Node, ...]
    input_elements: tuple[int, ...]  # per example, of each input's features
    losses: tuple[LossHead, ...]
    names: tuple[str, ...]  # what a phase calls each layer or vertex: "layer 3", "vertex 'add'"

    @property
    def ops(self) -> list[Op]:
        return [node.op for node in self.nodes]


def reads_as_view(op: Op, source: Op | None) -> bool:
    """An LSTM/GRU's time-major copy of a result that is time-major already is a view."""
    return op.name == "time_major_copy" and source is not None and source.time_major


def chain_graph(network, device: str = "cuda") -> StepGraph:
    """The step of a chain network (a NetworkConfig): each operator reads the previous one."""
    ops = network_ops(network, device)
    nodes = tuple(Node(op, (j - 1 if j else graph_input(0),), view=reads_as_view(op, ops[j - 1] if j else None))
                  for j, op in enumerate(ops))
    shape = network.input_type.example_shape()
    time = steps(network) if None in shape else 1  # a variable-length sequence: at its given length
    output = network.layers[-1]
    return StepGraph(
        nodes=nodes,
        input_elements=(math.prod(d or time for d in shape),),
        losses=(loss_head(output, len(nodes) - 1, network, network.layer_shapes()[-1].output),),
        names=tuple(f"layer {i}" for i in range(len(network.layers))),
    )


def loss_head(output: OutputLayer, node: int, config, output_shape=None) -> LossHead:
    """The scores and labels of an output layer: an index label per example (or step) for
    the classification losses, a float32 target per score for the others (and for a CNN loss
    layer, whose labels are [c, h, w] like its scores). A per-step output
    has as many steps as its ``output_shape`` (a 1-D convolution or pooling may have
    shortened the sequence), the input's length where that is variable."""
    if isinstance(output, CnnLossLayer):  # a score and a float32 target per value of [c, h, w]
        return LossHead(node, output_shape.size, 4 * output_shape.size)
    per_step = 1
    if isinstance(output, RnnOutputLayer):
        time = output_shape.dims[0] if output_shape is not None else None
        per_step = time if time is not None else steps(config)
    index_label = output.loss in ("negativeloglikelihood", "mcxent")
    return LossHead(node, output.n_out * per_step, (8 if index_label else 4 * output.n_out) * per_step)
