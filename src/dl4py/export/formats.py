"""``export(model, path, format)``: a model as a file other runtimes (or a lighter dl4py) read.

- ``onnx``: through torch's own exporter, the ``torch.export``-based one (``dynamo=True``,
  torch's default and the maintained one; the TorchScript-based exporter is deprecated).
  It needs ``onnxscript`` (and ``onnx``): ``pip install "dl4py[export]"``. One input
  ``features`` ``[batch, *example_shape]`` with a dynamic batch dimension, one output
  ``predictions`` ``[batch, n_out]`` after the output activation; the normalizer is folded in.
- ``torchscript``: the same module traced with ``torch.jit.trace``; ``torch.jit.load`` reads it.
- ``safetensors``: a dl4py model file holding only what inference needs (config, weights in
  safetensors entries, normalizer; no updater state, no float32 master copy, no generator
  state), which ``dl4py.load`` reads.
- ``dl4j``: a DL4J ModelSerializer zip (``dl4py.dl4j.save_dl4j``: DL4J 1.0's JSON, parameters,
  updater state, normalizer) that DL4J's ``ModelSerializer.restoreMultiLayerNetwork`` loads,
  for a network of the layers both sides have (docs/dl4j-import.md).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import warnings
import zipfile
from pathlib import Path

import torch

from dl4py.dl4j.writer import save_dl4j
from dl4py.errors import DataError, MissingDependencyError
from dl4py.export.wrapper import InferenceModule
from dl4py.io import atomic_write_bytes
from dl4py.nn.serialization import model_bytes

FORMATS = ("onnx", "torchscript", "safetensors", "dl4j")
SUFFIXES = {"onnx": ".onnx", "torchscript": ".pt", "safetensors": ".weights.dl4py", "dl4j": ".zip"}
INPUT_NAME, OUTPUT_NAME = "features", "predictions"
OPSET = 18  # the exporter's default in torch 2.13; ONNX Runtime runs it


def export(model, path, format: str = "onnx") -> Path:
    """Write ``model`` (a MultiLayerNetwork or ComputationGraph) to ``path`` in ``format``
    (``onnx``, ``torchscript``, ``safetensors`` or ``dl4j``); returns the path. The model is not changed.

    >>> export(model, "lenet.onnx")                      # doctest: +SKIP
    >>> export(model, "lenet.weights.dl4py", "safetensors")  # doctest: +SKIP
    """
    if format not in FORMATS:
        raise DataError(f"unknown export format {format!r}; one of {', '.join(FORMATS)}")
    path = Path(path)
    {"onnx": _onnx, "torchscript": _torchscript, "safetensors": _weights_only, "dl4j": save_dl4j}[format](model, path)
    return path


def default_path(model_path, format: str) -> Path:
    """Beside the model file: ``model.dl4py`` -> ``model.onnx``, ``model.pt``, ``model.weights.dl4py``,
    ``model.zip``."""
    model_path = Path(model_path)
    return model_path.with_name(model_path.name.split(".")[0] + SUFFIXES[format])


def _onnx(model, path: Path) -> None:
    atomic_write_bytes(path, onnx_bytes(model))


def onnx_bytes(model) -> bytes:
    """The ONNX file ``export(model, path, "onnx")`` writes, as bytes (weights inside)."""
    for package in ("onnx", "onnxscript"):
        try:
            __import__(package)
        except ImportError:
            raise MissingDependencyError("Exporting to ONNX", package, "export") from None
    module = InferenceModule(model)
    batch = torch.export.Dim("batch")
    with _quiet_exporter():
        program = torch.onnx.export(
            module, (module.example(),), input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
            dynamic_shapes=({0: batch},), opset_version=OPSET, dynamo=True, verbose=False,
        )
    buffer = io.BytesIO()
    program.save(buffer)  # weights inside the one file
    return buffer.getvalue()


@contextlib.contextmanager
def _quiet_exporter():
    """The exporter's notes on its own internals (which optional torch packages it skips,
    what it decomposes) are not the user's business: warnings and logs below errors."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "onnxscript", "onnx_ir")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _torchscript(model, path: Path) -> None:
    traced = traced_module(model)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit's deprecation notice
        torch.jit.save(traced, buffer)
    atomic_write_bytes(path, buffer.getvalue())


def traced_module(model) -> torch.jit.ScriptModule:
    """``InferenceModule(model)`` traced by ``torch.jit.trace``: what the TorchScript file holds."""
    module = InferenceModule(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit's deprecation notice; tracing still works
        return torch.jit.trace(module, module.example(), check_trace=False)


# Entries of a full model file that inference does not read.
_TRAINING_ONLY = ("updater.json", "updater.safetensors", "master.safetensors", "randomness.safetensors")


def _weights_only(model, path: Path) -> None:
    if not model.signature().from_config:
        raise DataError("the weights-only file rebuilds a network from its config; a TorchModel has none "
                        "(save it with model.save(path, save_updater=False))")
    full = zipfile.ZipFile(io.BytesIO(model_bytes(model, save_updater=False)))
    meta = json.loads(full.read("meta.json"))
    meta["has_updater"] = False
    meta.pop("randomness", None)  # the dropout generators' state goes with randomness.safetensors
    buffer = io.BytesIO()
    with full, zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED) as out:
        out.writestr("meta.json", json.dumps(meta, indent=2))
        for name in full.namelist():
            if name != "meta.json" and name not in _TRAINING_ONLY:
                out.writestr(name, full.read(name))
    atomic_write_bytes(path, buffer.getvalue())
