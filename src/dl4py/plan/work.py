"""``step_work``: what one training step of a network costs in work, layer by layer, from its
config alone: no device is involved and nothing is timed.

Per layer (or graph vertex), in computation order:

- FLOPs of the forward and the backward pass, as ``torch.utils.flop_counter.FlopCounterMode``
  counts them: matrix products, convolutions and attention's batched products, measured on
  the layer's real module (``nn.builder``/``nn.graph``) run on PyTorch's ``meta`` device, so
  that a network of any size costs neither memory nor time. The backward pass computes what
  autograd computes in a training step: the input's gradient where an earlier layer trains
  (never for the network's input), and the parameters' gradients unless the layer is frozen.
  Element-wise work (activations, pooling, normalization, losses, merges) counts no FLOPs
  there: it is bound by memory, and counted in bytes.
- Bytes read and written by its operators, forward and backward, in the compute dtype (the
  parameters in theirs), from the memory estimator's description of the same operators
  (``memory.step_graph``): inputs, results, saved tensors, gradients, parameters.
- Its parameters and their bytes (what data parallelism moves), its output's elements per step
  (what tensor parallelism moves) and the kernels it launches, forward and backward (roughly: for
  the per-operator overhead). The loss itself (a few element-wise kernels on the scores) is left out.

A sequence input without a fixed length is counted at the length its input type gives, as the
memory estimator does (``InputType.recurrent(size, length)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

from dl4py.backend.precision import resolve_precision
from dl4py.config.frozen import is_frozen, unfrozen
from dl4py.config.graph import GraphConfig
from dl4py.config.layers import Shape
from dl4py.errors import BackendError, ConfigError
from dl4py.memory.graph_ops import graph_step
from dl4py.memory.sequence_ops import elements, steps
from dl4py.memory.step_graph import StepGraph, chain_graph
from dl4py.memory.step_sizes import StepSizes, check_batch_size, kernels_for, network_of
from dl4py.nn.builder import build_module
from dl4py.nn.graph import build_graph_module

__all__ = ["KINDS", "LAYER_KINDS", "WRAPPERS", "LayerWork", "StepWork", "step_work"]

KINDS = ("matmul", "conv", "attention", "recurrent", "elementwise")

# Each layer type's kind: which device rate its FLOPs run at. A wrapper (frozen, last_time_step)
# is of its wrapped layer's kind. An embedding is a gather: element-wise.
LAYER_KINDS = {
    "dense": "matmul", "output": "matmul", "rnn_output": "matmul",
    "convolution": "conv", "convolution1d": "conv", "deconvolution2d": "conv",
    "depthwise_convolution2d": "conv", "separable_convolution2d": "conv",
    "self_attention": "attention",
    "lstm": "recurrent", "gru": "recurrent", "simple_rnn": "recurrent", "graves_lstm": "recurrent",
    "bidirectional": "recurrent", "graves_bidirectional_lstm": "recurrent",
    **dict.fromkeys(("activation", "batch_normalization", "cnn_loss", "cropping1d", "cropping2d", "dropout",
                     "embedding", "embedding_sequence", "global_pooling", "layer_normalization", "subsampling",
                     "subsampling1d", "upsampling2d", "zero_padding", "zero_padding1d"), "elementwise"),
}
WRAPPERS = ("frozen", "last_time_step")  # of their wrapped layer's kind


@dataclass(frozen=True)
class LayerWork:
    """One layer's (or graph vertex's) work in one training step, at the step's batch size."""

    index: int
    name: str  # as the memory estimator names it: "layer 3", "vertex 'add'"
    type_name: str  # as ``dl4py summary`` shows it: "dense", "dense (frozen)", "elementwise add"
    kind: str  # one of KINDS
    forward_flops: int
    backward_flops: int
    forward_bytes: int
    backward_bytes: int
    parameters: int
    parameter_bytes: int
    frozen: bool  # its parameters take no gradient (and are not averaged by data parallelism)
    output_elements: int  # its result, per step
    kernels: int  # forward and backward

    @property
    def flops(self) -> int:
        return self.forward_flops + self.backward_flops

    @property
    def bytes(self) -> int:
        return self.forward_bytes + self.backward_bytes


