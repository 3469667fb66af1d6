"""ComputationGraph: a network built from a GraphConfig (DL4J's class of that name).

It trains, evaluates, saves and runs in parallel exactly as a MultiLayerNetwork does: it
is a ``Model`` whose module is a ``GraphModule``. Data with one input and one output is what
a MultiLayerNetwork takes. Several inputs travel as one row per example, the inputs' values
side by side in the order of ``config.inputs`` (``pack_inputs``), so that every data path
(batching, shuffling, the device copy, ParallelWrapper's shards) carries them unchanged; the
graph splits the row at its inputs. Several outputs: labels side by side in the order of
``config.outputs``, each output's as ``n_out`` columns (class indices become one-hot rows,
``pack_labels``); the loss is the sum of the outputs' losses, as DL4J's score.
"""

from __future__ import annotations

import math
from functools import reduce

import torch
from torch import nn

from dl4py.backend import Backend, Precision
from dl4py.backend.cuda_environment import environment
from dl4py.config.frozen import is_frozen, unfrozen
from dl4py.config.graph import GraphConfig, example_shape
from dl4py.config.layers import Shape
from dl4py.config.recurrent import RnnOutputLayer
from dl4py.errors import ConfigError, DataError
from dl4py.nn.builder import OutputLoss, layer_module
from dl4py.nn.model import Model, _as_tensor
from dl4py.nn.network import check_data_for, check_features_for, check_labels_for
from dl4py.nn.optimizers import make_optimizer, optimizer_kernel, param_groups
from dl4py.nn.recurrent import RnnOutputLoss, SequenceMask
from dl4py.nn.signature import Signature, graph_signature
from dl4py.nn.summary import ruled_table


class GraphModule(nn.Module):
    """The graph's forward pass. Layer vertices are ``self.vertices[name]`` (parameters
    ``vertices.conv1.op.weight``); iterating the module yields them in computation order,
    the order of ``config.layers``. A vertex's result is dropped as soon as its last reader
    has run, so that inference holds only what the graph still needs."""

    def __init__(self, config: GraphConfig, generator: torch.Generator, masks: SequenceMask):
        super().__init__()
        self.output_names = tuple(config.outputs)
        shapes = config.input_shapes()
        self.input_views = tuple((name, _flat_size(shapes[name]), _dims(shapes[name])) for name in config.inputs)
        self.vertices = nn.ModuleDict()
        self._order: list[str] = []
        plan = []
        for vertex in config.vertex_shapes():
            node, where = vertex.node, f"network.vertices.{vertex.name}"
            if node.layer is not None:
                if hasattr(nn.ModuleDict, vertex.name) or "." in vertex.name:
                    raise ConfigError(where, f"{vertex.name!r} cannot name a layer vertex (a name of torch's "
                                             "ModuleDict, or with a '.'); rename it")
                received = shapes[node.inputs[0]]
                self.vertices[vertex.name] = layer_module(node.layer, received, vertex.input, config, generator,
                                                          masks, join_layer(where))
                self._order.append(vertex.name)
                plan.append((vertex.name, node.inputs, None))
            else:
                plan.append((vertex.name, node.inputs, _vertex_function(node.vertex, vertex.inputs)))
            shapes[vertex.name] = vertex.output
        last_reader = {}
        for step, (_, sources, _) in enumerate(plan):
            for source in sources:
                last_reader[source] = step
        # Names each step releases after it has run (outputs are kept to the end).
        self._plan = [(name, sources, function,
                       tuple(s for s in dict.fromkeys(sources) if last_reader[s] == step and s not in self.output_names))
                      for step, (name, sources, function) in enumerate(plan)]

    def __iter__(self):
        return (self.vertices[name] for name in self._order)

    def __len__(self) -> int:
        return len(self._order)

    def forward(self, x):
        values = self._run(self._inputs(x), release=True)
        outputs = tuple(values[name] for name in self.output_names)
        return outputs[0] if len(outputs) == 1 else outputs

    def feed_forward(self, x) -> dict[str, torch.Tensor]:
        """Every input's and vertex's value by name (DL4J's ``feedForward``): nothing is released."""
        return self._run(self._inputs(x), release=False)

    def _run(self, values: dict, release: bool) -> dict:
        for name, sources, function, released in self._plan:
            args = [values[s] for s in sources]
            values[name] = self.vertices[name](args[0]) if function is None else function(*args)
            del args
            if release:
                for source in released:
                    del values[source]
        return values

    def _inputs(self, x) -> dict:
        if isinstance(x, (tuple, list)):  # one tensor per input, as the module may be called directly
            parts = list(x)
        elif len(self.input_views) == 1:
            parts = [x]
        else:  # packed: each input's values side by side in one row per example
            parts = list(torch.split(x, [size for _, size, _ in self.input_views], dim=1))
        values = {}
        for (name, _, dims), part in zip(self.input_views, parts):
            if dims is not None and part.dim() == 2:  # flat rows -> [c, h, w] or [time, size]
                part = part.reshape(part.shape[0], *dims)
            values[name] = part
        return values


