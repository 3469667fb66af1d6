"""Replay a step's forward, backward and update over its ``StepGraph``, on a ``Timeline``.

A tensor is freed when the last thing holding it lets go, as in PyTorch: the module's
forward holds a result until the operators that read it are done, autograd holds what an
operator saved until that operator's backward has run, and the engine holds a gradient
until the node it is for has consumed it. ``_Tensor`` counts those holders.

The forward pass runs the nodes in order. A layer's (vertex's) inputs stay alive until the
layer returns (its ``nn.Sequential`` holds its argument), an intermediate result until the
next operator of the layer has run, a layer's result until the last layer reading it has
returned. Autograd's engine runs the backward in reverse order of creation (its ready
queue pops the node with the highest sequence number, and a node is ready once every node
reading its result has run), so the backward walks the nodes in reverse.

Where a result feeds several nodes (a fork: a residual connection's skip), its gradient
arrives in parts, and the first waits in the engine's input buffer until the others have
come. The engine adds each new part (``InputBuffer::accumulate``): in place when the buffer
holds the only reference to a dense tensor, otherwise ``old + new``, a new tensor. Under a
``TorchDispatchMode`` (``LiveTensorBytes``, the measurement) ATen treats every tensor as a
subclass, so it never adds in place; ``backward``'s ``in_place_accumulation`` picks which
is replayed (``estimate``'s ``as_measured``). A slice of a larger gradient (a merge's) is
never added to in place.
"""

from __future__ import annotations

from dl4py.memory.step_graph import StepGraph
from dl4py.memory.timeline import Timeline
from dl4py.memory.updater_memory import update_temporaries
from dl4py.nn.convolution import chunk_examples


class _Tensor:
    """A storage on the timeline, freed when its last holder releases it."""

    def __init__(self, t: Timeline, kind: str, nbytes: float, phase: str):
        self.t, self.kind, self.nbytes, self.holders = t, kind, nbytes, 1
        self.size = t.alloc(kind, nbytes, phase)

    def hold(self) -> "_Tensor":
        self.holders += 1
        return self

    def release(self) -> None:
        self.holders -= 1
        if self.holders == 0:
            self.t.free(self.kind, self.nbytes)


class _Step:
    """What the forward pass leaves for the backward pass to find."""

    def __init__(self, graph: StepGraph, n: int, sizes, t: Timeline):
        self.graph, self.n, self.sizes, self.t = graph, n, sizes, t
        self.nodes = graph.nodes
        self.act = sizes.activation
        # Whether a node's result needs a gradient: it has parameters that train, or reads
        # one that does. Autograd records (and saves for) only these.
        self.recorded: list[bool] = []
        for node in self.nodes:
            own = bool(node.op.params) and not node.op.frozen
            self.recorded.append(own or any(s >= 0 and self.recorded[s] for s in node.sources))
        self.results: dict[int, _Tensor] = {}
        self.saved: dict[int, list[_Tensor]] = {}  # node -> what autograd keeps for its backward
        self.input_copies: dict[int, list[float]] = {}  # node -> its 16-bit copies of float inputs

    def phase(self, stage: str, j: int) -> str:
        op = self.nodes[j].op
        return f"{stage}, {self.graph.names[op.layer]} ({op.name})"

    def input_bytes(self, source: int) -> float:
        return self.n * self.graph.input_elements[-1 - source] * self.act

    def result_bytes(self, j: int) -> float:
        return self.n * self.nodes[j].op.out_elements * self.act

    def releases(self) -> dict[int, list[int]]:
        """node -> the results the module lets go once that node has run."""
        nodes = self.nodes
        last_of_layer: dict[int, int] = {}
        for j, node in enumerate(nodes):
            last_of_layer[node.op.layer] = j
        heads = {head.node for head in self.graph.losses}  # the step holds the scores
        readers: dict[int, list[int]] = {}
        for k, node in enumerate(nodes):
            for s in dict.fromkeys(node.sources):
                readers.setdefault(s, []).append(k)
        after: dict[int, list[int]] = {}
        for j, node in enumerate(nodes):
            if j not in readers or j in heads:
                continue
            if last_of_layer[node.op.layer] != j:  # within a layer: until the next operator has run
                release = readers[j][0]
            else:  # until the last layer reading it has returned
                release = max(last_of_layer[nodes[k].op.layer] for k in readers[j])
            after.setdefault(release, []).append(j)
        return after

    def make_result(self, j: int, stage: str) -> _Tensor:
        node = self.nodes[j]
        if node.view and node.sources[0] < 0:  # a view of the batch, which the step holds anyway
            result = _Tensor(self.t, "input", 0, "start")
        elif node.view:
            result = self.results[node.sources[0]].hold()
        else:
            result = _Tensor(self.t, "activations", self.result_bytes(j), self.phase(stage, j))
        self.results[j] = result
        return result


