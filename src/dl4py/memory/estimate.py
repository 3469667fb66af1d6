"""``estimate``: the device memory one training (or inference) step of a network needs.

The answer comes from the config alone; nothing is built or allocated. It counts what
PyTorch really keeps: parameters (and float32 master copies for ``half``/``bfloat16``),
gradients, the updater's state (SGD none, Nesterov and RMSProp one copy, Adam two),
the activations autograd saves for the backward pass, layer by layer, the batch, and the
temporaries of the backward pass and of the update, then takes the peak over the step.
On a GPU it adds the framework's fixed costs (the CUDA context, cuBLAS' workspace) and
rounds each tensor to the allocator's 512-byte blocks. docs/memory.md explains the model
and its limits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dl4py.backend.precision import resolve_precision
from dl4py.config.layers import OutputLayer
from dl4py.config.recurrent import RnnOutputLayer
from dl4py.memory.sequence_ops import steps
from dl4py.config.network import NetworkConfig
from dl4py.config.updaters import Updater
from dl4py.errors import ConfigError
from dl4py.memory.operations import Op, network_ops
from dl4py.memory.timeline import Timeline
from dl4py.memory.updater_memory import optimizer_implementation, update_temporaries

MiB = 2**20
# Outside PyTorch's allocator, so torch.cuda.memory_allocated never shows it: the CUDA
# context with cuDNN and cuBLAS loaded lazily (CUDA 12) is typically 300-600 MiB.
CUDA_CONTEXT_BYTES = 512 * MiB
# PyTorch's CUDA caching allocator rounds each request up to a multiple of 512 bytes, and
# memory_allocated counts whole blocks. For requests up to 1 MiB (the small pool, whose
# blocks are always split) that is exact, and it is the rule the estimate follows. A larger
# block counts more when it is not split: only a remainder over 1 MiB is split off (a fresh
# segment of 10 MiB or more is a multiple of 2 MiB; a cached block is reused best-fit), so
# up to 1 MiB more; under max_split_size_mb an oversize block is never split and may serve
# a request up to max_non_split_rounding_mb (20 MiB by default) smaller; and
# roundup_power2_divisions, when set, rounds coarser. Which applies depends on what is
# cached, so the margin covers it (docs/memory.md).
_ALLOCATOR_GRANULE = 512
# CUDA kernels index some tensors with 32-bit ints (max_pool2d: safe_downcast<int>(numel))
# and raise a RuntimeError, not an out-of-memory error, at 2**31 elements. Batch sizes are
# capped below it on every device, so a CPU answer holds on a GPU.
MAX_TENSOR_ELEMENTS = 2**31 - 1


@dataclass(frozen=True)
class LayerMemory:
    index: int
    type_name: str
    output_shape: str
    parameters: int
    parameter_bytes: int
    activation_bytes: int  # saved for the backward pass (training) at this batch size


@dataclass(frozen=True)
class MemoryReport:
    """Bytes of one step. ``peak_bytes`` is the most alive at once, split by kind in
    ``at_peak``; ``total_bytes`` adds the fixed costs and is what the device must have."""

    batch_size: int
    precision: str
    updater: str
    training: bool
    device_type: str
    optimizer: str  # the update's implementation: loop, foreach or fused
    parameters: int
    parameter_bytes: int  # the module's parameters and buffers, plus float32 masters
    gradient_bytes: int
    updater_bytes: int
    activation_bytes: int  # saved for backward at the end of the forward pass
    input_bytes: int  # the batch: features and labels
    peak_bytes: int
    peak_phase: str
    at_peak: dict
    max_batch_by_elements: int  # the largest batch at which every tensor has < 2**31 elements
    fixed: dict = field(default_factory=dict)  # framework costs, by name
    layers: tuple = ()

    @property
    def workspace_bytes(self) -> int:
        """Temporaries alive at the peak: gradients in flight, the update's scratch tensors."""
        return self.at_peak.get("workspace", 0)

    @property
    def fixed_bytes(self) -> int:
        return sum(self.fixed.values())

    @property
    def total_bytes(self) -> int:
        return self.peak_bytes + self.fixed_bytes

    def needed_bytes(self, context: bool | int = True) -> int:
        """What the step needs of a budget. ``context`` is how much of the CUDA context is
        still to come out of it: True all of it (a card's total memory), False none, or a
        number of bytes (free memory read from a device whose context is partly paid)."""
        full = self.fixed.get("cuda_context", 0)
        if isinstance(context, bool):
            due = full if context else 0
        else:
            due = min(max(int(context), 0), full)
        return self.total_bytes - full + due

    def to_dict(self) -> dict:
        data = {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "layers"}
        data.update(workspace_bytes=self.workspace_bytes, fixed_bytes=self.fixed_bytes,
                    total_bytes=self.total_bytes)
        data["layers"] = [dict(vars(row)) for row in self.layers]
        return data


