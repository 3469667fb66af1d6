"""The network as it is mapped from DL4J's layers onto dl4py's, layer by layer: ``NetworkMapping``.

One DL4J layer may become several dl4py layers (a DropoutLayer for DL4J's dropout on its input,
a ZeroPaddingLayer for uneven Same-mode padding, an ActivationLayer after batch normalization),
so dl4py's indices run ahead of DL4J's; the mapping keeps which DL4J layer each dl4py layer came
from (``owners``) and where each DL4J layer's parameters are in the built ``nn.Sequential``
(``prefixes``). The mappers (``layer_mapping``, ``convolution_mapping``) change it only through
its methods.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dl4py.config.frozen import unfrozen
from dl4py.config.layers import DropoutLayer, Layer, Shape
from dl4py.dl4j.json_dialects import DL4JConfiguration, LayerFields, number
from dl4py.dl4j.training_settings import dropout_rate, weight_init, weight_l2
from dl4py.errors import ConfigError


@dataclass
class NetworkMapping:
    """The network as it is mapped, layer by layer, with the shape that reaches the next one."""

    conf: DL4JConfiguration
    shape: Shape
    layers: list = field(default_factory=list)
    prefixes: dict = field(default_factory=dict)
    owners: list = field(default_factory=list)  # dl4py layer index -> DL4J layer index
    left_out: list = field(default_factory=list)
    # DL4J's L2 of the layers whose dl4py layer has no l2 field: they take the network's.
    l2_elsewhere: dict = field(default_factory=dict)

    def add(self, layer: Layer, fields: LayerFields) -> int:
        """Append ``layer`` (for DL4J layer ``fields.index``); its dl4py index."""
        shape = self.shape
        if unfrozen(layer).type_name in ("dense", "output") and shape.kind == "cnn":
            shape = shape.flat()  # as NetworkConfig flattens (DL4J's CnnToFeedForwardPreProcessor)
        try:
            self.shape = layer.output_shape(shape, f"layer {fields.index}")
        except ConfigError as exc:
            raise fields.error(str(exc).split(": ", 1)[-1]) from None
        self.layers.append(layer)
        self.owners.append(fields.index)
        return len(self.layers) - 1

    def add_with_dropout(self, fields: LayerFields, layer: Layer, prefix: str | None,
                         padding: Layer | None = None) -> int:
        """``layer`` after the DropoutLayer that DL4J's dropout on its input becomes (and after
        ``padding``, where given); ``prefix``: the path of its parameters under its module (None:
        it has none)."""
        rate = dropout_rate(fields, self.left_out)
        if rate:
            self.add(DropoutLayer(rate=rate), fields)
        if padding is not None:
            self.add(padding, fields)
        index = self.add(layer, fields)
        if prefix is not None:
            self.prefixes[fields.index] = f"{index}.{prefix}"
        return index

    def common(self, fields: LayerFields) -> dict:
        """Settings every dl4py layer with parameters takes: weight init, gradient normalization."""
        out = {"weight_init": weight_init(fields, self.left_out)}
        normalization = fields.get("gradientNormalization")
        if normalization and str(normalization).lower() != "none":
            out["gradient_normalization"] = normalization
            out["gradient_normalization_threshold"] = number(fields.raw.get("gradientNormalizationThreshold"), 1.0)
        return out

    def l2(self, fields: LayerFields) -> float:
        """The layer's L2 on its weights (what else it regularizes goes to ``left_out``)."""
        return weight_l2(fields, self.left_out)

    def l2_from_network(self, fields: LayerFields) -> None:
        """For a dl4py layer without an l2 field: it takes the network's L2 (``network_l2``)."""
        self.l2_elsewhere[fields.index] = weight_l2(fields, self.left_out)