def join_layer(where: str) -> str:
    return f"{where}.layer"


def _dims(shape: Shape):
    """What a flat row of this input is viewed as: [c, h, w] or [time, size]; None: as it comes."""
    return shape.dims if shape.kind in ("cnn", "rnn") else None


def _flat_size(shape: Shape) -> int | None:
    return None if None in shape.dims else math.prod(shape.dims)


def _vertex_function(vertex, inputs: tuple[Shape, ...]):
    """The tensor operation of a parameter-free vertex (contract in docs/graphs.md)."""
    name = vertex.type_name
    if name == "merge":
        dim = 2 if inputs[0].kind == "rnn" else 1  # [batch, time, size] / [batch, features or channels, ...]
        return lambda *xs: torch.cat(xs, dim=dim)
    if name == "elementwise":
        op = vertex.op
        if op == "add":
            return lambda *xs: reduce(torch.add, xs)
        if op == "subtract":
            return torch.sub
        if op == "product":
            return lambda *xs: reduce(torch.mul, xs)
        if op == "average":
            return lambda *xs: reduce(torch.add, xs) / len(xs)
        assert op == "max"
        return lambda *xs: reduce(torch.maximum, xs)
    if name == "subset":
        start, stop = vertex.from_index, vertex.to_index + 1
        if inputs[0].kind == "rnn":
            return lambda x: x[:, :, start:stop]
        return lambda x: x[:, start:stop]
    assert name == "preprocessor"
    if vertex.preprocessor == "cnn_to_feed_forward":
        return lambda x: torch.flatten(x, 1)
    dims = (vertex.channels, vertex.height, vertex.width)
    return lambda x: x.reshape(x.shape[0], *dims)


def build_graph_module(config: GraphConfig, generator: torch.Generator, masks=None) -> GraphModule:
    return GraphModule(config, generator, SequenceMask() if masks is None else masks)


