"""Networks: MultiLayerNetwork and ComputationGraph (from a config) and TorchModel (any torch module)."""

from dl4py.nn.model import Model
from dl4py.nn.network import MultiLayerNetwork
from dl4py.nn.graph import ComputationGraph
from dl4py.nn.loading import load
from dl4py.nn.torch_model import TorchModel
from dl4py.nn.transfer import FineTuneConfiguration, TransferLearning

__all__ = ["ComputationGraph", "FineTuneConfiguration", "Model", "MultiLayerNetwork", "TorchModel", "TransferLearning", "load"]
