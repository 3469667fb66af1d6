"""What a caller may know about a model without probing it: ``model.signature()``.

Serving, exporting, ``predict``, ParallelInference and the monitor read these facts instead of
asking a model for attributes it may not have. A ``Signature`` is frozen and made from what the
model was declared with (a network's config, the loss a TorchModel was given): nothing is
built and no weight is read, so it is cheap and the same before and after ``init``.

Who reads what:
- ``input_shape``: serve (the request body's shape), export (the traced example), ``dl4py predict``;
- ``input_type``: ``dl4py predict`` on an image folder (a convolutional input's height and width);
- ``input_names``: ParallelInference and ``predict`` pack a graph's several inputs;
- ``outputs``: serve (one output, its width), ParallelInference (splitting a graph's outputs),
  ``predict`` (class indices or values, per output);
- ``model``: the weights-only export (rebuilt from a config) and the monitor's layer names.

Example::

    >>> MultiLayerNetwork(mnist_mlp).signature()          # doctest: +SKIP
    Signature(model='multilayer', input_shape=(784,), input_type=FeedForward(size=784),
              input_names=(), outputs=(Output(name=None, size=10, labels='classes'),))
"""

from __future__ import annotations

from dataclasses import dataclass

from dl4py.config.graph import GraphConfig, example_shape
from dl4py.config.input_type import InputType
from dl4py.config.network import NetworkConfig
from dl4py.eval.select import is_regression_loss

# The model kinds (each model class's ``kind``).
MULTILAYER, GRAPH, TORCH_MODULE = "multilayer", "graph", "torch_module"
# What an output's labels are: class indices or one-hot rows (a classifier's), or regression targets.
CLASSES, VALUES = "classes", "values"


@dataclass(frozen=True)
class Output:
    """One output of the model, in the order its predictions and labels sit side by side."""

    name: str | None  # the graph's output vertex; None for a network's or a TorchModel's one output
    size: int | None  # columns per example (n_out); None where only a forward pass tells (a TorchModel)
    labels: str  # CLASSES or VALUES, by the output's loss (a regression loss: mse, l1, ... means VALUES)

    @property
    def classifier(self) -> bool:
        return self.labels == CLASSES


@dataclass(frozen=True)
class Signature:
    """A model's inputs and outputs as its declaration gives them."""

    model: str  # MULTILAYER, GRAPH or TORCH_MODULE
    # One example as the data carries it (a graph's several inputs: one packed row); None in it
    # for a sequence of any length; None altogether where the model declares none (a TorchModel).
    input_shape: tuple[int | None, ...] | None
    input_type: InputType | None  # the one input's declared type; None for several or none declared
    input_names: tuple[str, ...]  # a graph's inputs in packing order; () for a network or a TorchModel
    outputs: tuple[Output, ...]

    @property
    def several_inputs(self) -> bool:
        """Features come as a list of arrays, one per input (``ComputationGraph.pack_inputs``)."""
        return len(self.input_names) > 1

    @property
    def classifier(self) -> bool:
        """Whether the first output's labels are classes: what ``predict`` and serve answer with."""
        return self.outputs[0].classifier

    @property
    def from_config(self) -> bool:
        """Whether the model is rebuilt from a config (a network or a graph; a TorchModel is not)."""
        return self.model != TORCH_MODULE


def network_signature(config: NetworkConfig) -> Signature:
    """A MultiLayerNetwork's: its input type, and its last layer (the output layer) for the output."""
    output = config.layers[-1]
    return Signature(MULTILAYER, tuple(example_shape(config)), config.input_type, (),
                     (Output(None, output.n_out, labels_of(output.loss)),))


def graph_signature(config: GraphConfig) -> Signature:
    """A ComputationGraph's: its inputs packed side by side, its outputs in ``config.outputs`` order."""
    outputs = tuple(Output(name, layer.n_out, labels_of(layer.loss))
                    for name, layer in zip(config.outputs, config.output_layers()))
    return Signature(GRAPH, tuple(example_shape(config)), config.input_type, tuple(config.inputs), outputs)


def torch_signature(loss) -> Signature:
    """A TorchModel's: no declared input, one output of unknown width, labelled as ``loss`` says."""
    return Signature(TORCH_MODULE, None, None, (), (Output(None, None, labels_of(loss)),))


def labels_of(loss) -> str:
    """VALUES for a regression loss (a name or a torch loss), else CLASSES."""
    return VALUES if is_regression_loss(loss) else CLASSES


__all__ = ["CLASSES", "GRAPH", "MULTILAYER", "Output", "Signature", "TORCH_MODULE", "VALUES",
           "graph_signature", "labels_of", "network_signature", "torch_signature"]