@dataclass(frozen=True)
class StepWork:
    """The work of one training step: a ``LayerWork`` per layer, and totals."""

    batch_size: int
    precision: str
    layers: tuple[LayerWork, ...]

    @property
    def forward_flops(self) -> int:
        return sum(layer.forward_flops for layer in self.layers)

    @property
    def backward_flops(self) -> int:
        return sum(layer.backward_flops for layer in self.layers)

    @property
    def flops(self) -> int:
        return self.forward_flops + self.backward_flops

    @property
    def bytes(self) -> int:
        return sum(layer.bytes for layer in self.layers)

    @property
    def parameters(self) -> int:
        return sum(layer.parameters for layer in self.layers)

    @property
    def gradient_bytes(self) -> int:
        """The trained parameters' gradients: what data parallelism averages each step."""
        return sum(layer.parameter_bytes for layer in self.layers if not layer.frozen)

    @property
    def kernels(self) -> int:
        return sum(layer.kernels for layer in self.layers)

    def flops_by_kind(self) -> dict[str, int]:
        """FLOPs per kind (every one of KINDS, zero where none)."""
        totals = dict.fromkeys(KINDS, 0)
        for layer in self.layers:
            totals[layer.kind] += layer.flops
        return totals


@dataclass(frozen=True)
class _Part:
    """A layer or a vertex as the step runs it: its module (None for a parameter-free vertex),
    the shape its module takes, its result's shape and the names of what it reads."""

    index: int
    type_name: str
    layer: object
    module: torch.nn.Module | None
    input: Shape
    output: Shape
    reads: tuple


def step_work(config, batch_size: int, precision: str | None = None, device: str = "cuda") -> StepWork:
    """The work of one training step of ``config`` (a NetworkConfig, GraphConfig or RunConfig)
    at ``batch_size``. ``precision`` (default: the run config's, else float) sets the bytes per
    element; ``device`` ("cuda" or "cpu") whose LSTM/GRU kernels the operators follow. Example::

        work = step_work(lenet, 128)
        print(work.flops / 1e9, "GFLOP;", work.flops_by_kind())
    """
    network, run_precision = network_of(config)
    check_batch_size(batch_size)
    try:
        policy = resolve_precision(precision or run_precision or "float")
    except BackendError as error:
        raise ConfigError("precision", str(error)) from None
    kernels = kernels_for(torch.device(device).type)
    is_graph = isinstance(network, GraphConfig)
    graph = graph_step(network, kernels) if is_graph else chain_graph(network, kernels)
    sizes = StepSizes(policy, graph, kernels)
    parts = layer_parts(network)
    needs_gradient = {"input": False}  # does this result take a gradient in the backward pass?
    needs_gradient.update({name: False for name in getattr(network, "inputs", ())})
    node_bytes, node_kernels = _node_work(graph, batch_size, sizes)
    layers = []
    for part in parts:
        reads_gradient = any(needs_gradient[name] for name in part.reads)
        forward, backward, trains = 0, 0, False
        if part.module is not None:
            trains = any(p.requires_grad for p in part.module.parameters())
            forward, backward = _measured_flops(part, batch_size, _steps_of(network, part.input), reads_gradient)
        needs_gradient[part.index] = reads_gradient or trains
        count = sum(p.numel() for p in part.module.parameters()) if part.module is not None else 0
        forward_bytes, backward_bytes = node_bytes.get(part.index, (0, 0))
        layers.append(LayerWork(
            index=part.index, name=graph.names[part.index], type_name=part.type_name,
            kind=_kind(part.layer) if part.layer is not None else "elementwise",
            forward_flops=forward, backward_flops=backward,
            forward_bytes=forward_bytes, backward_bytes=backward_bytes,
            parameters=count, parameter_bytes=count * sizes.param,
            frozen=part.layer is not None and is_frozen(part.layer),
            output_elements=batch_size * elements(part.output, network),
            kernels=node_kernels.get(part.index, 0),
        ))
    return StepWork(batch_size=batch_size, precision=policy.name, layers=tuple(layers))


def _steps_of(network, shape: Shape) -> int:
    """The length a sequence of unknown length is counted at (1 for data that is no sequence)."""
    return steps(network) if None in shape.dims else 1


def layer_parts(network) -> list[_Part]:
    """Each layer or vertex of ``network`` as the step runs it, its module on the ``meta``
    device (``plan.layer_times`` makes real ones of them to time)."""
    return _graph_parts(network) if isinstance(network, GraphConfig) else _chain_parts(network)