def forward(graph: StepGraph, n: int, sizes, t: Timeline) -> tuple[_Step, dict[int, int]]:
    """Run the forward pass and the losses; return the step's state and the bytes each layer
    leaves saved for backward."""
    step = _Step(graph, n, sizes, t)
    releases = step.releases()
    saved_bytes: dict[int, int] = {}
    heads = {head.node for head in graph.losses}
    saved_by_a_reader = _saved_by_a_reader(step)
    for j, node in enumerate(step.nodes):
        if not step.recorded[j]:  # as in inference (max pooling computes its indices anyway)
            _upcast_result(step, j, "forward")
            extra = t.alloc("activations", node.op.saved_extra_bytes(n), step.phase("forward", j))
            t.free("activations", extra)
        else:
            kept = _forward_recorded(step, j, saved_by_a_reader[j] or j in heads)
            saved_bytes[node.op.layer] = saved_bytes.get(node.op.layer, 0) + kept
        for done in releases.get(j, ()):
            step.results[done].release()
    if sizes.autocast:  # leaving autocast frees the parameter copies autograd did not save
        for j in range(len(step.nodes)):
            if step.recorded[j] and not _upcasts(step, step.nodes[j].op):
                _free_unsaved_copies(step, j)
    for layer, loss in _forward_losses(step):
        saved_bytes[layer] = saved_bytes.get(layer, 0) + loss
    return step, saved_bytes


def _saved_by_a_reader(step: _Step) -> list[bool]:
    """node -> whether some recorded node saves its result (as its own input) for backward."""
    saved = [False] * len(step.nodes)
    for k, node in enumerate(step.nodes):
        if step.recorded[k] and node.op.saves_input:
            for s in node.sources:
                if s >= 0:
                    saved[s] = True
    return saved


def _forward_recorded(step: _Step, j: int, result_saved_elsewhere: bool) -> int:
    """Node j's forward under autograd, which keeps what its backward needs. Returns the bytes
    it leaves saved: its result's, if anything saves it, and its own extra."""
    node, t, act = step.nodes[j], step.t, step.act
    op, phase = node.op, step.phase("forward", j)
    autocast = step.sizes.autocast and op.autocast
    if autocast:  # 16-bit copies of its parameters, and of a float input
        for elements, _ in _autocast_copies(step, j):
            t.alloc("activations", elements * act, phase)
        copies = [step.input_bytes(s) for s in node.sources if s < 0]
        for nbytes in copies:
            t.alloc("activations", nbytes, phase)
        step.input_copies[j] = copies
    result = _upcast_result(step, j, "forward")
    if autocast and _upcasts(step, op):
        # autocast's cache never saw these copies: what autograd did not save goes now
        _free_unsaved_copies(step, j)
    extra = op.saved_extra_bytes(step.n)
    t.alloc("activations", extra, phase)
    keeps = []
    if op.saves_result:
        keeps.append(result.hold())
    if op.saves_input:
        keeps += [step.results[s].hold() for s in node.sources if s >= 0]
    step.saved[j] = keeps
    kept = op.saves_result or result_saved_elsewhere
    own = 0 if node.view else t.size(step.result_bytes(j))
    return own * kept + t.size(extra)


def _free_unsaved_copies(step: _Step, j: int) -> None:
    """Free node j's 16-bit parameter copies that autograd did not save."""
    for elements, kept in _autocast_copies(step, j):
        if not kept:
            step.t.free("activations", elements * step.act)