def estimate(
    config,
    batch_size: int,
    precision: str | None = None,
    updater: Updater | None = None,
    training: bool = True,
    device: str | torch.device = "cuda",
    optimizer: str = "auto",
    data_bytes: int = 0,
) -> MemoryReport:
    """Memory of one step of ``config`` (a NetworkConfig or RunConfig) at ``batch_size``.

    ``precision`` defaults to the run config's, else float; ``updater`` replaces the
    config's; ``device`` ("cuda" or "cpu") decides the fixed costs and how PyTorch
    implements the update (``optimizer``: auto, loop, foreach, fused); ``data_bytes``
    is a data set kept on the device. Example::

        report = estimate(lenet, batch_size=128, precision="bfloat16")
        print(report.total_bytes / 2**20, "MiB")
    """
    network, run_precision = _network(config)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ConfigError("batch_size", f"must be a positive whole number, got {batch_size!r}")
    policy = resolve_precision(precision or run_precision or "float")
    device_type = torch.device(device).type
    updater = updater or network.updater
    implementation = optimizer_implementation(optimizer, updater, device_type, policy.uses_loss_scaling)
    ops = network_ops(network)
    timeline = Timeline(_ALLOCATOR_GRANULE if device_type == "cuda" else 1)
    sizes = _Sizes(policy, network)
    n = batch_size

    params = sum(op.param_elements for op in ops)
    # A FrozenLayer's parameters take no gradient and no updater state (its masters remain:
    # MasterWeights copies the whole module).
    trained = sum(op.param_elements for op in ops if not op.frozen)
    master = 4 * params if policy.master_weights and training else 0
    module_bytes = params * sizes.param + _buffer_bytes(ops, sizes.param)
    state_bytes = updater.state_copies * trained * sizes.state if training else 0
    timeline.alloc("parameters", module_bytes + master, "start")
    timeline.alloc("updater_state", state_bytes, "start")
    timeline.alloc("input", data_bytes, "start")
    input_bytes = timeline.alloc("input", n * sizes.example_bytes + n * sizes.label_bytes, "start")

    if training:
        saved = _forward(ops, n, sizes, timeline)
        activation_bytes = sum(saved.values())
        _backward(ops, n, sizes, timeline)
        _update(ops, updater, implementation, policy, sizes, timeline)
        gradient_bytes = trained * sizes.state
    else:
        activation_bytes, gradient_bytes = 0, 0
        _inference(ops, n, sizes, timeline)
        saved = {}

    fixed = {}
    if device_type == "cuda":
        fixed = {"cuda_context": CUDA_CONTEXT_BYTES, "cublas_workspace": _cublas_workspace()}
    return MemoryReport(
        batch_size=n, precision=policy.name, updater=type(updater).__name__, training=training,
        device_type=device_type, optimizer=implementation if training else "none",
        parameters=params, parameter_bytes=module_bytes + master, gradient_bytes=gradient_bytes,
        updater_bytes=state_bytes, activation_bytes=activation_bytes, input_bytes=input_bytes,
        peak_bytes=timeline.peak, peak_phase=timeline.peak_phase, at_peak=timeline.peak_live,
        max_batch_by_elements=MAX_TENSOR_ELEMENTS // _largest_tensor_per_example(ops, sizes),
        fixed=fixed, layers=_layer_rows(network, ops, saved, sizes),
    )


class _Sizes:
    """Bytes per element of each kind of tensor under a precision policy."""

    def __init__(self, policy, network: NetworkConfig):
        self.param = _itemsize(policy.param_dtype)
        low = policy.autocast_dtype
        self.activation = _itemsize(low) if low is not None else self.param
        self.autocast = low is not None
        self.state = 4 if policy.master_weights else self.param  # the updater steps these
        self.master = policy.master_weights
        shape = network.input_type.example_shape()
        time = steps(network) if None in shape else 1  # a variable-length sequence: at its given length
        examples = math.prod(d or time for d in shape)
        self.example_bytes = examples * self.param  # convert_input casts to the parameter dtype
        output: OutputLayer = network.layers[-1]
        per_step = steps(network) if isinstance(output, RnnOutputLayer) else 1  # a label per step
        self.classes = output.n_out * per_step
        self.label_bytes = (8 if output.loss in ("negativeloglikelihood", "mcxent") else 4 * output.n_out) * per_step
        self.input_elements = examples


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _network(config) -> tuple[NetworkConfig, str | None]:
    if isinstance(config, NetworkConfig):
        return config, None
    network = getattr(config, "network", None)
    if isinstance(network, NetworkConfig):
        return network, config.training.precision
    raise TypeError(f"estimate needs a NetworkConfig or RunConfig, got {type(config).__name__}")


