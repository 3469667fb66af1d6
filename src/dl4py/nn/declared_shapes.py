"""The tensors a model file's config declares, by name and shape, found without allocating them.

A model file comes from outside, its ``config.json`` too: a dense layer of a billion outputs
must be refused by comparing it with the weights the file holds, not by asking the allocator
for terabytes (or, for a size that fits, really taking it). ``load`` calls
``check_weights_declared`` before it builds the network. The network's own constructors run
on the ``meta`` device, whose tensors have a shape and no storage, so the names and shapes
are exactly those a real build gives, for every layer type, and nothing here repeats them.
"""

from __future__ import annotations

import torch

from dl4py.config.graph import GraphConfig
from dl4py.errors import ModelFileError
from dl4py.nn.builder import build_module
from dl4py.nn.graph import build_graph_module
from dl4py.nn.model_file import ModelFile

# What torch's constructors raise for a size no tensor can have (beyond int64, negative).
_BUILD_ERRORS = (RuntimeError, ValueError, OverflowError, TypeError)


def declared_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every parameter and buffer of the network ``config`` (a NetworkConfig or a GraphConfig)
    describes, by its ``state_dict`` name, with its shape. Nothing is allocated."""
    build = build_graph_module if isinstance(config, GraphConfig) else build_module
    with torch.device("meta"):
        module = build(config, torch.Generator())  # a meta tensor's random fill draws nothing
    return {name: tuple(tensor.shape) for name, tensor in module.state_dict().items()}


def check_weights_declared(saved: ModelFile) -> None:
    """Refuse a file whose config declares tensors its weights do not hold: another name, or
    another shape (``n_out: 1000000000`` over weights of 10 outputs). One ``ModelFileError``
    naming the layer and the tensor; a file without a config (a torch module's) has nothing
    to compare."""
    config = saved.config
    if config is None:
        return
    try:
        declared = declared_shapes(config)
    except _BUILD_ERRORS as exc:  # torch's message may run on with C++ frames: its first line says it
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelFileError(saved.path, f"config.json declares a network that cannot be built: {first}") from None
    for name, shape in declared.items():
        held = saved.weights.get(name)
        where = f"config.json's {_layer_of(config, name)} declares {name} of shape {_shape(shape)}"
        if held is None:
            raise ModelFileError(saved.path, f"{where}, which weights.safetensors lacks")
        if tuple(held.shape) != shape:
            raise ModelFileError(saved.path, f"{where} ({_count(shape)} values), but weights.safetensors "
                                             f"holds it as {_shape(held.shape)} ({_count(held.shape)} values)")
    for entry, tensors in (("weights.safetensors", saved.weights), ("master.safetensors", saved.masters or {})):
        for name, tensor in tensors.items():
            if name not in declared:
                raise ModelFileError(saved.path, f"{entry} holds {name}, which config.json's network does not declare")
            if tuple(tensor.shape) != declared[name]:  # weights were compared above: a master copy
                raise ModelFileError(saved.path, f"{entry} holds {name} as {_shape(tensor.shape)}, but config.json's "
                                                 f"{_layer_of(config, name)} declares {_shape(declared[name])}")


def _layer_of(config, name: str) -> str:
    """The config's layer a tensor belongs to: ``network.layers[5] (output)`` for ``5.op.weight``,
    ``network.vertices.conv1 (convolution)`` for a graph's ``vertices.conv1.op.weight``."""
    parts = name.split(".")
    if isinstance(config, GraphConfig):
        vertex = parts[1] if parts[0] == "vertices" and len(parts) > 1 else parts[0]
        node = config.vertices.get(vertex)
        layer = None if node is None else node.layer
        return f"network.vertices.{vertex}" + ("" if layer is None else f" ({layer.type_name})")
    index = int(parts[0]) if parts[0].isdigit() else None
    if index is None or index >= len(config.layers):
        return "network"
    return f"network.layers[{index}] ({config.layers[index].type_name})"


def _shape(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _count(shape) -> str:
    total = 1
    for d in shape:
        total *= d
    return f"{total:,}"