def _forward_losses(step: _Step) -> list[tuple[int, int]]:
    """The losses' forward; returns (layer, bytes kept for backward) of each output layer."""
    n, t, act = step.n, step.t, step.act
    kept = []
    for head in step.graph.losses:
        # The loss: a float32 copy of 16-bit scores, the log-softmax (kept for backward).
        loss = n * head.classes * _loss_bytes_per_score(act)
        t.alloc("activations", loss, "forward, loss")
        kept.append((step.nodes[head.node].op.layer, loss))
    for head in step.graph.losses:
        # ``loss_fn(module(x), y)``: nothing holds the scores once the loss is computed
        # (the log-softmax keeps its result), unless an operator saved them.
        step.results[head.node].release()
    return kept


def _upcasts(step: _Step, op) -> bool:
    """The operator is a convolution that this CPU computes in float32 (nn/convolution.py)."""
    return step.sizes.upcast and op.upcast_on_cpu


def _upcast_result(step: _Step, j: int, stage: str) -> _Tensor:
    """Node j's result. A convolution computed in float32 from 16-bit values (nn/convolution.py)
    makes float32 copies of its parameters, then, for each chunk of examples (``CHUNK_BYTES``),
    a float32 copy of the chunk's input (freed when the kernel returns) and the chunk's float32
    result, rounded into the 16-bit result (made at the first chunk) and then freed."""
    op, t, phase = step.nodes[j].op, step.t, step.phase(stage, j)
    if not _upcasts(step, op):
        return step.make_result(j, stage)
    chunk, more = _chunk(step, j)
    params = 4 * op.param_elements
    inputs, outputs = 4 * chunk * _input_elements(step, j), 4 * chunk * op.out_elements
    t.alloc("workspace", params, phase)
    t.alloc("workspace", inputs + outputs, phase)
    t.free("workspace", inputs)
    result = step.make_result(j, stage)
    t.free("workspace", outputs)
    if more:
        t.alloc("workspace", inputs + outputs, phase)
        t.free("workspace", inputs + outputs)
    t.free("workspace", params)
    return result


def _chunk(step: _Step, j: int) -> tuple[int, bool]:
    """Examples per chunk of node j's float32 convolution, and whether the batch has more than one."""
    examples = chunk_examples(round(_input_elements(step, j)), step.nodes[j].op.out_elements)
    return min(step.n, examples), step.n > examples


def _input_elements(step: _Step, j: int) -> float:
    """Elements of node j's inputs, per example."""
    sources = step.nodes[j].sources
    return sum(step.input_bytes(s) if s < 0 else step.result_bytes(s) for s in sources) / step.n / step.act


def _loss_bytes_per_score(act: int) -> int:
    return (4 if act < 4 else 0) + 4


def _autocast_copies(step: _Step, j: int) -> list[tuple[int, bool]]:
    """Node j's 16-bit parameter copies under autocast: (elements, saved for backward) each.

    Autocast caches the copies until the forward pass ends; then only those autograd saved
    live on. A convolution saves its weight (one derivative formula for all its inputs); a
    matrix product saves its weight only when its input needs a gradient (the first dense
    layer's does not: its input is the batch). No op saves its bias."""
    node = step.nodes[j]
    op = node.op
    if not op.autocast:
        return []
    weight_saved = op.name == "conv2d" or any(s >= 0 and step.recorded[s] for s in node.sources)
    return [(elements, i == 0 and weight_saved) for i, (elements, _) in enumerate(op.params)]


def backward(step: _Step, in_place_accumulation: bool = True) -> None:
    """Run the backward pass: the losses' gradients, then each recorded node in reverse."""
    # node -> the gradient waiting for it (the engine's InputBuffer), and whether it is whole (not a slice)
    buffers: dict[int, tuple[_Tensor, bool]] = {}
    for node, grad in _loss_gradients(step):
        _deliver(step, buffers, node, grad, True, in_place_accumulation)
    for j in range(len(step.nodes) - 1, -1, -1):
        if not step.recorded[j] or j not in buffers:
            continue
        grad_out, _ = buffers.pop(j)
        for s, grad, whole in _backward_node(step, j, grad_out):
            _deliver(step, buffers, s, grad, whole, in_place_accumulation)
    for grad, _ in buffers.values():  # gradients no recorded node consumes (none in a trained graph)
        grad.release()