def _largest_tensor_per_example(ops: list[Op], sizes: _Sizes) -> int:
    """Elements per example of the step's largest batch-sized tensor: the batch, an operator's
    result (its gradient, pooling indices and dropout mask have as many) or the scores."""
    return max([sizes.input_elements, sizes.classes] + [op.out_elements for op in ops])


def _buffer_bytes(ops: list[Op], itemsize: int) -> int:
    # Batch norm's running mean and variance, and its int64 count of batches.
    return sum(op.param_elements * itemsize + 8 for op in ops if op.name == "batch_norm")


def _first_recorded(ops: list[Op]) -> int:
    """Index of the first op autograd records: the first with parameters that train. Below
    it (frozen layers at the bottom) nothing needs a gradient, so nothing is saved for
    backward and backward never reaches there."""
    return next((j for j, op in enumerate(ops) if op.params and not op.frozen), len(ops))


def _forward(ops: list[Op], n: int, sizes: _Sizes, t: Timeline) -> dict[int, int]:
    """Run the forward pass; return the bytes each layer leaves saved for backward."""
    saved: dict[int, int] = {}
    act = sizes.activation
    recorded = _first_recorded(ops)
    for j, op in enumerate(ops):
        phase = f"forward, layer {op.layer} ({op.name})"
        if j < recorded:  # as in inference: a result lives until the next op has used it
            t.alloc("activations", n * op.out_elements * act, phase)
            # Max pooling on a CPU computes its indices with or without a gradient to come.
            extra = t.alloc("activations", n * op.extra_bytes + op.extra_fixed_bytes, phase)
            t.free("activations", extra)
            if j > 0:
                t.free("activations", n * ops[j - 1].out_elements * act)
            continue
        if sizes.autocast and op.autocast:  # 16-bit copies of its parameters, and of a float input
            for elements, _ in _autocast_copies(ops, j):
                t.alloc("activations", elements * act, phase)
            if j == 0:
                t.alloc("activations", n * sizes.input_elements * act, phase)
        out = t.alloc("activations", n * op.out_elements * act, phase)
        t.alloc("activations", n * op.extra_bytes + op.extra_fixed_bytes, phase)
        saved[op.layer] = saved.get(op.layer, 0) + out * _kept(ops, j) + t.size(n * op.extra_bytes + op.extra_fixed_bytes)
        if j > 0 and not _kept(ops, j - 1):  # its input is no longer needed by anyone
            t.free("activations", n * ops[j - 1].out_elements * act)
    if sizes.autocast:  # leaving autocast frees the parameter copies autograd did not save
        for j in range(recorded, len(ops)):
            for elements, kept in _autocast_copies(ops, j):
                if not kept:
                    t.free("activations", elements * act)
    # The loss: scores (kept by the step), a float32 copy of 16-bit scores, log-softmax.
    loss = n * sizes.classes * (act + (4 if act < 4 else 0) + 4)
    t.alloc("activations", loss, "forward, loss")
    saved[ops[-1].layer] = saved.get(ops[-1].layer, 0) + loss
    return saved


def _kept(ops: list[Op], j: int) -> bool:
    """Whether op j's result is saved for backward (by itself, or by the next op)."""
    if j == len(ops) - 1:
        return True  # the scores: the training step holds them
    return ops[j].saves_result or ops[j + 1].saves_input


def _autocast_copies(ops: list[Op], j: int) -> list[tuple[int, bool]]:
    """Op j's 16-bit parameter copies under autocast: (elements, saved for backward) each.

    Autocast caches the copies until the forward pass ends; then only those autograd saved
    live on. A convolution saves its weight (one derivative formula for all its inputs); a
    matrix product saves its weight only when its input needs a gradient, that is when an
    earlier op has parameters (the first dense layer's does not: its input is the batch).
    No op saves its bias."""
    op = ops[j]
    if not op.autocast:
        return []
    weight_saved = op.name == "conv2d" or any(earlier.params and not earlier.frozen for earlier in ops[:j])
    return [(elements, i == 0 and weight_saved) for i, (elements, _) in enumerate(op.params)]


