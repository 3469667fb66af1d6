"""FrozenLayer: a layer that keeps its parameters as they are (DL4J's ``FrozenLayer``).

A wrapper, as in DL4J: ``FrozenLayer(layer=DenseLayer(n_out=500))``, in YAML
``{type: frozen, layer: {type: dense, n_out: 500}}``. The wrapped layer has the same shape
and parameters; its parameters take no gradient and have no updater state (so no L2 or
weight decay touches them), and it always runs as in inference, as DL4J's FrozenLayer does:
batch normalization uses (and does not update) its running statistics, dropout keeps every
activation. ``TransferLearning`` (``dl4py.nn.transfer``) writes these wrappers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dl4py.config.layers import Layer, OutputLayer, Shape
from dl4py.config.schema import join
from dl4py.errors import ConfigError


@Layer.register("frozen")
@dataclass(frozen=True)
class FrozenLayer(Layer):
    layer: Layer

    has_params: ClassVar[bool] = True

    def validate(self, where: str) -> None:
        if isinstance(self.layer, FrozenLayer):
            raise ConfigError(join(where, "layer"), "is already a FrozenLayer; freeze a layer once")
        if isinstance(self.layer, OutputLayer):
            # A network trains through its output layer's loss: frozen, nothing would learn.
            raise ConfigError(
                join(where, "layer"),
                "an output layer cannot be frozen (it is what the network trains through); "
                "replace it instead (TransferLearning.remove_output_layer / n_out_replace)",
            )

    def output_shape(self, shape: Shape, where: str) -> Shape:
        return self.layer.output_shape(shape, join(where, "layer"))


def unfrozen(layer: Layer) -> Layer:
    """The layer itself, or the layer a FrozenLayer wraps: what decides shapes and modules."""
    return layer.layer if isinstance(layer, FrozenLayer) else layer


def is_frozen(layer: Layer) -> bool:
    return isinstance(layer, FrozenLayer)