def _loss_gradients(step: _Step):
    """The losses' backward, last loss first: yields (node, the gradient of its scores) as each is made."""
    n, t, act = step.n, step.t, step.act
    for head in reversed(step.graph.losses):
        # The gradient of the log-softmax (float32); of 16-bit scores' float32 copy; then of
        # the scores (the log-softmax's backward makes it, or the cast's).
        float_grads = n * head.classes * (4 + (4 if act < 4 else 0))
        t.alloc("workspace", float_grads, "backward, loss")
        grad = _Tensor(t, "workspace", n * head.classes * act, "backward, loss")
        t.free("workspace", float_grads)
        t.free("activations", n * head.classes * _loss_bytes_per_score(act))
        yield head.node, grad


def _backward_node(step: _Step, j: int, grad_out: _Tensor) -> list[tuple[int, _Tensor, bool]]:
    """Node j's backward, consuming ``grad_out``: its kernel's scratch, its parameters'
    gradients, and the gradients of its inputs, returned as (source, gradient, whole)."""
    n, sizes, t, act = step.n, step.sizes, step.t, step.act
    node = step.nodes[j]
    op, phase = node.op, step.phase("backward", j)
    if op.stepwise_backward:  # each step's saved values are gone before the gradients are whole
        t.free("activations", op.saved_extra_bytes(n))
    _upcast_input_gradient(step, j, phase)
    grads, unneeded = _input_gradients(step, j, grad_out, phase)
    scratch = t.alloc("workspace", unneeded + n * (node.scratch_elements * act + node.scratch_bytes
                                                   + op.backward_scratch_elements * act
                                                   + op.backward_scratch_bytes), phase)
    wide_grads = _upcast_parameter_gradients(step, j, phase)
    cast = sizes.autocast and op.autocast and op.params and not op.frozen
    # The parameters' gradients: under autocast, first in 16 bits (for the cast copy).
    if cast:
        for elements, _ in op.params:
            t.alloc("workspace", elements * act, phase)
    elif not op.frozen:
        t.alloc("gradients", op.param_elements * sizes.param, phase)
    t.free("workspace", scratch)  # its kernel returned them with the parameters' gradients
    t.free("workspace", wide_grads)  # and the float32 sums are rounded
    _node_done(step, j, grad_out)
    if cast:  # the cast's backward: each parameter's float32 gradient, one after the other
        for elements, _ in op.params:
            t.alloc("gradients", elements * sizes.param, phase)
            t.free("workspace", elements * act)
    return grads


def _input_gradients(step: _Step, j: int, grad_out: _Tensor, phase: str) -> tuple[list, float]:
    """The gradients of node j's inputs (neither the batch nor a result that needs none gets
    one): (source, gradient, whole) each, and the bytes of a fused kernel's input gradients
    that nothing needs, dropped at once."""
    node, op = step.nodes[j], step.nodes[j].op
    grads = []
    unneeded = 0.0
    for i, s in enumerate(node.sources):
        if s < 0 or not step.recorded[s]:
            if op.fused_backward:
                unneeded += step.input_bytes(s) if s < 0 else step.result_bytes(s)
            continue
        kind = node.gradient(i)
        if kind == "new":
            grads.append((s, _Tensor(step.t, "workspace", step.result_bytes(s), phase), True))
        else:
            grads.append((s, grad_out.hold(), kind == "same"))
    return grads, unneeded


def _node_done(step: _Step, j: int, grad_out: _Tensor) -> None:
    """Node j's backward is done: it frees the gradient it consumed, and what it saved."""
    t, op = step.t, step.nodes[j].op
    grad_out.release()
    if not op.stepwise_backward:
        t.free("activations", op.saved_extra_bytes(step.n))
    for tensor in step.saved.pop(j, ()):
        tensor.release()
    if step.sizes.autocast and op.autocast:
        for elements, kept in _autocast_copies(step, j):  # its 16-bit parameter copies
            if kept:
                t.free("activations", elements * step.act)
        for nbytes in step.input_copies.pop(j, ()):  # and of a float input
            t.free("activations", nbytes)


