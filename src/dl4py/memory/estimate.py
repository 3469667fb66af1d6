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

from dataclasses import replace

import torch

from dl4py.backend.device_memory import CUDA_CONTEXT_BYTES
from dl4py.backend.precision import resolve_precision
from dl4py.config.graph import GraphConfig
from dl4py.config.parallel import ParallelPlan, note_deprecated
from dl4py.config.updaters import Updater
from dl4py.errors import ConfigError
from dl4py.memory import replay
from dl4py.memory.graph_ops import graph_step
from dl4py.memory.op import Op
from dl4py.memory.sharded import estimate_sharded
from dl4py.memory.step_graph import StepGraph, chain_graph
from dl4py.memory.step_report import LayerMemory, MemoryReport, replayed_fields
from dl4py.memory.tensor import gather_layer, hybrid_rank_graph, rank_network, tensor_rank_graph
from dl4py.memory.step_sizes import (
    MAX_TENSOR_ELEMENTS,
    MiB,
    StepSizes,
    allocator_granule,
    buffer_bytes,
    check_batch_size,
    hold_at_start,
    kernels_for,
    network_of,
)
from dl4py.memory.timeline import Timeline
from dl4py.memory.updater_memory import optimizer_implementation

# The report's types and the constants were defined here first, and are still imported from here.
__all__ = ["CUDA_CONTEXT_BYTES", "MAX_TENSOR_ELEMENTS", "LayerMemory", "MemoryReport", "MiB", "estimate"]