def _backward(ops: list[Op], n: int, sizes: _Sizes, t: Timeline) -> None:
    act = sizes.activation
    # Gradients of the loss's float32 tensors, then of the scores.
    t.alloc("workspace", 2 * n * sizes.classes * 4, "backward, loss")
    grad_out = t.alloc("workspace", n * sizes.classes * act, "backward, loss")
    t.free("workspace", 2 * n * sizes.classes * 4)
    t.free("activations", n * sizes.classes * (act + (4 if act < 4 else 0) + 4) - n * ops[-1].out_elements * act)
    recorded = _first_recorded(ops)
    for j in range(len(ops) - 1, recorded - 1, -1):
        op = ops[j]
        phase = f"backward, layer {op.layer} ({op.name})"
        # Neither the batch nor the output of frozen layers below needs a gradient.
        grad_in = n * ops[j - 1].out_elements * act if j > recorded else 0
        t.alloc("workspace", grad_in, phase)
        cast = sizes.autocast and op.autocast and op.params and not op.frozen
        # The parameters' gradients: under autocast, first in 16 bits (for the cast copy).
        if cast:
            for elements, _ in op.params:
                t.alloc("workspace", elements * act, phase)
        elif not op.frozen:
            t.alloc("gradients", op.param_elements * sizes.param, phase)
        # The node is done: it frees what it saved, and the gradient it consumed.
        t.free("workspace", grad_out)
        t.free("activations", n * op.extra_bytes + op.extra_fixed_bytes)
        if op.saves_result:
            t.free("activations", n * op.out_elements * act)
        if j > 0 and op.saves_input and not ops[j - 1].saves_result:
            t.free("activations", n * ops[j - 1].out_elements * act)
        if sizes.autocast and op.autocast:
            for elements, kept in _autocast_copies(ops, j):  # its 16-bit parameter copies
                if kept:
                    t.free("activations", elements * act)
            if j == 0:
                t.free("activations", n * sizes.input_elements * act)  # and of the float input
        if cast:  # the cast's backward: each parameter's float32 gradient, one after the other
            for elements, _ in op.params:
                t.alloc("gradients", elements * sizes.param, phase)
                t.free("workspace", elements * act)
        grad_out = t.size(grad_in)
    t.free("workspace", grad_out)


def _update(ops: list[Op], updater: Updater, implementation: str, policy, sizes: _Sizes, t: Timeline) -> None:
    tensors = [p for op in ops if not op.frozen for p in op.params]
    if sizes.master:  # 16-bit gradients become float32 gradients of the masters, one by one
        for elements, _ in tensors:
            t.alloc("gradients", elements * 4, "update, gradients to float32 masters")
            t.free("gradients", elements * sizes.param)
    scratch = update_temporaries(updater, implementation, tensors, sizes.state)
    t.alloc("workspace", scratch, f"update ({type(updater).__name__}, {implementation})")
    t.free("workspace", scratch)


def _inference(ops: list[Op], n: int, sizes: _Sizes, t: Timeline) -> None:
    """No autograd: a result lives until the next operator has used it, and a layer's input
    until the layer returns (its ``nn.Sequential`` still holds it)."""
    act = sizes.activation
    layer_input, previous = 0, None
    for j, op in enumerate(ops):
        out = n * op.out_elements * act
        t.alloc("activations", out, f"inference, layer {op.layer} ({op.name})")
        if previous is not None:
            t.free("activations", previous)
        last_of_layer = j == len(ops) - 1 or ops[j + 1].layer != op.layer
        if last_of_layer:
            t.free("activations", layer_input)
            layer_input, previous = out, None
        else:
            previous = out


def _layer_rows(network: NetworkConfig, ops: list[Op], saved: dict[int, int], sizes: _Sizes) -> tuple:
    rows = []
    for shapes in network.layer_shapes():
        count = sum(op.param_elements for op in ops if op.layer == shapes.index)
        rows.append(LayerMemory(
            index=shapes.index, type_name=shapes.layer.type_name, output_shape=str(shapes.output),
            parameters=count, parameter_bytes=count * sizes.param + (4 * count if sizes.master else 0),
            activation_bytes=saved.get(shapes.index, 0),
        ))
    return tuple(rows)


def _cublas_workspace() -> int:
    # cuBLAS' workspace is 8.125 MiB by default (CUBLAS_WORKSPACE_CONFIG ":4096:2:16:8"),
    # 32 MiB (":4096:8") on Hopper and newer. How many are held in the allocator depends on
    # torch: cached per (handle, stream), one handle per thread, and autograd's backward
    # runs on a thread of its own, so two; or none (recent torch leaves
    # TORCH_CUBLAS_WORKSPACE_CACHE off by default: cuBLAS then allocates its own outside
    # PyTorch, and only cuBLASLt's 1 MiB is inside). One of the larger size is charged;
    # the margin covers a second.
    return 32 * MiB
