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

from dataclasses import dataclass, field

import torch

from dl4py.backend.device_memory import CUDA_CONTEXT_BYTES
from dl4py.backend.precision import resolve_precision
from dl4py.config.graph import GraphConfig
from dl4py.config.network import NetworkConfig
from dl4py.config.updaters import Updater
from dl4py.errors import ConfigError
from dl4py.memory import replay
from dl4py.memory.graph_ops import graph_step
from dl4py.memory.operations import Op
from dl4py.memory.step_graph import StepGraph, chain_graph
from dl4py.memory.timeline import Timeline
from dl4py.memory.updater_memory import optimizer_implementation
from dl4py.nn.convolution import upcasts_on_cpu

MiB = 2**20
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
    parallelism: str = "single"  # or "sharded": then the bytes are one rank's of ``workers``
    workers: int = 1
    gathered_unit_bytes: int = 0  # sharded: the largest unit as gathered (all-gather output's size)

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
    as_measured: bool = False,
    parallelism: str = "single",
    workers: int = 1,
) -> MemoryReport:
    """Memory of one step of ``config`` (a NetworkConfig, GraphConfig or RunConfig) at ``batch_size``.

    ``precision`` defaults to the run config's, else float; ``updater`` replaces the
    config's; ``device`` ("cuda" or "cpu") decides the fixed costs and how PyTorch
    implements the update (``optimizer``: auto, loop, foreach, fused), and "cpu" means
    this machine's CPU (whether it runs 16-bit convolutions in float32); ``data_bytes``
    is a data set kept on the device. ``as_measured`` replays the step as ``LiveTensorBytes``
    sees it: under a TorchDispatchMode autograd adds the parts of a gradient that forks out
    of place (a graph whose result feeds several vertices), where a plain step adds in
    place (``replay``). Example::

        report = estimate(lenet, batch_size=128, precision="bfloat16")
        print(report.total_bytes / 2**20, "MiB")

    ``parallelism="sharded"`` with ``workers=N`` gives one rank's step when N ranks train
    sharded (FSDP2), each on a batch of ``batch_size`` (``memory.sharded``).
    """
    if parallelism == "sharded":
        if not training:
            raise ConfigError("parallelism", "sharded is a way to train; estimate inference with single")
        from dl4py.memory.sharded import estimate_sharded  # cycle: dl4py.memory.sharded imports this module

        return estimate_sharded(config, batch_size, workers, precision, updater, device, optimizer,
                                data_bytes, as_measured)
    if parallelism != "single":
        raise ConfigError("parallelism", f"must be single or sharded, got {parallelism!r}")
    network, run_precision = _network(config)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ConfigError("batch_size", f"must be a positive whole number, got {batch_size!r}")
    policy = resolve_precision(precision or run_precision or "float")
    device_type = torch.device(device).type
    updater = updater or network.updater
    implementation = optimizer_implementation(optimizer, updater, device_type, policy.uses_loss_scaling)
    kernels = "cpu" if device_type == "cpu" else "cuda"  # whose LSTM/GRU kernels: oneDNN's and ATen's, or cuDNN's
    graph = graph_step(network, kernels) if isinstance(network, GraphConfig) else chain_graph(network, kernels)
    ops = graph.ops
    timeline = Timeline(_ALLOCATOR_GRANULE if device_type == "cuda" else 1)
    sizes = _Sizes(policy, graph, device_type)
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
        step, saved = replay.forward(graph, n, sizes, timeline)
        activation_bytes = sum(saved.values())
        replay.backward(step, in_place_accumulation=not as_measured)
        replay.update(ops, updater, implementation, sizes, timeline)
        gradient_bytes = trained * sizes.state
    else:
        activation_bytes, gradient_bytes = 0, 0
        replay.inference(graph, n, sizes, timeline)
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
    """Bytes per element of each kind of tensor under a precision policy, and of the batch."""

    def __init__(self, policy, graph: StepGraph, device_type: str = "cuda"):
        self.param = _itemsize(policy.param_dtype)
        low = policy.autocast_dtype
        self.activation = _itemsize(low) if low is not None else self.param
        self.autocast = low is not None
        # On this CPU, 16-bit convolutions run in float32, with float32 copies around them
        # (nn/convolution.py), where it has no native kernels for the compute dtype.
        compute = policy.param_dtype if low is None else low
        self.upcast = device_type == "cpu" and upcasts_on_cpu(compute)
        self.state = 4 if policy.master_weights else self.param  # the updater steps these
        self.master = policy.master_weights
        self.input_elements = sum(graph.input_elements)
        self.example_bytes = self.input_elements * self.param  # convert_input casts to the parameter dtype
        self.classes = max(head.classes for head in graph.losses)
        self.label_bytes = sum(head.label_bytes for head in graph.losses)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _network(config) -> tuple[NetworkConfig | GraphConfig, str | None]:
    if isinstance(config, (NetworkConfig, GraphConfig)):
        return config, None
    network = getattr(config, "network", None)
    if isinstance(network, (NetworkConfig, GraphConfig)):
        return network, config.training.precision
    raise TypeError(f"estimate needs a NetworkConfig or RunConfig (or a GraphConfig), got {type(config).__name__}")


def _largest_tensor_per_example(ops: list[Op], sizes: _Sizes) -> int:
    """Elements per example of the step's largest batch-sized tensor: the batch, an operator's
    result (its gradient, pooling indices and dropout mask have as many) or the scores."""
    return max([sizes.input_elements, sizes.classes] + [op.out_elements for op in ops])


def _buffer_bytes(ops: list[Op], itemsize: int) -> int:
    # Batch norm's running mean and variance, and its int64 count of batches.
    return sum(op.param_elements * itemsize + 8 for op in ops if op.name == "batch_norm")


def _layer_rows(network, ops: list[Op], saved: dict[int, int], sizes: _Sizes) -> tuple:
    rows = []
    for index, type_name, output in _parts(network):
        count = sum(op.param_elements for op in ops if op.layer == index)
        rows.append(LayerMemory(
            index=index, type_name=type_name, output_shape=str(output),
            parameters=count, parameter_bytes=count * sizes.param + (4 * count if sizes.master else 0),
            activation_bytes=saved.get(index, 0),
        ))
    return tuple(rows)


def _parts(network) -> list[tuple[int, str, object]]:
    """(index, what it is, output shape) of each layer, or of each vertex of a graph."""
    if isinstance(network, NetworkConfig):
        return [(shapes.index, shapes.layer.type_name, shapes.output) for shapes in network.layer_shapes()]
    parts = []
    for vertex in network.vertex_shapes():
        node = vertex.node
        kind = node.layer.type_name if node.layer is not None else node.vertex.type_name
        if node.vertex is not None and kind == "elementwise":
            kind = f"elementwise {node.vertex.op}"
        parts.append((vertex.index, f"{vertex.name}: {kind}", vertex.output))
    return parts


def _cublas_workspace() -> int:
    # cuBLAS' workspace is 8.125 MiB by default (CUBLAS_WORKSPACE_CONFIG ":4096:2:16:8"),
    # 32 MiB (":4096:8") on Hopper and newer. How many are held in the allocator depends on
    # torch: cached per (handle, stream), one handle per thread, and autograd's backward
    # runs on a thread of its own, so two; or none (recent torch leaves
    # TORCH_CUBLAS_WORKSPACE_CACHE off by default: cuBLAS then allocates its own outside
    # PyTorch, and only cuBLASLt's 1 MiB is inside). One of the larger size is charged;
    # the margin covers a second.
    return 32 * MiB
