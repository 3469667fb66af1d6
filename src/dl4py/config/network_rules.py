"""The rules a NetworkConfig and a GraphConfig share: the settings every layer inherits, and
which input a layer may take (sequences, an embedding's indices).

Apart from ``network.py`` so that ``graph.py`` checks its vertices by the same rules without
reaching into the other config's module.
"""

from __future__ import annotations

from dl4py.config.frozen import unfrozen
from dl4py.config.layers import Layer, Shape
from dl4py.config.recurrent import EmbeddingLayer, EmbeddingSequenceLayer
from dl4py.config.schema import join
from dl4py.errors import ConfigError


def check_network_defaults(config, where: str) -> None:
    """The settings every layer inherits, as a NetworkConfig and a GraphConfig both have them."""
    if config.l2 < 0:
        raise ConfigError(join(where, "l2"), f"must be zero or more, got {config.l2}")
    check_threshold(config.gradient_normalization_threshold, join(where, "gradient_normalization_threshold"))


def check_threshold(threshold: float | None, where: str) -> None:
    """A gradient normalization threshold, when one is set, is positive."""
    if threshold is not None and not threshold > 0:  # "not >": NaN is refused too
        raise ConfigError(where, f"must be positive, got {threshold}")


def check_sequence_rules(layer: Layer, index: int, shape: Shape, where: str) -> None:
    """Sequences go only into layers that take them; embeddings take the network's input."""
    layer = unfrozen(layer)
    if index > 0 and isinstance(layer, (EmbeddingLayer, EmbeddingSequenceLayer)):
        raise ConfigError(where, f"{layer.type_name} takes integer indices from the network's input: it "
                                 f"must be the first layer (it is layer {index})")
    if shape.kind == "rnn" and not layer.takes_sequences:
        raise ConfigError(
            where,
            f"{layer.type_name} cannot take recurrent input [time, size] (shape {shape}): "
            "wrap the recurrent layer before it in last_time_step for one vector per sequence, "
            "or end with rnn_output for one output per step",
        )