def _chain_parts(network) -> list[_Part]:
    with torch.device("meta"):  # shapes and parameters without memory
        module = build_module(network, torch.Generator())
    return [_Part(shapes.index, _type_name(shapes.layer), shapes.layer, layer_module, shapes.input, shapes.output,
                  (shapes.index - 1 if shapes.index else "input",))
            for shapes, layer_module in zip(network.layer_shapes(), module)]


def _graph_parts(network: GraphConfig) -> list[_Part]:
    with torch.device("meta"):
        module = build_graph_module(network, torch.Generator())
    index_of = {vertex.name: vertex.index for vertex in network.vertex_shapes()}
    parts = []
    for vertex in network.vertex_shapes():
        node = vertex.node
        reads = tuple(index_of.get(name, name) for name in node.inputs)  # a graph input reads as its name
        if node.layer is not None:
            parts.append(_Part(vertex.index, _type_name(node.layer), node.layer, module.vertices[vertex.name],
                               vertex.input, vertex.output, reads))
        else:
            kind = f"elementwise {node.vertex.op}" if node.kind == "elementwise" else node.kind
            parts.append(_Part(vertex.index, kind, None, None, vertex.input, vertex.output, reads))
    return parts


def _type_name(layer) -> str:
    return unfrozen(layer).type_name + (" (frozen)" if is_frozen(layer) else "")


def _kind(layer) -> str:
    inner = unfrozen(layer)
    if inner.type_name == "last_time_step":
        return _kind(inner.layer)
    return LAYER_KINDS.get(inner.type_name, "elementwise")


def _measured_flops(part: _Part, batch_size: int, time: int, input_needs_gradient: bool) -> tuple[int, int]:
    """Forward and backward FLOPs of the part's module on a meta batch of the shape it takes."""
    dims = tuple(time if d is None else d for d in part.input.dims)
    features = torch.empty((batch_size, *dims), device="meta", requires_grad=input_needs_gradient)
    with FlopCounterMode(display=False) as forward:
        result = part.module(features)
    if not result.requires_grad:  # a frozen layer that no trained layer feeds: no backward at all
        return forward.get_total_flops(), 0
    with FlopCounterMode(display=False) as backward:
        result.backward(torch.ones_like(result))
    return forward.get_total_flops(), backward.get_total_flops()


def _node_work(graph: StepGraph, batch_size: int, sizes: StepSizes) -> tuple[dict, dict]:
    """Bytes (forward, backward) and kernels of each layer's operators, by layer index.

    Forward, each operator that is not a view reads its inputs and parameters and writes its
    result (and what it saves besides: pooling indices, a dropout mask). Backward, each
    operator that takes a gradient reads it and what it saved, writes a new gradient for each
    input that takes one, reads its parameters for that, and writes their gradients unless frozen."""
    act, param, n = sizes.activation, sizes.param, batch_size
    takes_gradient: list[bool] = []
    work: dict[int, list[int]] = {}
    for node in graph.nodes:
        op = node.op
        trains = bool(op.params) and not op.frozen
        sources = [(s, graph.nodes[s].op.out_elements if s >= 0 else graph.input_elements[-1 - s])
                   for s in node.sources]
        source_gradient = [s >= 0 and takes_gradient[s] for s, _ in sources]
        takes_gradient.append(any(source_gradient) or trains)
        totals = work.setdefault(op.layer, [0, 0, 0])
        if node.view:
            continue
        saved_extra = int(op.saved_extra_bytes(n))
        totals[0] += act * n * (sum(e for _, e in sources) + op.out_elements) + param * op.param_elements + saved_extra
        totals[2] += 1
        if not takes_gradient[-1]:
            continue
        new_gradients = [e for k, (_, e) in enumerate(sources) if source_gradient[k] and node.gradient(k) == "new"]
        saved = sum(e for _, e in sources) * op.saves_input + op.out_elements * op.saves_result
        totals[1] += act * n * (op.out_elements + saved + sum(new_gradients)) + saved_extra
        totals[1] += param * (op.param_elements * bool(new_gradients) + op.param_elements * trains)
        totals[2] += bool(new_gradients) + len(op.params) * trains
    return ({layer: (int(f), int(b)) for layer, (f, b, _) in work.items()},
            {layer: k for layer, (_, _, k) in work.items()})
