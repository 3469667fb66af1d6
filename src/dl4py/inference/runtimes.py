"""Which runtime answers ParallelInference's requests: torch, ONNX Runtime or TorchScript.

- ``torch``: copies of the model's own module (``replicas.py``), in the model's precision,
  on any device. What ``model.output`` runs.
- ``onnx``: the file ``export(model, path, "onnx")`` writes (normalizer and output activation
  folded in), run by ONNX Runtime on the CPU. For a small network most of a one-image
  ``model.output`` is torch's per-operator dispatch, which ONNX Runtime's planned graph does
  without: LeNet answers one image about 3x faster.
- ``torchscript``: the same inference module traced by ``torch.jit.trace``, on any device.
- ``auto`` (the default): ``onnx`` where it can give what ``model.output`` gives (the export
  extra installed, every replica on the CPU, the ``float`` precision, the network exports),
  else ``torch``; the reason is kept in ``RuntimeChoice.reason``.

The file-based runtimes run the float32 network, so they are offered for the ``float``
precision only. Before a file-based runtime is used, a probe batch goes through it and through
``model.output``: answers further apart than ``TOLERANCE`` (relative to the output's size, at
least 1) are refused, so a runtime never answers what the model would not.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import sys
from dataclasses import dataclass

import numpy as np
import torch

from dl4py.errors import ConfigError, DataError
from dl4py.export.formats import INPUT_NAME, onnx_bytes, traced_module
from dl4py.export.wrapper import example_shape
from dl4py.inference.replicas import CHUNK, Replica, make_replicas, replica_devices

log = logging.getLogger("dl4py.inference")

RUNTIMES = ("auto", "torch", "onnx", "torchscript")
TOLERANCE = 1e-5
PROBE_EXAMPLES = 4
_ONNX_PACKAGES = ("onnxruntime", "onnx", "onnxscript")


@dataclass(frozen=True)
class RuntimeChoice:
    """The runtime that answers, and why that one (``auto`` says what it weighed)."""
    name: str
    reason: str


def make_runtime_replicas(model, workers: int, devices, runtime: str) -> tuple[list, RuntimeChoice]:
    """``workers`` replicas of ``model`` over ``devices`` in ``runtime``, and the choice made."""
    if runtime not in RUNTIMES:
        raise ConfigError("runtime", f"must be one of {', '.join(RUNTIMES)}; got {runtime!r}")
    placed = replica_devices(model, workers, devices)
    if runtime == "torch":
        return make_replicas(model, placed), RuntimeChoice("torch", "asked for")
    if runtime == "auto":
        reason = _why_not_onnx(model, placed)
        if reason is None:
            try:
                return _onnx_replicas(model, placed), RuntimeChoice(
                    "onnx", "auto: the export extra is installed and the network exports")
            except Exception as error:  # noqa: BLE001 - any failure to export or load falls back to torch
                reason = f"the network does not run in ONNX Runtime ({_first_line(error)})"
                log.info("ParallelInference: runtime torch: %s", reason)
        return make_replicas(model, placed), RuntimeChoice("torch", reason)
    unfit = _why_not_file_runtime(model, placed, runtime)
    if unfit is not None:
        raise ConfigError("runtime", f"{runtime} cannot serve this model: {unfit}; use runtime torch")
    replicas = _onnx_replicas(model, placed) if runtime == "onnx" else _torchscript_replicas(model, placed)
    return replicas, RuntimeChoice(runtime, "asked for")


def _why_not_onnx(model, placed) -> str | None:
    missing = [name for name in _ONNX_PACKAGES if not _installed(name)]
    if missing:
        return f"auto: {', '.join(missing)} not installed (pip install \"dl4py[export]\")"
    unfit = _why_not_file_runtime(model, placed, "onnx")
    return None if unfit is None else f"auto: {unfit}"


def _installed(name: str) -> bool:
    """Whether ``import name`` can work, without importing it (onnxscript takes a second)."""
    if name in sys.modules:
        return sys.modules[name] is not None  # None: a program (or a test) ruled the package out
    return importlib.util.find_spec(name) is not None


def _why_not_file_runtime(model, placed, runtime: str) -> str | None:
    """Why a file runtime cannot give ``model.output``'s answers here, or None when it can."""
    if model.precision.name != "float":
        return f"it runs the float32 network and this model's precision is {model.precision.name}"
    if runtime == "onnx" and any(device.type != "cpu" for device in placed):
        return "ONNX Runtime runs the replicas on the CPU here, and a replica is placed on " + \
               next(str(d) for d in placed if d.type != "cpu")
    try:
        example_shape(model)
    except DataError as error:
        return str(error)
    return None