def estimate(config, batch_size: int, precision: str | None = None, updater: Updater | None = None,
             training: bool = True, device: str | torch.device = "cuda", optimizer: str = "auto",
             data_bytes: int = 0, as_measured: bool = False, parallelism: str | ParallelPlan = "data",
             workers: int = 1) -> MemoryReport:
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

    ``parallelism`` names the plan (``config.parallel.ParallelPlan``'s words) whose one rank
    is estimated: ``"data"``, a whole replica (one device's step; with ``workers`` above 1, one
    worker's, whose replicas meet in a flat buffer: ``_exchange``); ``"sharded"`` with
    ``workers=N``, one of N ranks training sharded (FSDP2), each on a batch of ``batch_size``
    (``memory.sharded``); ``"tensor"``, one of N ranks training the same batch with its dense
    pairs split (``memory.tensor``); ``"hybrid"``, one of N ranks each on a batch of its own
    up to the first dense layer, there gathered, the dense pairs split on the gathered rows.
    """
    sync = parallelism.sync if isinstance(parallelism, ParallelPlan) else "averaging"
    if isinstance(parallelism, ParallelPlan):
        parallelism = parallelism.kind
    if parallelism == "single":
        note_deprecated('estimate(parallelism="single")', 'estimate(parallelism="data")')
        parallelism = "data"
    if parallelism == "sharded":
        if not training:
            raise ConfigError("parallelism", "sharded is a way to train; estimate inference with data")
        return estimate_sharded(config, batch_size, workers, precision, updater, device, optimizer,
                                data_bytes, as_measured)
    network, run_precision = network_of(config)
    if parallelism in ("tensor", "hybrid"):
        if not training:
            raise ConfigError("parallelism", f"{parallelism} is a way to train; estimate inference with data")
        policy = resolve_precision(precision or run_precision or "float")
        if policy.master_weights or policy.uses_loss_scaling:  # distributed_state.check_precision's rule
            raise ConfigError("precision", f"dl4py's {parallelism} plan trains float, double and mixed-bf16; "
                                           f"{policy.name} (float32 masters or loss scaling) it does not yet")
        narrowed = rank_network(network, workers, parallelism)
        if parallelism == "tensor":
            edit, summed_before = tensor_rank_graph(network, workers), None
        else:  # the layers before the gather train apart: their gradients summed in a flat buffer
            edit, summed_before = hybrid_rank_graph(network, workers), gather_layer(network)
        # the DTensors are stepped by the for-loop kernel (parallel/tensor_parallel.py)
        report = _replica(narrowed, run_precision, batch_size, precision, updater, True, device, "loop", data_bytes,
                          as_measured, 1, sync, edit, summed_before)
        return replace(report, parallelism=parallelism, workers=workers)
    if parallelism != "data":
        raise ConfigError("parallelism", f"must be data, sharded, tensor or hybrid, got {parallelism!r}")
    return _replica(network, run_precision, batch_size, precision, updater, training, device, optimizer, data_bytes,
                    as_measured, workers, sync)


def _replica(network, run_precision, batch_size: int, precision, updater, training: bool, device, optimizer: str,
             data_bytes: int, as_measured: bool, workers: int, sync: str, edit_graph=None,
             summed_before: int | None = None) -> MemoryReport:
    """One whole replica's step (``estimate``'s data plan), its operators' graph changed by
    ``edit_graph`` where a plan's rank runs them otherwise (``memory.tensor``), and the
    gradients of the layers before ``summed_before`` summed over the ranks in a flat buffer
    after the backward pass (the hybrid's)."""
    check_batch_size(batch_size)
    policy = resolve_precision(precision or run_precision or "float")
    device_type = torch.device(device).type
    updater = updater or network.updater
    implementation = optimizer_implementation(optimizer, updater, device_type, policy.uses_loss_scaling)
    graph = _step_graph(network, device_type)
    if edit_graph is not None:
        graph = edit_graph(graph)
    sizes = StepSizes(policy, graph, device_type)
    timeline = Timeline(allocator_granule(device_type))
    parameter_bytes, updater_bytes = _resident_bytes(graph.ops, updater, sizes, training)
    input_bytes = hold_at_start(timeline, parameter_bytes, updater_bytes, data_bytes, sizes.batch_bytes(batch_size))
    if training:
        step, saved = replay.forward(graph, batch_size, sizes, timeline)
        replay.backward(step, in_place_accumulation=not as_measured)
        if workers > 1 and sync == "shared_gradients":
            _exchange(timeline, graph.ops, updater_bytes, sizes, sync)
        if summed_before is not None:
            _exchange(timeline, [op for op in graph.ops if op.layer < summed_before], updater_bytes, sizes,
                      "shared_gradients")
        replay.update(graph.ops, updater, implementation, sizes, timeline)
        if workers > 1 and sync == "averaging":
            _exchange(timeline, graph.ops, updater_bytes, sizes, sync)
    else:
        replay.inference(graph, batch_size, sizes, timeline)
        saved = {}
    return MemoryReport(
        batch_size=batch_size, precision=policy.name, updater=type(updater).__name__, training=training,
        optimizer=implementation if training else "none", parameters=_parameter_elements(graph.ops),
        parameter_bytes=parameter_bytes, updater_bytes=updater_bytes,
        gradient_bytes=_trained_elements(graph.ops) * sizes.state if training else 0,
        activation_bytes=sum(saved.values()), input_bytes=input_bytes,
        **replayed_fields(network, graph.ops, saved, sizes, timeline, device_type),
    )


def _step_graph(network, device_type: str) -> StepGraph:
    """The operators of one step of a network (a chain of layers) or of a graph's vertices."""
    kernels = kernels_for(device_type)
    return graph_step(network, kernels) if isinstance(network, GraphConfig) else chain_graph(network, kernels)


def _resident_bytes(ops: list[Op], updater: Updater, sizes: StepSizes, training: bool) -> tuple[int, int]:
    """Bytes that live through the whole step: the module's (its parameters and buffers, and
    the float32 masters a training step keeps) and the updater's state."""
    params = _parameter_elements(ops)
    master = 4 * params if sizes.master and training else 0
    module_bytes = params * sizes.param + buffer_bytes(ops, sizes.param)
    state_bytes = updater.state_copies * _trained_elements(ops) * sizes.state if training else 0
    return module_bytes + master, state_bytes


def _exchange(timeline: Timeline, ops: list[Op], updater_bytes: int, sizes: StepSizes, sync: str) -> None:
    """Where a data-parallel worker's replica meets the others (``parallel/averaging.py``): one
    flat buffer of what it averages, made by ``torch.cat`` and dropped after the all-reduce.
    ``averaging``, after the update: the stepped parameters, the floating buffers and the
    updater state (averaged by default); ``shared_gradients``, between the backward pass and
    the update: every stepped parameter's gradient, a frozen one's made as zeros and kept. A
    float32 buffer (float64 for double), whatever the parameters' own type (masters, 16-bit)."""
    wide = 8 if sizes.state == 8 else 4
    params = _parameter_elements(ops)
    if sync == "shared_gradients":
        frozen = params - _trained_elements(ops)
        timeline.alloc("gradients", frozen * sizes.state, "exchange, zero gradients of frozen parameters")
        flat = params * wide
    else:
        floating_buffers = sum(op.param_elements for op in ops if op.name == "batch_norm")  # running mean, variance
        flat = (params + floating_buffers) * wide + updater_bytes // sizes.state * wide
    timeline.alloc("workspace", flat, f"exchange ({sync}): the replicas' flat buffer")
    timeline.free("workspace", flat)


def _parameter_elements(ops: list[Op]) -> int:
    return sum(op.param_elements for op in ops)


def _trained_elements(ops: list[Op]) -> int:
    # A FrozenLayer's parameters take no gradient and no updater state (its masters remain:
    # MasterWeights copies the whole module).
    return sum(op.param_elements for op in ops if not op.frozen)
