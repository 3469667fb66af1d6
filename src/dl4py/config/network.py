"""NetworkConfig: a whole network as plain data (DL4J's MultiLayerConfiguration).

Build one directly, with the DL4J-style builder, or from a dict / JSON / YAML::

    conf = (NetworkConfig.builder()
            .seed(123).weight_init("xavier").updater(Nesterovs(learning_rate=0.01))
            .layer(ConvolutionLayer(n_out=20, kernel_size=(5, 5), activation="identity"))
            .layer(SubsamplingLayer(kernel_size=(2, 2), stride=(2, 2)))
            .layer(OutputLayer(n_out=10, loss="negativeloglikelihood"))
            .input_type(InputType.convolutional_flat(28, 28, 1))
            .build())

Defaults are DL4J's: weight init xavier, activation sigmoid, updater SGD(1e-3), no L2.
A config is validated (types, ranges, shapes through every layer) when it is created,
by the same path whichever way it is made (``schema.ConfigBase.__post_init__``); layers
may be given as objects or dicts, and DL4J's enum names ("RELU", "MCXENT") are accepted.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

import yaml

from dl4py.config.frozen import unfrozen
from dl4py.config.input_type import Convolutional, ConvolutionalFlat, FeedForward, InputType, Recurrent
from dl4py.config.layers import Activation, GradientNormalization, Layer, OutputLayer, Shape, WeightInit
from dl4py.config.network_rules import check_network_defaults, check_sequence_rules, check_threshold
from dl4py.config.schema import ConfigBase, dataclass_from_dict, join
from dl4py.config.updaters import AdamW, Sgd, Updater
from dl4py.config.yaml_loader import load_json, load_yaml
from dl4py.errors import ConfigError


@dataclass(frozen=True)
class LayerShapes:
    index: int
    layer: Layer
    input: Shape
    output: Shape


class NetworkText:
    """JSON and YAML text of a network config (NetworkConfig, GraphConfig), read back by its
    ``from_dict``."""

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str):
        return cls.from_dict(load_json(text))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str):
        return cls.from_dict(load_yaml(text))

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class NetworkConfig(NetworkText, ConfigBase):
    layers: tuple[Layer, ...] = ()
    input_type: InputType | None = None
    seed: int = 12345
    weight_init: WeightInit = "xavier"
    activation: Activation = "sigmoid"
    updater: Updater = field(default_factory=Sgd)
    l2: float = 0.0
    # DL4J's gradientNormalization(..) / gradientNormalizationThreshold(..): every layer's
    # default; a layer's own setting wins (train/gradient_normalization.py, docs/training.md).
    gradient_normalization: GradientNormalization = "none"
    gradient_normalization_threshold: float = 1.0

    # Built directly, errors still read network.layers[2].kernel_size.
    config_path: ClassVar[str] = "network"

    # ---- conversion -------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Any, where: str = "network") -> "NetworkConfig":
        if isinstance(data, dict) and "input_type" not in data:
            raise ConfigError(
                join(where, "input_type"),
                "is required: every layer's n_in is inferred from it "
                "(e.g. {type: convolutional_flat, height: 28, width: 28, channels: 1})",
            )
        return dataclass_from_dict(cls, data, where)

    @staticmethod
    def builder() -> "NetworkConfigBuilder":
        return NetworkConfigBuilder()

    # ---- validation and shape inference -------------------------------------------
    def validate(self, where: str = "network") -> None:
        if not self.layers:
            raise ConfigError(join(where, "layers"), "must hold at least one layer")
        if self.input_type is None:
            raise ConfigError(join(where, "input_type"), "is required: n_in is inferred from it")
        check_network_defaults(self, where)
        for i, layer in enumerate(self.layers):
            check_threshold(
                getattr(layer, "gradient_normalization_threshold", None),
                join(join(join(where, "layers"), i), "gradient_normalization_threshold"),
            )
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            if isinstance(layer, OutputLayer) and i != last:
                raise ConfigError(
                    join(join(where, "layers"), i),
                    f"an output layer must be the last layer (this is layer {i} of {last + 1})",
                )
        if not isinstance(self.layers[last], OutputLayer):
            raise ConfigError(
                join(join(where, "layers"), last),
                f"the last layer must be an output layer (with a loss), got {self.layers[last].type_name!r}",
            )
        if isinstance(self.updater, AdamW) and (
            self.l2 > 0 or any(getattr(layer, "l2", None) for layer in self.layers)
        ):
            raise ConfigError(
                join(where, "l2"),
                "AdamW decays weights itself (updater.weight_decay); do not combine it with l2",
            )
        self.layer_shapes(where)

    def layer_shapes(self, where: str = "network") -> list[LayerShapes]:
        """Input and output shape of every layer, inferred from ``input_type``."""
        shapes = []
        current = _first_shape(self.input_type, self.layers[0])
        for i, layer in enumerate(self.layers):
            at = join(join(where, "layers"), i)
            if unfrozen(layer).type_name in ("dense", "output") and current.kind == "cnn":
                current = current.flat()  # DL4J's CnnToFeedForwardPreProcessor
            check_sequence_rules(layer, i, current, at)
            out = layer.output_shape(current, at)
            shapes.append(LayerShapes(i, layer, current, out))
            current = out
        return shapes


def _first_shape(input_type: InputType, first: Layer) -> Shape:
    if isinstance(input_type, FeedForward):
        return Shape("ff", (input_type.size,))
    if isinstance(input_type, Recurrent):
        return Shape("rnn", (input_type.length, input_type.size))
    cnn = Shape("cnn", (input_type.channels, input_type.height, input_type.width))
    if isinstance(input_type, ConvolutionalFlat) and unfrozen(first).type_name in ("dense", "output"):
        return cnn.flat()
    assert isinstance(input_type, (Convolutional, ConvolutionalFlat))
    return cnn


class NetworkConfigBuilder:
    """DL4J-style fluent builder: ``.seed(..).updater(..).layer(..).input_type(..).build()``."""

    def __init__(self):
        self._fields: dict[str, Any] = {}
        self._layers: list[Layer] = []

    def layer(self, layer: Layer) -> "NetworkConfigBuilder":
        self._layers.append(layer)
        return self

    def __getattr__(self, name: str):
        names = {f.name for f in dataclasses.fields(NetworkConfig)} - {"layers"}
        if name not in names:
            raise AttributeError(f"NetworkConfig has no setting {name!r}; settings: {sorted(names)}")

        def setter(value):
            self._fields[name] = value
            return self

        return setter

    def build(self) -> NetworkConfig:
        # The dict path, for its "input_type is required" message; the values (objects,
        # dicts or DL4J names) are checked by the constructor, as everywhere.
        return NetworkConfig.from_dict({**self._fields, "layers": list(self._layers)})