def _onnx_replicas(model, placed) -> list["OnnxReplica"]:
    import onnxruntime  # optional: onnxruntime (extra export)

    file_bytes = onnx_bytes(model)
    # One intra-op thread a session: a small request runs fastest and takes the least CPU so
    # (LeNet, one image: 65 us against 89 with two threads that sleep between operators, 150 with
    # two that spin); more cores serve through more replicas (workers).
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3  # errors only: its notes on graph optimizations are not the user's
    replicas = [OnnxReplica(model, onnxruntime.InferenceSession(file_bytes, options,
                                                                providers=["CPUExecutionProvider"]), device, index)
                for index, device in enumerate(placed)]
    _check_answers(model, replicas[0], "onnx")
    log.info("ParallelInference: runtime onnx (ONNX Runtime %s, one intra-op thread per replica)",
             onnxruntime.__version__)
    return replicas


def _torchscript_replicas(model, placed) -> list["TorchScriptReplica"]:
    traced = traced_module(model)
    replicas = []
    for index, device in enumerate(placed):
        # A module of its own per replica: one replica's .to(device) must not move another's.
        module = traced if index == 0 else copy.deepcopy(traced)
        module = module if device.type == "cpu" else module.to(device)  # traced on the CPU
        replicas.append(TorchScriptReplica(model, module, device, index))
    _check_answers(model, replicas[0], "torchscript")
    return replicas


class OnnxReplica(Replica):
    """One ONNX Runtime session answering as ``Replica.predict`` does (raw features in,
    ``model.output``'s answers out, on the model's device); one run at a time."""

    runtime = "onnx"

    def __init__(self, model, session, device: torch.device, index: int):
        super().__init__(model, None, device, index)
        self.session = session

    def run(self, features: torch.Tensor) -> torch.Tensor:
        features = features.detach()
        if features.device.type != "cpu" or features.dtype != torch.float32:
            features = features.to("cpu", torch.float32)
        array = features.numpy()
        if array.shape[0] <= CHUNK:  # one run (a request's few examples): no slicing, no concatenation
            outputs = self.session.run(None, {INPUT_NAME: np.ascontiguousarray(array)})[0]
        else:
            outputs = np.concatenate([self.session.run(None, {INPUT_NAME: np.ascontiguousarray(
                array[start:start + CHUNK])})[0] for start in range(0, array.shape[0], CHUNK)])
        predictions = torch.from_numpy(outputs)
        device = self.model.backend.device
        return predictions if device.type == "cpu" else predictions.to(device)

    def __repr__(self) -> str:
        return f"OnnxReplica({self.index}, {self.device})"


class TorchScriptReplica(Replica):
    """A traced inference module (normalizer and activation inside) on ``device``."""

    runtime = "torchscript"

    def run(self, features: torch.Tensor) -> torch.Tensor:
        out_device = self.model.backend.device
        with torch.no_grad():
            outputs = [self.module(features[start:start + CHUNK].to(self.device)).to(out_device)
                       for start in range(0, features.shape[0], CHUNK)]
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0]

    def __repr__(self) -> str:
        return f"TorchScriptReplica({self.index}, {self.device})"


def _check_answers(model, replica, runtime: str) -> None:
    """A probe batch through ``replica`` and through ``model.output``: the same answers, or a
    ConfigError naming how far apart they are."""
    probe = _probe(model)
    wanted = model.output(probe).detach().to("cpu", torch.float32)
    got = replica.predict(probe).detach().to("cpu", torch.float32)
    if got.shape != wanted.shape:
        raise ConfigError("runtime", f"{runtime} answers a batch of {PROBE_EXAMPLES} with shape {list(got.shape)} "
                                     f"where model.output gives {list(wanted.shape)}; use runtime torch")
    apart = float(((got - wanted).abs() / wanted.abs().clamp(min=1.0)).max())
    if not apart <= TOLERANCE:
        raise ConfigError("runtime", f"{runtime} answers differ from model.output by {apart:.2e} on a probe "
                                     f"batch (at most {TOLERANCE:g} allowed); use runtime torch")


def _probe(model) -> torch.Tensor:
    """Examples the network sees as typical: standard normal after the model's normalizer (raw
    features drawn at random could be thousands of deviations out where a pixel hardly varies,
    and saturate every output to the same 0 and 1)."""
    generator = torch.Generator().manual_seed(0)
    normalized = torch.randn((PROBE_EXAMPLES, *example_shape(model)), generator=generator)
    return normalized if model.normalizer is None else model.normalizer.revert(normalized)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200]}" if text else type(error).__name__
