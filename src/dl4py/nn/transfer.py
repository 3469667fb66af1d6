"""Transfer learning: a new network from a trained one (DL4J's ``TransferLearning.Builder``).

Freeze the lower layers, replace the output layer, change the updater for what still
trains, then build::

    net = (TransferLearning(trained)          # a MultiLayerNetwork, or a saved model's path
           .fine_tune_configuration(FineTuneConfiguration(updater=Adam(1e-3), seed=7))
           .set_feature_extractor(3)          # layers 0..3 become FrozenLayers
           .remove_output_layer()
           .add_layer(OutputLayer(n_out=5))
           .build())

Every layer kept from the trained network keeps its parameters and batch-norm statistics
bit for bit; new and resized layers are initialised from the (fine-tune) seed. Kept layers
keep their index: layers are removed from, and added at, the output end only, as in DL4J.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from dl4py.config.frozen import FrozenLayer, unfrozen
from dl4py.config.layers import Layer, OutputLayer, WeightInit
from dl4py.config.network import NetworkConfig
from dl4py.config.schema import ConfigBase, join
from dl4py.config.updaters import Updater
from dl4py.errors import ConfigError
from dl4py.nn.loading import load
from dl4py.nn.network import MultiLayerNetwork

_HERE = "TransferLearning"


@dataclass(frozen=True)
class FineTuneConfiguration(ConfigBase):
    """Network-wide settings that replace the trained network's (DL4J's
    ``FineTuneConfiguration``); None keeps the original. ``updater`` steps every layer that is
    not frozen; ``learning_rate`` replaces the learning rate of the updater (this one's, else
    the trained network's); ``weight_init`` and ``seed`` initialise the new layers; ``l2``
    applies to the trainable layers that set none of their own."""

    updater: Optional[Updater] = None
    learning_rate: Optional[float] = None
    seed: Optional[int] = None
    l2: Optional[float] = None
    weight_init: Optional[WeightInit] = None

    def validate(self, where: str) -> None:
        if self.l2 is not None and self.l2 < 0:
            raise ConfigError(join(where, "l2"), f"must be zero or more, got {self.l2}")
        if self.learning_rate is not None and not self.learning_rate > 0:
            raise ConfigError(join(where, "learning_rate"), f"must be positive, got {self.learning_rate}")

    def changes(self, config: NetworkConfig) -> dict:
        """The fields of ``config`` (the trained network's) this configuration replaces."""
        changes = {name: value for name in ("updater", "seed", "l2", "weight_init")
                   if (value := getattr(self, name)) is not None}
        if self.learning_rate is not None:
            updater = changes.get("updater", config.updater)
            changes["updater"] = dataclasses.replace(updater, learning_rate=self.learning_rate)
        return changes


class TransferLearning:
    """DL4J's ``TransferLearning.Builder``: each method returns the builder; ``build()`` the
    new MultiLayerNetwork. ``TransferLearning.Builder(model)`` reads as in DL4J."""

    def __init__(self, model):

        if not isinstance(model, MultiLayerNetwork):
            if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
                model = load(model)  # a saved model: DL4J's ModelSerializer.restoreMultiLayerNetwork
            else:
                raise TypeError(f"{_HERE} needs a MultiLayerNetwork or a saved model's path, got {type(model).__name__}")
        self._source = model.init()
        self._layers: list[Layer] = list(model.config.layers)
        self._kept: list[bool] = [True] * len(self._layers)  # False: initialise, do not copy
        self._fine_tune: FineTuneConfiguration | None = None
        self._frozen_up_to: int | None = None

    # ---- DL4J's builder methods, in snake_case ------------------------------------------
    def fine_tune_configuration(self, fine_tune: FineTuneConfiguration) -> "TransferLearning":
        if not isinstance(fine_tune, FineTuneConfiguration):
            raise TypeError(f"fine_tune_configuration needs a FineTuneConfiguration, got {type(fine_tune).__name__}")
        self._fine_tune = fine_tune
        return self

    fine_tune = fine_tune_configuration

    def set_feature_extractor(self, layer: int) -> "TransferLearning":
        """Freeze layers 0 to ``layer``, inclusive (DL4J's ``setFeatureExtractor``)."""
        self._frozen_up_to = self._index(layer, "set_feature_extractor")
        return self

    def remove_output_layer(self) -> "TransferLearning":
        return self.remove_layers_from_output(1)

    def remove_layers_from_output(self, count: int) -> "TransferLearning":
        where = join(_HERE, "remove_layers_from_output")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigError(where, f"the number of layers to remove must be a positive integer, got {count!r}")
        if count >= len(self._layers):
            raise ConfigError(where, f"cannot remove {count} of the network's {len(self._layers)} layers: "
                                     "at least one must stay")
        del self._layers[-count:], self._kept[-count:]
        return self

    def add_layer(self, layer: Layer) -> "TransferLearning":
        """Append a new layer; its ``n_in`` is inferred from the layer below, as everywhere."""
        if not isinstance(layer, Layer):
            raise TypeError(f"add_layer needs a layer config (e.g. OutputLayer(n_out=5)), got {type(layer).__name__}")
        if self._layers and isinstance(self._layers[-1], OutputLayer):
            raise ConfigError(
                join(_HERE, "add_layer"),
                f"layer {len(self._layers) - 1} is the output layer; remove it first "
                "(remove_output_layer) to add layers above it",
            )
        self._layers.append(layer)
        self._kept.append(False)
        return self

    def n_out_replace(self, layer: int, n_out: int, weight_init: WeightInit | None = None) -> "TransferLearning":
        """Give ``layer`` ``n_out`` outputs; it is initialised anew (``weight_init``, else its
        own or the network's), and so is the next layer whose weights no longer fit."""
        index = self._index(layer, "n_out_replace")
        where = f"{join(_HERE, 'n_out_replace')}: layer {index}"
        current = unfrozen(self._layers[index])
        if not hasattr(current, "n_out"):
            raise ConfigError(where, f"({current.type_name}) has no n_out to replace")
        if isinstance(self._layers[index], FrozenLayer):
            raise ConfigError(where, "is frozen in the source network; its outputs cannot change")
        changes = {"n_out": n_out}
        if weight_init is not None:
            changes["weight_init"] = weight_init
        try:
            self._layers[index] = dataclasses.replace(current, **changes)
        except ConfigError as exc:
            raise ConfigError(where, str(exc)) from None
        self._kept[index] = False
        return self

    # ---- the new network ----------------------------------------------------------------------
    def build(self):
        """The new MultiLayerNetwork, on the source's backend and precision, with the kept
        layers' parameters copied and the rest initialised."""

        config = self._config()
        source = self._source
        network = MultiLayerNetwork(config, backend=source.backend, precision=source.precision).init()
        _copy_kept(source, network, [i for i, kept in enumerate(self._kept) if kept])
        network.set_normalizer(source.normalizer)
        return network

    def _config(self) -> NetworkConfig:
        layers = list(self._layers)
        if self._frozen_up_to is not None:
            last = len(layers) - 1
            if self._frozen_up_to >= last:
                raise ConfigError(
                    join(_HERE, "set_feature_extractor"),
                    f"layer {self._frozen_up_to} is not below the output layer (layer {last} of the new "
                    f"network): freeze at most up to layer {last - 1}; the output layer must train",
                )
            for i in range(self._frozen_up_to + 1):
                if not isinstance(layers[i], FrozenLayer):
                    layers[i] = FrozenLayer(layer=layers[i])
        changes = self._fine_tune.changes(self._source.config) if self._fine_tune else {}
        try:
            return self._source.config.replace(layers=tuple(layers), **changes)
        except ConfigError as exc:
            raise ConfigError(_HERE, f"the transferred network is not valid: {exc}") from None

    def _index(self, layer, method: str) -> int:
        where = join(_HERE, method)
        if isinstance(layer, str):
            raise ConfigError(where, f"a MultiLayerNetwork's layers have no names; give the layer's index, "
                                     f"not {layer!r}")
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise ConfigError(where, f"the layer must be an index, got {layer!r}")
        count = len(self._layers)
        if not 0 <= layer < count:
            raise ConfigError(where, f"layer {layer} does not exist: the network has layers 0 to {count - 1}")
        return layer


# DL4J spells the builder TransferLearning.Builder(model).
TransferLearning.Builder = TransferLearning


@torch.no_grad()
def _copy_kept(source, target, kept: list, layer_of=lambda root, key: root[key]) -> None:
    """Parameters and buffers of the kept layers, bit for bit (float32 masters where the
    precision keeps them). ``kept`` holds layer indices, or vertex names with ``layer_of``
    finding a vertex's module. A kept layer whose input size changed (below it,
    n_out_replace) cannot keep its weights and keeps its fresh ones."""
    source_root, target_root = source.stepped_module, target.stepped_module
    masters = target.precision_state.keeps_masters
    for key in kept:
        state, fresh = layer_of(source_root, key).state_dict(), layer_of(target_root, key).state_dict()
        if state.keys() == fresh.keys() and all(value.shape == fresh[name].shape for name, value in state.items()):
            layer_of(target_root, key).load_state_dict(state)
            if masters:  # the 16-bit buffers (running statistics) as well
                for name, buffer in layer_of(source.module, key).named_buffers():
                    layer_of(target.module, key).get_buffer(name).copy_(buffer)
    target.precision_state.after_sync()


def _graph_builder(graph):
    from dl4py.nn.graph_transfer import GraphTransferLearning  # cycle: dl4py.nn.graph_transfer imports this module

    return GraphTransferLearning(graph)


# DL4J's TransferLearning.GraphBuilder(graph): the same on a ComputationGraph, by vertex name.
TransferLearning.GraphBuilder = staticmethod(_graph_builder)