def _upcast_input_gradient(step: _Step, j: int, phase: str) -> float:
    """The backward of a convolution computed in float32 from 16-bit values, up to its input's
    gradient, where that needs one: a float32 copy of its weight, then for each chunk of
    examples float32 copies of the chunk's gradient (freed when the kernel returns) and of the
    chunk's input gradient, rounded into the 16-bit input gradient (made at the first chunk:
    it is the gradient the node gives, allocated next, so here only for the moment)."""
    node, t = step.nodes[j], step.t
    op = node.op
    needed = sum(step.result_bytes(s) for s in node.sources if s >= 0 and step.recorded[s])
    if not _upcasts(step, op) or not needed:
        return 0.0
    chunk, more = _chunk(step, j)
    weight = 4 * op.params[0][0]
    grad, wide = 4 * chunk * op.out_elements, 4 * chunk * needed / step.n / step.act
    t.alloc("workspace", weight, phase)
    t.alloc("workspace", grad + wide, phase)
    t.free("workspace", grad)
    t.alloc("workspace", needed, phase)
    t.free("workspace", wide)
    if more:
        t.alloc("workspace", grad + wide, phase)
        t.free("workspace", grad + wide)
    t.free("workspace", weight + needed)
    return 0.0


def _upcast_parameter_gradients(step: _Step, j: int, phase: str) -> float:
    """Then, unless it is frozen, its parameters' gradients: for each chunk float32 copies of
    the chunk's gradient and input (freed when the kernel returns) and the chunk's parameter
    gradients in float32, summed into the first chunk's. Returns the sum's bytes, freed once
    rounded (the rounding is the parameters' gradients, made next)."""
    op, t = step.nodes[j].op, step.t
    if not _upcasts(step, op) or op.frozen:
        return 0.0
    chunk, more = _chunk(step, j)
    copies = 4 * chunk * (op.out_elements + _input_elements(step, j))
    params = 4 * op.param_elements
    t.alloc("workspace", copies + params, phase)
    t.free("workspace", copies)
    if more:
        t.alloc("workspace", copies + params, phase)
        t.free("workspace", copies + params)
    return params


def _deliver(step: _Step, buffers: dict, node: int, grad: _Tensor, whole: bool, in_place: bool) -> None:
    """Hand ``grad`` to ``node``'s input buffer, adding it to what is already there.
    ``whole``: the gradient is a tensor of its own, not a slice of a larger one."""
    if node not in buffers:
        buffers[node] = (grad, whole)
        return
    waiting, waiting_whole = buffers[node]
    if in_place and waiting_whole and waiting.holders == 1:  # old.add_(new): the buffer's tensor is its alone
        grad.release()
        return
    total = _Tensor(step.t, "workspace", step.result_bytes(node), step.phase("backward, accumulate", node))
    buffers[node] = (total, True)
    waiting.release()
    grad.release()


def update(ops, updater, implementation: str, sizes, t: Timeline) -> None:
    tensors = [p for op in ops if not op.frozen for p in op.params]
    if sizes.master:  # 16-bit gradients become float32 gradients of the masters, one by one
        for elements, _ in tensors:
            t.alloc("gradients", elements * 4, "update, gradients to float32 masters")
            t.free("gradients", elements * sizes.param)
    scratch = update_temporaries(updater, implementation, tensors, sizes.state)
    t.alloc("workspace", scratch, f"update ({type(updater).__name__}, {implementation})")
    t.free("workspace", scratch)


def inference(graph: StepGraph, n: int, sizes, t: Timeline) -> None:
    """No autograd: a result lives until the layers reading it have returned."""
    step = _Step(graph, n, sizes, t)
    releases = step.releases()
    for j in range(len(step.nodes)):
        _upcast_result(step, j, "inference")
        for done in releases.get(j, ()):
            step.results[done].release()
