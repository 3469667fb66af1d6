"""Per-rank memory of a sharded training step (``training.parallelism: sharded``: FSDP2, ZeRO-3).

Each of N ranks keeps 1/N of every parameter, of its gradient and of the updater's state:
``torch.chunk`` along dim 0, so a rank holds ceil(rows / N) rows of each tensor (FSDP2 pads
every rank's storage to that; rank 0 is the fullest and its figure is the one given). The
step gathers one *unit* at a time, a layer or a row block of a large dense layer
(``dl4py.parallel.sharding``), and what is gathered is what sharding adds to the
single-process rules. Read off FSDP2 (``torch/distributed/fsdp/_fully_shard``) and checked
against ``LiveTensorBytes`` on 2 ranks:

- forward, unit u: the all-gather output (the whole unit, padded: N shards), the
  unsharded parameters it is copied out into (the same size), and the previous unit's
  all-gather output, which FSDP2 keeps until this copy-out (its implicit prefetch):
  three units at once. The unsharded parameters go when u's forward returns.
- backward, unit u: its unsharded parameters (gathered again), the next unit's all-gather
  output (prefetched as u's backward starts), the previous unit's reduce-scatter input
  (one is kept in flight until the next is issued) and u's full gradient: four units.
  Then the reduce-scatter input (the full gradient, padded) takes the gradient's place
  and its output, 1/N, is u's sharded gradient, which stays.
- the update: the for-loop kernel's scratch, a copy or two of one shard at a time
  (``update_temporaries``); ``shard_replica`` uses no other kernel.
- the batch's gradient: ``shard_replica`` marks the batch as needing one, so that FSDP2
  reduces the first layer's units as their backward ends (its hook waits for the
  gradient of a unit's input); the first layer's units add their parts into it.
- activations: those of the rank's own batch, by the single-process rules (``replay``);
  a split layer's blocks' outputs live beside their concatenation for a moment, and each
  block after the first makes a part of their shared input's gradient, added to the first.

The largest of these transients is a handful of units, and no unit holds more than
1/UNIT_FRACTION of the parameters (or 2^20 elements), which is why the layout splits large
dense layers. The estimate agrees with ``LiveTensorBytes`` to a few bytes on the MLP
784-4000-4000-10 and LeNet on 2 and 3 ranks (docs/memory.md), but for one thing of gloo's.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch import nn

from dl4py.backend.precision import resolve_precision
from dl4py.config.graph import GraphConfig
from dl4py.errors import ConfigError
from dl4py.memory import replay
from dl4py.memory.step_graph import StepGraph, chain_graph
from dl4py.memory.step_report import MemoryReport, replayed_fields
from dl4py.memory.step_sizes import (
    StepSizes,
    allocator_granule,
    buffer_bytes,
    check_batch_size,
    hold_at_start,
    kernels_for,
    network_of,
)
from dl4py.memory.timeline import Timeline
from dl4py.memory.updater_memory import update_temporaries
from dl4py.nn.builder import build_module
from dl4py.nn.optimizers import param_groups
from dl4py.parallel.sharding import row_blocks

# Units alive at once, at most, in a training step's backward (the unit's unsharded
# parameters and full gradient, the next unit's all-gather output, the previous unit's
# reduce-scatter input) and in a forward (two all-gather outputs and the unsharded parameters).
GATHERED_UNITS_TRAINING = 4
GATHERED_UNITS_FORWARD = 3
# The update's kernel: foreach's temporaries span every shard; fused has no DTensor rule.
SHARD_UPDATE = "loop"


@dataclass(frozen=True)
class Unit:
    """What ``fully_shard`` gathers at once: ``tensors`` are (shape, L2 or None if frozen)."""

    name: str
    layer: int
    tensors: tuple
    block_rows: int = 0  # a row block's output features; 0 for a whole layer

    @property
    def elements(self) -> int:
        return sum(math.prod(shape) for shape, _ in self.tensors)

    def shard_elements(self, workers: int) -> int:
        """Elements of rank 0's shards: ceil(rows / N) rows of each tensor (``torch.chunk``)."""
        return sum(-(-shape[0] // workers) * math.prod(shape[1:]) for shape, _ in self.tensors)

    def gathered_elements(self, workers: int) -> int:
        """The unit as gathered: N padded shards (all-gather output, unsharded parameters,
        reduce-scatter input all have this size)."""
        return workers * self.shard_elements(workers)

    @property
    def trains(self) -> bool:
        return all(l2 is not None for _, l2 in self.tensors)


def sharding_layout(network) -> list[Unit]:
    """The units of ``network`` in forward order, as ``shard_replica`` makes them: each dense
    layer's ``nn.Linear`` over 1/UNIT_FRACTION of the parameters in ``row_blocks`` blocks
    of rows (``torch.tensor_split``), every other layer with parameters whole. Built on the
    meta device: nothing is allocated."""
    with torch.device("meta"):
        module = build_module(network, torch.Generator())
    l2 = {id(p): group["weight_decay"] for group in param_groups(network, module) for p in group["params"]}
    total = sum(p.numel() for p in module.parameters())
    units = []
    for index, layer in enumerate(module):
        blocks, split = [], set()
        for linear in layer.modules():
            if not isinstance(linear, nn.Linear):
                continue
            count = row_blocks(linear.weight.numel(), total)
            if count == 1:
                continue
            split |= {id(p) for p in linear.parameters()}
            rows = [len(part) for part in torch.arange(linear.out_features).tensor_split(count)]
            for j, r in enumerate(rows):
                tensors = [((r, linear.in_features), l2.get(id(linear.weight)))]
                if linear.bias is not None:
                    tensors.append(((r,), l2.get(id(linear.bias))))
                blocks.append(Unit(f"layer {index} block {j + 1}/{count}", index, tuple(tensors), r))
        rest = tuple((tuple(p.shape), l2.get(id(p))) for p in layer.parameters() if id(p) not in split)
        if rest:
            units.append(Unit(f"layer {index}", index, rest))
        units += blocks
    return units


class ShardedTimeline(Timeline):
    """The single-process replay's timeline with FSDP2's gathers and reduce-scatters added
    where the replay enters a layer's forward and makes a layer's parameter gradients."""

    def __init__(self, round_to: int, units: list[Unit], names, workers: int, batch: int, sizes,
                 as_measured: bool = False):
        super().__init__(round_to)
        self.as_measured = as_measured
        self.live["gathered"] = 0
        self.peak_live = dict(self.live)
        self.workers, self.batch, self.sizes = workers, batch, sizes
        self.layers: dict[int, list[Unit]] = {}
        for unit in units:
            self.layers.setdefault(unit.layer, []).append(unit)
        self.layer_of = {name: i for i, name in enumerate(names)}
        self.backward_order = list(reversed(units))
        self.forward_layer = None
        self.held_unsharded = 0  # a whole-layer unit's parameters, until its layer returns
        self.kept_gather = 0  # the previous unit's all-gather output (forward)
        self.prefetched = None  # the unit whose all-gather output waits for its backward
        self.held_reduce = 0  # the previous unit's reduce-scatter input
        self.done = set()
        # FSDP2 reduces a unit when the gradient of its input arrives, so ``shard_replica``
        # marks the batch as needing one: the first layer's units each add their part of
        # the batch's gradient, summed where it is kept until the backward ends.
        self.first_layer = units[0].layer if units else None
        self.batch_gradient = 0
        # The last unit of a layer is reduced once the layer's backward node is done and has
        # let go of what it saved and of its output's gradient: at the replay's next step.
        self.pending: tuple[Unit, int] | None = None
        # On the CPU, gloo's reduce-scatter makes a full-size copy of its input. Its worker
        # thread lets go of it when it is done: at once as a rule (counted so), though a
        # rank now and then keeps it until it issues its next collective: one unit more,
        # which matters only when the peak falls just then (docs/memory.md).
        self.gloo = round_to == 1

    def gathered(self, unit: Unit) -> int:
        return unit.gathered_elements(self.workers) * self.sizes.param

    def _where(self, phase: str) -> tuple[str, int | None]:
        stage, _, rest = phase.partition(", ")
        rest = rest.removeprefix("accumulate, ")
        match = re.match(r"(.*) \(\w+\)$", rest)
        return stage, self.layer_of.get(match.group(1)) if match else None

    def alloc(self, kind: str, nbytes: float, phase: str) -> int:
        self._finish_pending()
        stage, layer = self._where(phase)
        if stage == "forward" and layer != self.forward_layer:
            self._leave_layer()
            if layer is None:  # the loss: the forward is over
                self.free("gathered", self.kept_gather)
                self.kept_gather = 0
            self.forward_layer = layer
            if layer in self.layers:
                return self._forward_units(layer, kind, nbytes, phase)
        if stage == "backward" and kind == "gradients" and nbytes > 0:  # an operator with parameters
            if layer not in self.done:
                self.done.add(layer)
                self._backward_units(layer)
            return 0  # the sharded gradients were counted unit by unit
        return super().alloc(kind, nbytes, phase)

    def _leave_layer(self) -> None:
        self.free("gathered", self.held_unsharded)  # resharded after its forward
        self.held_unsharded = 0

    def _forward_units(self, layer: int, kind: str, nbytes: float, phase: str) -> int:
        outputs = 0
        for unit in self.layers[layer]:
            size, where = self.gathered(unit), f"forward, {unit.name} (all-gather)"
            super().alloc("gathered", size, where)  # the all-gather output
            super().alloc("gathered", size, where)  # the unsharded parameters it is copied into
            self.free("gathered", self.kept_gather)
            self.kept_gather = size
            if unit.block_rows:
                block_output = self.batch * unit.block_rows * self.sizes.activation
                outputs += super().alloc("activations", block_output, f"forward, {unit.name} (linear)")
                self.free("gathered", size)  # the block is resharded after its forward
            else:
                self.held_unsharded += size
        result = super().alloc(kind, nbytes, phase)  # a split layer's: its blocks' outputs concatenated
        self.free("activations", outputs)
        return result

    def _backward_units(self, layer: int) -> None:
        units = list(reversed(self.layers.get(layer, [])))
        for unit in units:
            size, where = self.gathered(unit), f"backward, {unit.name}"
            if self.prefetched is not unit:
                super().alloc("gathered", size, where + " (all-gather)")
            self.prefetched = None
            super().alloc("gathered", size, where + " (all-gather copy-out)")
            later = self.backward_order.index(unit) + 1
            if later < len(self.backward_order):  # the next unit's all-gather starts now
                self.prefetched = self.backward_order[later]
                super().alloc("gathered", self.gathered(self.prefetched), where + " (prefetch)")
            self.free("gathered", size)  # its all-gather output, copied out
            # The gradient of the unit's input: the batch's, for the first layer; a split
            # layer's blocks each make a part of their shared input's, added to the first.
            part = 0
            if layer == self.first_layer:
                part = super().alloc("workspace", self.batch * self.sizes.example_bytes, where + " (batch gradient)")
            elif unit.block_rows and unit is not units[0]:
                inputs = self.batch * unit.tensors[0][0][1] * self.sizes.activation
                part = super().alloc("workspace", inputs, where + " (input gradient part)")
            super().alloc("gradients", unit.elements * self.sizes.param, where + " (full gradient)")
            if unit is units[-1]:
                self.pending = (unit, part)
            else:
                self._reduce(unit, part)

    def _finish_pending(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self._reduce(*pending)

    def _reduce(self, unit: Unit, part: int) -> None:
        self._post_backward(unit)
        if not part:
            return
        if unit.layer == self.first_layer and not self.batch_gradient:
            self.batch_gradient = part  # the first part is the sum
            return
        if self.as_measured:  # under a TorchDispatchMode autograd adds out of place (``replay``)
            super().alloc("workspace", part, f"backward, {unit.name} (accumulate)")
            self.free("workspace", part)
        self.free("workspace", part)  # added to the sum

    def _post_backward(self, unit: Unit) -> None:
        size, where = self.gathered(unit), f"backward, {unit.name} (reduce-scatter)"
        gradient = unit.elements * self.sizes.param
        self.free("gathered", size)  # resharded after its backward
        self.free("gathered", self.held_reduce)
        self.held_reduce = super().alloc("gathered", size, where)  # the gradient, padded, to reduce
        self.free("gradients", gradient)
        super().alloc("gradients", unit.shard_elements(self.workers) * self.sizes.param, where)  # its output
        if self.gloo:
            super().alloc("gathered", size, where)
            self.free("gathered", size)

    def end_backward(self) -> None:
        self._finish_pending()
        self.free("gathered", self.held_reduce)
        self.free("workspace", self.batch_gradient)  # with the autograd graph
        self.held_reduce = self.batch_gradient = 0


def estimate_sharded(config, batch_size: int, workers: int, precision: str | None = None, updater=None,
                     device: str | torch.device = "cuda", optimizer: str = "auto", data_bytes: int = 0,
                     as_measured: bool = False):
    """The peak of one rank's training step when ``workers`` ranks train ``config`` sharded,
    each on its own batch of ``batch_size``; a ``MemoryReport`` whose byte counts are one
    rank's (``estimate(..., parallelism="sharded", workers=N)`` calls this). Example::

        report = estimate(mlp, 128, parallelism="sharded", workers=2)
        print(report.peak_bytes / 2**20, "MiB per rank")
    """
    network, run_precision = network_of(config)
    _check_shardable(network, workers)
    check_batch_size(batch_size)
    policy = resolve_precision(precision or run_precision or "float")
    units = _modelled_units(network, policy)
    device_type = torch.device(device).type
    updater = updater or network.updater
    _check_optimizer(optimizer)
    graph = chain_graph(network, kernels_for(device_type))
    sizes = StepSizes(policy, graph, device_type)
    timeline = ShardedTimeline(allocator_granule(device_type), units, graph.names, workers, batch_size, sizes,
                               as_measured)
    shard = sum(unit.shard_elements(workers) for unit in units)
    module_bytes = shard * sizes.param + buffer_bytes(graph.ops, sizes.param)  # buffers are not sharded
    state_bytes = updater.state_copies * shard * sizes.state
    input_bytes = hold_at_start(timeline, module_bytes, state_bytes, data_bytes, sizes.batch_bytes(batch_size))
    saved = _replay_forward_and_backward(graph, batch_size, sizes, timeline, as_measured)
    _replay_shard_update(units, workers, updater, sizes, timeline)
    return MemoryReport(
        batch_size=batch_size, precision=policy.name, updater=type(updater).__name__, training=True,
        optimizer=SHARD_UPDATE, parameters=sum(u.elements for u in units), parameter_bytes=module_bytes,
        gradient_bytes=shard * sizes.state, updater_bytes=state_bytes, activation_bytes=sum(saved.values()),
        input_bytes=input_bytes, **replayed_fields(network, graph.ops, saved, sizes, timeline, device_type),
        workers=workers, parallelism="sharded", gathered_unit_bytes=max(timeline.gathered(u) for u in units),
    )


def _check_shardable(network, workers) -> None:
    if isinstance(network, GraphConfig):
        raise ConfigError("parallelism", "the sharded memory estimate covers MultiLayerNetwork configs; "
                                         "a ComputationGraph's is not modelled yet")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 2:
        raise ConfigError("workers", f"sharding needs 2 or more workers, got {workers!r}")


def _modelled_units(network, policy) -> list[Unit]:
    """The units ``network`` is sharded in, where this estimate has rules for them: float or
    double parameters, and no frozen layer."""
    if policy.master_weights or policy.autocast_dtype is not None:
        raise ConfigError("precision", f"the sharded memory estimate covers float and double; {policy.name} "
                                       "(16-bit gathers, float32 master shards) is not modelled yet")
    units = sharding_layout(network)
    frozen = [unit.name for unit in units if not unit.trains]
    if frozen:
        raise ConfigError("network.layers", f"the sharded memory estimate has no rule for frozen layers "
                                            f"({', '.join(frozen)})")
    return units


def _check_optimizer(optimizer: str) -> None:
    if optimizer not in ("auto", SHARD_UPDATE):
        raise ConfigError("optimizer", f"sharded training steps its shards with the for-loop kernel "
                                       f"(shard_replica), not {optimizer!r}")


def _replay_forward_and_backward(graph: StepGraph, batch_size: int, sizes: StepSizes, timeline: ShardedTimeline,
                                 as_measured: bool) -> dict[int, int]:
    """The rank's forward and backward on its own batch, the timeline adding the gathers and
    reduce-scatters; returns the bytes each layer saves for backward."""
    step, saved = replay.forward(graph, batch_size, sizes, timeline)
    replay.backward(step, in_place_accumulation=not as_measured)
    timeline.end_backward()
    return saved


def _replay_shard_update(units: list[Unit], workers: int, updater, sizes: StepSizes,
                         timeline: ShardedTimeline) -> None:
    """The update's scratch: the for-loop kernel steps rank 0's shard of each tensor, one at a time."""
    shards = [(-(-shape[0] // workers) * math.prod(shape[1:]), l2) for unit in units for shape, l2 in unit.tensors]
    scratch = update_temporaries(updater, SHARD_UPDATE, shards, sizes.state)
    timeline.alloc("workspace", scratch, f"update ({type(updater).__name__}, {SHARD_UPDATE}, shards)")
    timeline.free("workspace", scratch)


def fewest_workers(config, batch_size: int, memory_bytes: int, context: bool | int = True, limit: int = 4096,
                   **options):
    """(N, that rank's report) for the fewest ranks N (2 to ``limit``) over which a sharded
    step, each rank on a batch of ``batch_size``, needs at most ``memory_bytes`` per device;
    None if none does (a rank's activations alone may not fit). More ranks never need more
    (each holds 1/N; the gathered units shrink or stay), so it doubles, then bisects."""

    def report(workers: int):
        return estimate_sharded(config, batch_size, workers, **options)

    def fits(found) -> bool:
        return found.needed_bytes(context) <= memory_bytes

    low, high = 1, 2  # ``low`` does not fit (1: the single device, known not to)
    found = report(high)
    while not fits(found):
        if high >= limit:
            return None
        low, high = high, min(high * 2, limit)
        found = report(high)
    while high - low > 1:
        middle = (low + high) // 2
        candidate = report(middle)
        if fits(candidate):
            high, found = middle, candidate
        else:
            low = middle
    return high, found
