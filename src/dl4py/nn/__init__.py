"""Networks: MultiLayerNetwork (from a config) and TorchModel (any torch module)."""

from dl4py.nn.model import Model
from dl4py.nn.network import MultiLayerNetwork
from dl4py.nn.loading import load
from dl4py.nn.torch_model import TorchModel

__all__ = ["Model", "MultiLayerNetwork", "TorchModel", "load"]