class ComputationGraph(Model):
    """A network from a ``GraphConfig``. Example::

        graph = ComputationGraph(GraphConfig.from_yaml(text)).init()
        graph.fit(MnistDataSetIterator(128, train=True), epochs=1)
        two_inputs.fit(([images, extras], labels), epochs=3)   # several inputs: a list of arrays
    """

    kind = "graph"

    def __init__(self, config: GraphConfig, backend: str | Backend | None = None,
                 precision: str | Precision | None = None):
        if not isinstance(config, GraphConfig):
            raise TypeError(f"ComputationGraph needs a GraphConfig, got {type(config).__name__}")
        super().__init__(backend, precision)
        self.config = config
        self.seed = config.seed
        self._masks = SequenceMask()
        self._outputs = config.output_layers()
        self._losses = [RnnOutputLoss(layer, self._masks) if isinstance(layer, RnnOutputLayer) else OutputLoss(layer)
                        for layer in self._outputs]
        example_shape(config)  # several inputs share a row: a ConfigError unless each has a fixed size
        shapes = config.input_shapes()
        self._input_sizes = [_flat_size(shapes[name]) for name in config.inputs]

    def _build_module(self, device: torch.device, dtype: torch.dtype):
        generator = torch.Generator().manual_seed(self.config.seed)
        return build_graph_module(self.config, generator, self._masks).to(device=device, dtype=dtype)

    def _make_optimizer(self, module, plain_name):
        # The groups come from the vertices, whatever a distributed plan renamed: plain_name unused.
        kernel = optimizer_kernel(environment().fused_optimizer, self.config.updater, self.backend.device,
                                  loss_scaling=self.precision.uses_loss_scaling)
        return make_optimizer(self.config.updater, param_groups(self.config, module), kernel)

    # ---- outputs and losses ------------------------------------------------------------
    @property
    def n_out(self) -> int:
        return sum(layer.n_out for layer in self._outputs)

    def signature(self) -> Signature:
        return graph_signature(self.config)

    def loss(self, outputs, labels):
        if len(self._losses) == 1:
            return self._losses[0](outputs, labels)
        parts = torch.split(labels, [layer.n_out for layer in self._outputs], dim=1)
        return sum(loss(out, part) for loss, out, part in zip(self._losses, outputs, parts))

    def activate(self, outputs):
        if len(self._losses) == 1:
            return self._losses[0].activate(outputs)
        return torch.cat([loss.activate(out) for loss, out in zip(self._losses, outputs)], dim=1)

    def learning_rate_at(self, updates: int, epochs: int) -> float | None:
        updater = self.config.updater
        return None if updater.schedule is None else updater.learning_rate_at(updates, epochs)

    def set_mask(self, mask: torch.Tensor | None) -> None:
        self._masks.current = mask

    # ---- data checks -------------------------------------------------------------------
    def check_features(self, features: torch.Tensor, where: str) -> None:
        if len(self.config.inputs) == 1:
            check_features_for(self.config.input_type, features, where)
            return
        width = sum(self._input_sizes)
        if features.dim() != 2 or features.shape[1] != width:
            shown = " + ".join(f"{name} {size}" for name, size in zip(self.config.inputs, self._input_sizes))
            raise DataError(f"{where}: features have shape {list(features.shape)} but the graph's inputs travel "
                            f"side by side, [n, {width}] ({shown}): give a list of arrays, one per input, "
                            "or ComputationGraph.pack_inputs(...)")

    def check_labels(self, labels: torch.Tensor, where: str) -> None:
        if len(self._outputs) == 1:
            check_labels_for(self._outputs[0], labels, where)
        elif labels.dim() != 2 or labels.shape[1] != self.n_out or not labels.is_floating_point():
            shown = " + ".join(f"{name} {layer.n_out}" for name, layer in zip(self.config.outputs, self._outputs))
            raise DataError(f"{where}: labels have shape {list(labels.shape)} ({labels.dtype}) but the graph's "
                            f"outputs take float rows side by side, [n, {self.n_out}] ({shown}): give a list of "
                            "labels, one per output, or ComputationGraph.pack_labels(...)")

    def check_data(self, iterator) -> None:
        if len(self._outputs) == 1:
            check_data_for(iterator, self.n_out, f"network.vertices.{self.config.outputs[0]}.layer.n_out")

    # ---- several inputs and outputs ---------------------------------------------------
    def pack_inputs(self, *arrays) -> torch.Tensor:
        """One row per example: each input's values (flattened) side by side, in the order of
        ``config.inputs``. What ``fit``/``output`` do with a list of arrays."""
        if len(arrays) != len(self.config.inputs):
            raise DataError(f"the graph has {len(self.config.inputs)} inputs ({', '.join(self.config.inputs)}), "
                            f"got {len(arrays)} arrays")
        rows = []
        for name, size, array in zip(self.config.inputs, self._input_sizes, arrays):
            tensor = _as_tensor(array, f"input {name!r}")
            flat = tensor.reshape(tensor.shape[0], -1).float()
            if flat.shape[1] != size:
                raise DataError(f"input {name!r}: {list(tensor.shape)} has {flat.shape[1]} values per example, "
                                f"its input type {self.config.inputs[name].type_name} takes {size}")
            rows.append(flat)
        if len({r.shape[0] for r in rows}) > 1:
            raise DataError(f"the inputs have different numbers of examples: {[r.shape[0] for r in rows]}")
        return torch.cat(rows, dim=1)

    def pack_labels(self, *labels) -> torch.Tensor:
        """Labels of several outputs side by side, class indices as one-hot rows."""
        if len(labels) != len(self._outputs):
            raise DataError(f"the graph has {len(self._outputs)} outputs ({', '.join(self.config.outputs)}), "
                            f"got {len(labels)} label arrays")
        rows = []
        for name, layer, value in zip(self.config.outputs, self._outputs, labels):
            tensor = _as_tensor(value, f"labels of {name!r}")
            check_labels_for(layer, tensor, f"labels of {name!r}")
            if tensor.dim() == 1:
                tensor = torch.nn.functional.one_hot(tensor.long(), layer.n_out)
            rows.append(tensor.float())
        return torch.cat(rows, dim=1)

    def _packed(self, data):
        """``([x1, x2], y)`` or ``(x, [y1, y2])`` -> one features and one labels tensor."""
        if isinstance(data, tuple) and len(data) == 2:
            features, labels = data
            if isinstance(features, (list, tuple)) and len(self.config.inputs) > 1:
                features = self.pack_inputs(*features)
            if isinstance(labels, (list, tuple)) and len(self._outputs) > 1:
                labels = self.pack_labels(*labels)
            return features, labels
        return data

    def fit(self, data, y=None, *args, validation=None, **kwargs):
        """``Model.fit``; with several inputs (or outputs) the arrays come as lists, in Keras'
        form ``fit([x1, x2], y)`` or as one pair ``fit(([x1, x2], y))``."""
        if y is not None and not isinstance(y, int):  # Keras' fit(x, y): the pair, packed as one
            data, y = (data, y), None
        return super().fit(self._packed(data), y, *args, validation=None if validation is None
                           else self._packed(validation), **kwargs)

    def score(self, data=None, **kwargs) -> float:
        return super().score(self._packed(data), **kwargs)

    def output(self, features, batch_size: int = 4096, **kwargs):
        """Predictions; with several inputs ``features`` is a list of arrays, with several
        outputs the result is a list of tensors, one per output."""
        if isinstance(features, (list, tuple)) and len(self.config.inputs) > 1:
            features = self.pack_inputs(*features)
        predictions = super().output(features, batch_size, **kwargs)
        if len(self._outputs) == 1:
            return predictions
        return list(torch.split(predictions, [layer.n_out for layer in self._outputs], dim=1))

    def feed_forward(self, features) -> dict[str, torch.Tensor]:
        """Every input's and vertex's activation for ``features`` by name, in inference mode
        (DL4J's ``feedForward``), outputs after their activation; several inputs as a list of arrays."""
        self.init()
        if isinstance(features, (list, tuple)) and len(self.config.inputs) > 1:
            features = self.pack_inputs(*features)
        x = _as_tensor(features, "features")
        self.check_features(x, "feed_forward(features)")
        self.set_mask(None)
        with self._inference(), self.precision.forward_context(self.backend.device):
            values = self.module.feed_forward(self.prepare_input(x.to(self.backend.device)))
            for name, loss in zip(self.config.outputs, self._losses):  # as output() gives them
                values[name] = loss.activate(values[name])
        return values

    def _evaluate_into(self, data, make, batch_size, label, features, loss: bool = False):
        if len(self._outputs) > 1:
            raise DataError(f"evaluate needs a graph with one output; this one has {len(self._outputs)} "
                            f"({', '.join(self.config.outputs)}): evaluate each of output(...)'s results")
        return super()._evaluate_into(self._packed(data), make, batch_size, label, features, loss)

    def summary(self) -> str:
        self.init()
        table, _ = graph_summary_table(self.config, self.module)
        return f"{table}  (precision {self.precision}, backend {self.backend})"


def graph_summary_table(config: GraphConfig, module: GraphModule | None = None) -> tuple[str, int]:
    """Per vertex: name, what it is, what it reads, output shape, parameters; then the total."""
    if module is None:
        with torch.device("meta"):
            module = build_graph_module(config, torch.Generator())
    rows = [("#", "vertex", "type", "inputs", "output", "params")]
    total = 0
    for vertex in config.vertex_shapes():
        node = vertex.node
        count = sum(p.numel() for p in module.vertices[vertex.name].parameters()) if node.layer is not None else 0
        total += count
        kind = node.kind
        if node.layer is not None:
            kind = unfrozen(node.layer).type_name + (" (frozen)" if is_frozen(node.layer) else "")
        elif kind == "elementwise":
            kind = f"elementwise {node.vertex.op}"
        rows.append((str(vertex.index), vertex.name, kind, ", ".join(node.inputs), str(vertex.output), f"{count:,}"))
    inputs = ", ".join(f"{name} {shape}" for name, shape in config.input_shapes().items())
    return f"inputs: {inputs}\n{ruled_table(rows, total)}", total


__all__ = ["ComputationGraph", "GraphModule", "build_graph_module", "graph_summary_table"]
