"""The estimate's answer for one step: ``MemoryReport``, with a ``LayerMemory`` row per layer
(or per vertex of a graph). ``estimate`` and ``sharded`` both make it; ``report`` writes it out."""

from __future__ import annotations

from dataclasses import dataclass, field

from dl4py.config.network import NetworkConfig
from dl4py.memory.op import Op
from dl4py.memory.step_sizes import (
    MAX_TENSOR_ELEMENTS,
    StepSizes,
    fixed_costs,
    largest_tensor_per_example,
)
from dl4py.memory.timeline import Timeline


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
    parallelism: str = "data"  # a whole replica; or "sharded": then the bytes are one rank's of ``workers``
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


def replayed_fields(network, ops: list[Op], saved: dict[int, int], sizes: StepSizes, timeline: Timeline,
                    device_type: str) -> dict:
    """The fields of a ``MemoryReport`` that every estimate reads the same way off its replayed
    ``timeline`` and its operators: the peak, the element limit, the fixed costs, the layer rows."""
    return dict(
        device_type=device_type, peak_bytes=timeline.peak, peak_phase=timeline.peak_phase,
        at_peak=timeline.peak_live,
        max_batch_by_elements=MAX_TENSOR_ELEMENTS // largest_tensor_per_example(ops, sizes),
        fixed=fixed_costs(device_type), layers=_layer_rows(network, ops, saved, sizes),
    )


def _layer_rows(network, ops: list[Op], saved: dict[int, int], sizes: StepSizes) -> tuple:
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
