"""``load``: a saved model back as a working model (DL4J's ``ModelSerializer.restore...``).

Apart from ``serialization`` (which writes and restores state into a model it is given) so
that saving needs no network class: ``nn.model`` -> ``nn.serialization`` imports nothing
that imports ``nn.model`` back.
"""

from __future__ import annotations

from dl4py.config.graph import GraphConfig
from dl4py.errors import DataError
from dl4py.nn.declared_shapes import check_weights_declared
from dl4py.nn.graph import ComputationGraph
from dl4py.nn.model_file import read_model_file
from dl4py.nn.network import MultiLayerNetwork
from dl4py.nn.serialization import restore_saved


def load(path, into=None, backend=None, precision=None):
    """Restore a saved model (a path, or the bytes of a model file). A MultiLayerNetwork or
    ComputationGraph is rebuilt from its config; a TorchModel's weights are loaded ``into`` a TorchModel you
    construct with the same module class."""
    saved = read_model_file(path)
    meta = saved.meta
    if meta["kind"] in ("multilayer", "graph"):
        network = MultiLayerNetwork if meta["kind"] == "multilayer" else ComputationGraph
        if into is not None:
            raise ValueError(f"{saved.path} holds a {network.__name__}; it is rebuilt from its config, drop into=")
        check_weights_declared(saved)  # before the build: the config alone might ask for terabytes
        model = network(saved.config, backend=backend, precision=precision or meta["precision"])
    else:
        if into is None:
            raise DataError(
                f"{saved.path} holds the weights of a plain torch module ({meta['module_class']}); rebuild it "
                "and pass it: dl4py.load(path, into=TorchModel(MyModule(), loss, optimizer))"
            )
        model = into
    model.init()
    restore_saved(model, saved)
    return model


def network_model(network, backend=None, precision=None):
    """The model a config describes: a MultiLayerNetwork for a NetworkConfig, a
    ComputationGraph for a GraphConfig (a run config's network may be either)."""

    if isinstance(network, GraphConfig):
        return ComputationGraph(network, backend=backend, precision=precision)
    return MultiLayerNetwork(network, backend=backend, precision=precision)
