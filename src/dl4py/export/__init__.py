"""Exporting a trained model: ONNX, TorchScript, and a weights-only dl4py model file.

    from dl4py.export import export
    export(model, "lenet.onnx")                          # ONNX Runtime, TensorRT, ...
    export(model, "lenet.pt", format="torchscript")      # torch.jit.load, C++ libtorch
    export(model, "lenet.weights.dl4py", format="safetensors")  # dl4py.load, no updater state

or ``dl4py export MODEL --format onnx``. ONNX needs ``pip install "dl4py[export]"``.
"""

from dl4py.export.formats import FORMATS, default_path, export
from dl4py.export.wrapper import InferenceModule

__all__ = ["FORMATS", "InferenceModule", "default_path", "export"]
